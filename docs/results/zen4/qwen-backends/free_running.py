"""Greedy agreement between target backends, each decoding freely (plain greedy, chat template):

    python free_running.py FOLDER GGUF N_NEW hf,ort,llamacpp OUT.json
"""
import json, sys, time
from pathlib import Path
import torch
from dflash.chat import chat_prompt_ids
from dflash.engine.target.protocol import TargetRow
from dflash.loading import target_builders

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
    "Explain in two sentences what a database index is.",
    "Write a haiku about databases.",
    "Extract the name and city as JSON: Mara Quill lives in Denver and works at a bakery.",
    "Write a bash one-liner that counts the lines of every .py file under the current directory.",
]

def greedy(target, ids, n):
    seq = target.new_sequence()
    out = []
    logits = target.forward_batch([TargetRow(seq, ids, 1)], ()).logits[0]
    for _ in range(n):
        t = int(logits[-1].argmax())
        out.append(t)
        if t in target.eos_ids:
            break
        logits = target.forward_batch([TargetRow(seq, [t], 1)], ()).logits[0]
    target.free(seq)
    return out

def main():
    target_dir, gguf, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    backends = sys.argv[4].split(",")
    torch.set_num_threads(2)
    builders = target_builders(target_dir, gguf=gguf)
    outs = {}
    for name in backends:
        t0 = time.time()
        target = builders[name]()
        prompts = [chat_prompt_ids(target.tokenizer, p) for p in PROMPTS]
        outs[name] = [greedy(target, ids, n) for ids in prompts]
        print(name, f"{time.time() - t0:.0f}s", file=sys.stderr)
        del target
    ref = backends[0]
    report = {"target": str(target_dir), "gguf": str(gguf), "new_tokens": n, "prompts": PROMPTS, "outputs": outs,
              "first_divergence": {}}
    for a in backends:
        for b in backends:
            if a < b:
                div = []
                for x, y in zip(outs[a], outs[b]):
                    k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
                    div.append(k if k is not None else (None if len(x) == len(y) else min(len(x), len(y))))
                report["first_divergence"][f"{a} vs {b}"] = div
    print(json.dumps(report["first_divergence"]))
    json.dump(report, sys.stdout if len(sys.argv) < 6 else open(sys.argv[5], "w"), indent=1)

main()
