"""Continuous batching of C callers in-process (as the scheduler does), arms alternating (scratch)."""
import sys, time, collections
from dflash.cli import build_parser
from dflash.loading import engine_from_args
from dflash.engine.engine import GenerationRequest
from dflash.engine.knobs import DEFAULT_STEP_TOKENS
from dflash.suites import load_suite
args = build_parser().parse_args(["bench", "--threads", "2"] + sys.argv[4:])
eng = engine_from_args(args)
eng.max_batch = 16
import onnxruntime
ORT = [0.0]
_o = onnxruntime.InferenceSession.run_with_iobinding
def _r(self, *a, **k):
    t0 = time.perf_counter()
    try: return _o(self, *a, **k)
    finally: ORT[0] += time.perf_counter() - t0
onnxruntime.InferenceSession.run_with_iobinding = _r
CURVE = eng.cost_curve
PRED = [0.0, 0, 0]
_fb = eng.target.forward_batch
def _fbw(rows, layer_ids=()):
    PRED[0] += CURVE.forward_s(len(rows), sum(len(r.ids) for r in rows)); PRED[1] += sum(len(r.ids) for r in rows if r.logits == len(r.ids))
    return _fb(rows, layer_ids)
eng.target.forward_batch = _fbw
C = int(sys.argv[1]); suite = sys.argv[2]; arms_s = sys.argv[3].split(",")
texts = load_suite(suite, None)
N = 32
prompts = [eng.prompt_ids(GenerationRequest(prompt=texts[i % len(texts)], chat=True)) for i in range(N)]

ARMS = {"all": None, "nohead": ("dflash", "suffix"), "suffix": ("suffix",), "sh": ("suffix", "head"), "ar": "ar"}
def req(arm, ids):
    if ARMS[arm] == "ar": return GenerationRequest(input_ids=ids, max_new_tokens=64, block_size=1)
    return GenerationRequest(input_ids=ids, max_new_tokens=64, proposers=ARMS[arm])
def run(arm):
    queue = list(range(N)); active = []; outs = {}; agg = collections.Counter(); steps = 0
    ORT[0] = 0.0; PRED[0] = 0.0; PRED[1] = 0
    t = time.perf_counter()
    while queue or active:
        while queue and len(active) < C:
            i = queue.pop(0); active.append((i, eng.admit(req(arm, prompts[i]))))
        eng.step([s for _, s in active], DEFAULT_STEP_TOKENS); steps += 1
        for i, s in [x for x in active if x[1].done]:
            r = eng.finish(s); outs[i] = r.output_ids
            for k, v in r.stats.by_proposer.items():
                for kk, vv in v.items():
                    if isinstance(vv, (int, float)): agg[f"{k}.{kk}"] += vv
        active = [x for x in active if not x[1].done]
    agg['ort_s'] = round(ORT[0], 2); agg['pred_s'] = round(PRED[0], 2); agg['decode_rows'] = PRED[1]; agg['wall_s'] = round(time.perf_counter() - t, 2)
    return time.perf_counter() - t, sum(len(o) for o in outs.values()), outs, agg, steps
run(arms_s[0])
tot = {a: [0.0, 0] for a in arms_s}; res = {}; sums = {a: collections.Counter() for a in arms_s}
import os
for rnd in range(int(os.environ.get("ROUNDS", "2"))):
    for arm in (arms_s if rnd % 2 == 0 else arms_s[::-1]):
        w, n, outs, agg, steps = run(arm); tot[arm][0] += w; tot[arm][1] += n; sums[arm].update({k: agg[k] for k in ('ort_s', 'pred_s', 'wall_s')}); res[arm] = (outs, agg, steps)
for a in arms_s: print(f"{a:8s} model(pred+outside) {sums[a]['pred_s'] + sums[a]['wall_s'] - sums[a]['ort_s']:.2f}s  pred {sums[a]['pred_s']:.2f} outside {sums[a]['wall_s'] - sums[a]['ort_s']:.2f} ort {sums[a]['ort_s']:.2f} wall {sums[a]['wall_s']:.2f}")
for a in arms_s: print(a, 'ORT/pred', round(sums[a]['ort_s'] / sums[a]['pred_s'], 3), 'outside ORT per wall', round(1 - sums[a]['ort_s'] / sums[a]['wall_s'], 3))
for a, (w, n) in tot.items(): print(f"C={C} {suite} {a}: {n/w:.1f} tok/s  steps {res[a][2]}  {dict(res[a][1])}")
if "ar" in res:
    print("mismatches vs ar:", {a: sum(res[a][0][i] != res['ar'][0][i] for i in range(N)) for a in res})
