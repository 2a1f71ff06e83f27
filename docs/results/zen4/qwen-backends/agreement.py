"""Greedy agreement between target backends (the run in this folder):

    python agreement.py TARGET_NAME N_NEW OUT.json [PIVOT]

The PIVOT backend (default `ort`) decodes each prompt greedily (N_NEW tokens or its end),
free-running; every other backend reads that answer teacher-forced in one forward (logits
of every answer row). A backend's greedy decoding follows the pivot's answer exactly up to
the first row whose argmax differs, so that row is where the two free-running answers first
differ. Between two other backends B and C: both follow the pivot up to min(d_B, d_C); there
their argmaxes are compared (the same token there, both off the pivot's answer, is reported
as ">= row": they agree at least that far). Caveat:
llama.cpp reads the answer in one batched call, whose kernels can round otherwise than its
one-token steps.
"""
import json, sys, time
import torch
from dflash.chat import chat_prompt_ids
from dflash.engine.target.protocol import TargetRow
from dflash.loading import target_builders
from dflash.model_files import resolve_target

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
    "Explain in two sentences what a database index is.",
    "Write a haiku about databases.",
    "Extract the name and city as JSON: Mara Quill lives in Denver and works at a bakery.",
    "Write a bash one-liner that counts the lines of every .py file under the current directory.",
]
BACKENDS = ("ort", "hf", "llamacpp", "ort-q4_k_m")

def greedy(target, ids, n):
    seq, out = target.new_sequence(), []
    logits = target.forward_batch([TargetRow(seq, ids, 1)], ()).logits[0]
    for _ in range(n):
        t = int(logits[-1].argmax())
        out.append(t)
        if t in target.eos_ids:
            break
        logits = target.forward_batch([TargetRow(seq, [t], 1)], ()).logits[0]
    target.free(seq)
    return out

def forced(target, ids, answer):
    seq = target.new_sequence()
    logits = target.forward_batch([TargetRow(seq, ids + answer[:-1], len(answer))], ()).logits[0]
    target.free(seq)
    return [int(x) for x in logits.argmax(-1)]

def first_off(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)

def main():
    name, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    PIVOT = sys.argv[4] if len(sys.argv) > 4 else "ort"
    torch.set_num_threads(2)
    files = resolve_target(name, quiet=True)
    builders = target_builders(files.folder, gguf=files.gguf)
    t0 = time.time()
    pivot = builders[PIVOT]()
    prompts = [chat_prompt_ids(pivot.tokenizer, p) for p in PROMPTS]
    answers = [greedy(pivot, ids, n) for ids in prompts]
    del pivot
    argmax, seconds = {PIVOT: answers}, {PIVOT: time.time() - t0}
    for b in (b for b in BACKENDS if b != PIVOT):
        t0 = time.time()
        target = builders[b]()
        argmax[b] = [forced(target, ids, a) for ids, a in zip(prompts, answers)]
        seconds[b] = time.time() - t0
        del target
    names = list(argmax)
    off = {b: [first_off(x, a) for x, a in zip(argmax[b], answers)] for b in names}
    pairs = {}
    for i, b in enumerate(names):
        for c in names[i + 1:]:
            row = []
            for k, (db, dc) in enumerate(zip(off[b], off[c])):
                if db is None and dc is None:
                    row.append(None)
                    continue
                m = min(x for x in (db, dc) if x is not None)
                row.append(m if argmax[b][k][m] != argmax[c][k][m] else f">={m}")
            pairs[f"{b} vs {c}"] = row
    report = {"target": name, "new_tokens": n, "prompts": PROMPTS, "pivot": PIVOT, "answer_lengths": [len(a) for a in answers],
              "first_divergence": pairs, "seconds": seconds, "argmax": argmax}
    json.dump(report, open(out, "w"), indent=1)
    print(json.dumps({"answer_lengths": report["answer_lengths"], "first_divergence": pairs}))

main()
