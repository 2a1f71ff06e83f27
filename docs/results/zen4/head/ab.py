"""Per prompt, every method in turn (as dflash bench does): tokens/s and where a step's time goes (ONNX Runtime's run, the rest, the head, the plan). usage: PYTHONPATH=worker python ab.py SUITE METHOD,METHOD,... (sh: suffix + head; nohead: drafter + suffix)"""
import sys, time, collections, functools
from dflash.cli import build_parser
from dflash.loading import engine_from_args
from dflash.engine.engine import GenerationRequest
from dflash.suites import load_suite
import dflash.engine.step as stepm, dflash.engine.proposers.suffix as sfx, dflash.engine.policy as pol
import dflash.engine.stats as stats, dflash.engine.target.ort as ortm, dflash.engine.engine as engm
acc = collections.defaultdict(float)
def wrap(owner, name, label=None):
    f = getattr(owner, name); label = label or name
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t
    setattr(owner, name, g)
args = build_parser().parse_args(["bench", "--threads", "2"])
eng = engine_from_args(args)
import onnxruntime
wrap(stepm, "step", "step"); wrap(stepm, "_plan"); wrap(stepm, "verify"); wrap(stepm, "commit")
wrap(sfx.SuffixProposer, "propose", "suffix.propose"); wrap(sfx, "propose_from"); wrap(sfx.SuffixProposer, "observe", "suffix.observe"); sfx.SuffixProposer.observe = staticmethod(sfx.SuffixProposer.observe)
wrap(sfx.SuffixProposer, "learn", "suffix.learn")
import dflash.engine.proposers.suffix_index as si
wrap(si.SuffixIndex, "_match", "ix._match"); wrap(si.SuffixIndex, "_extend_back", "ix._extend_back"); wrap(si.SuffixIndex, "_window", "ix._window"); wrap(si._Level, "lookup", "lev.lookup"); wrap(si._Level, "hash", "lev.hash")
import dflash.engine.proposers.head as hd
wrap(hd.HeadProposer, "propose", "head.propose")
wrap(pol.BlockPolicy, "plan", "policy.plan"); wrap(pol.BlockPolicy, "price", "policy.price"); wrap(pol.BlockPolicy, "observe_suffix", "policy.observe_suffix")
wrap(pol.BlockPolicy, "observe", "policy.observe")
wrap(stats.GenerationStats, "record", "stats.record")
wrap(engm.Engine, "prices", "engine.prices"); wrap(engm.Engine, "step", "engine.step"); wrap(engm.Engine, "admit", "admit"); wrap(engm.Engine, "finish", "finish")
t = eng.target
wrap(t, "forward_batch"); wrap(t, "rollback")
sess = t.session
orig_run = sess.run_with_iobinding
def run(*a, **k):
    s = time.perf_counter()
    try: return orig_run(*a, **k)
    finally: acc["ORT run"] += time.perf_counter() - s
sess.run_with_iobinding = run
suite = sys.argv[1]; methods = sys.argv[2].split(",")
texts = load_suite(suite, 10)
prompts = [eng.prompt_ids(GenerationRequest(prompt=p, chat=True)) for p in texts]
def req(m, ids, key):
    return GenerationRequest(input_ids=ids, max_new_tokens=128, block_size=1 if m == "ar" else None,
                             workload=key, proposers={"suffix": ("suffix",), "sh": ("suffix", "head"), "nohead": ("dflash", "suffix")}.get(m))
for m in methods: eng.generate(req(m, prompts[0], None))
import collections
tot = collections.defaultdict(lambda: collections.defaultdict(float))
for rnd in range(2):
    keys = {}
    for m in methods:
        keys[m] = f"p:{suite}:{m}:{rnd}"; eng.workloads.load(keys[m], [])
    for ids in prompts:
        for m in methods:
            acc.clear(); t0 = time.perf_counter()
            r = eng.generate(req(m, ids, keys[m]))
            wall = time.perf_counter() - t0
            T = tot[m]; T["wall"] += wall; T["steps"] += len(r.stats.steps); T["toks"] += len(r.output_ids)
            for k, v in acc.items(): T[k] += v
for m in methods:
    T = tot[m]; n = T["steps"]
    print(f"{m}: {T['toks']/T['wall']:.1f} tok/s, {int(n)} steps, wall/step {T['wall']/n*1e3:.3f} ms, ORT run/step {T['ORT run']/n*1e3:.3f}, outside {(T['wall']-T['ORT run'])/n*1e3:.3f}, fwd python {(T['forward_batch']-T['ORT run'])/n*1e3:.3f}, head {T['head.propose']/n*1e3:.3f}, plan {T['_plan']/n*1e3:.3f}")
