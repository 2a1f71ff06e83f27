"""Greedy agreement with the shipped GGUF (llama.cpp decoding freely) of several ort exports
read teacher-forced: where each one's greedy answer would first leave llama.cpp's.
usage: agree.py N_NEW OUT.json DIR [DIR...]   (DIR: an ort export folder; 'hf' for the fp32 reference)"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(2)
from dflash.chat import chat_prompt_ids
from dflash.engine.target import ort
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
    "Write a Python class for a stack with push, pop and peek.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize in one sentence: The meeting moved to Thursday because the projector broke and two people were sick.",
    "Classify the sentiment of this review as positive, negative or neutral: The soup was cold and the waiter rude.",
    "Write a JavaScript function that debounces another function.",
    "Give three tips for writing readable code.",
]

def greedy(t, ids, n):
    seq, out = t.new_sequence(), []
    lg = t.forward_batch([TargetRow(seq, ids, 1)], ()).logits[0]
    for _ in range(n):
        x = int(lg[-1].argmax()); out.append(x)
        if x in t.eos_ids: break
        lg = t.forward_batch([TargetRow(seq, [x], 1)], ()).logits[0]
    t.free(seq); return out

def forced(t, ids, ans):
    seq = t.new_sequence()
    lg = t.forward_batch([TargetRow(seq, ids + ans[:-1], len(ans))], ()).logits[0]
    t.free(seq); return [int(x) for x in lg.argmax(-1)]

n, out, dirs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
files = resolve_target("qwen2.5-coder-1.5b-instruct", quiet=True)
b = target_builders(files.folder, gguf=files.gguf)
piv = b["llamacpp"]()
prompts = [chat_prompt_ids(piv.tokenizer, p) for p in PROMPTS]
answers = [greedy(piv, ids, n) for ids in prompts]
del piv
res = {"n_new": n, "lengths": [len(a) for a in answers], "first_off": {}}
for d in dirs:
    t = b["hf"]() if d == "hf" else ort.OrtTarget(Path(d) / "model.onnx", files.folder, threads=2)
    offs = []
    for ids, a in zip(prompts, answers):
        am = forced(t, ids, a)
        offs.append(next((k for k, (x, y) in enumerate(zip(am, a)) if x != y), None))
    res["first_off"][d] = offs
    same = sum(o is None for o in offs)
    mean = sum((o if o is not None else l) for o, l in zip(offs, res["lengths"])) / len(offs)
    print(d.split("/")[-1], offs, f"same {same}/{len(offs)}, mean first-off (capped) {mean:.1f}", flush=True)
    del t
json.dump(res, open(out, "w"), indent=1)
