"""The next-token head's distribution at every answer position of a `dflash bench` run's `ar` outputs, from the
ort target's own features (for pick.py):  python headfeat.py RUN_DIR feat.pkl  (run from the repository root)"""
import sys, json, shlex, argparse, pickle
from pathlib import Path
import numpy as np, torch
sys.argv = sys.argv
from dflash.bench import replay as R
from dflash.engine.proposers import head as H
from dflash.engine.target import TargetRow

run = Path(sys.argv[1]); out = Path(sys.argv[2])
torch.set_num_threads(2)
# prompts/outputs like replay_run
from transformers import AutoTokenizer
from dflash.bench.args import add_bench_args
from dflash.loading import add_model_args, load_target
from dflash.model_files import ensure_default_target, default_target_dir
from dflash.suites import load_prompts_file, load_suite
report = json.loads((run / "results.json").read_text())
p = argparse.ArgumentParser(); add_model_args(p); add_bench_args(p)
args = p.parse_args(shlex.split(report["command"])[2:])
tok = AutoTokenizer.from_pretrained(args.target or ensure_default_target(quiet=True))
journal = {}
for line in (run / "samples.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row.get("method") == "ar":
        journal[(row["suite"], row["index"])] = row
suites = [s for s in args.suites.split(",") if s and s != "none"]
texts = [(s, load_suite(s, args.limit)) for s in suites] + [(Path(f).stem, load_prompts_file(f)) for f in args.prompts]
target = load_target(default_target_dir(), "ort")
hw = H.load(Path("worker/dflash/assets/heads") / "default" if (Path("worker/dflash/assets/heads")/"default").exists() else next(Path("worker/dflash/assets/heads").glob("*/")))
outemb = target.head_weight().detach().float()[torch.as_tensor(hw.vocab)].numpy()
layer = target.num_layers - 1
data = {}
for suite, pt in texts:
    reqs = []
    for i, t in enumerate(pt):
        prompt = list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False))
        o = journal[(suite, i)]["output_ids"]
        ids = prompt + o
        seq = target.new_sequence()
        try:
            feats = target.forward_batch([TargetRow(seq, ids, 1)], (layer,)).features[0].numpy()
        finally:
            target.free(seq)
        P = len(prompt)
        # position j (o_j just committed, chosen by row P-1+j): guess o_{j+1}
        r = feats[P - 1:P - 1 + len(o)]
        e = target.embed(torch.tensor(o)).detach().float().numpy()
        x = np.concatenate([H.rms_norm(r, hw.final_norm), e], -1)
        u = x @ hw.proj.T + hw.bias
        z = H.rms_norm(u, hw.gain)
        lg = z @ outemb.T
        pr = np.exp(lg - lg.max(-1, keepdims=True)); pr /= pr.sum(-1, keepdims=True)
        reqs.append({"prompt": prompt, "output": o, "probs": pr.astype(np.float16),
                     "timing": (journal[(suite, i)]["wall_s"], journal[(suite, i)]["prefill_s"])})
    data[suite] = reqs
    acc = np.mean([ (r["probs"][j].argmax() == np.where(hw.vocab == r["output"][j+1])[0][:1]).any() for r in reqs for j in range(len(r["output"])-1)])
    print(suite, len(reqs), "head top1", round(float(acc), 3), flush=True)
pickle.dump({"vocab": hw.vocab, "data": data, "verify_s": report["verify_s"], "max_new": args.max_new_tokens}, open(out, "wb"))
