"""A named model's greedy answers to N offline training prompts (dflash.train.data.collect_prompts:
the bench's prompts excluded), through a running worker, 8 at a time; JSONL for
`python -m dflash.train.next_head --answers`. Usage: answers.py SOCKET MODEL N TOKENS OUT."""
import json, sys, threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from transformers import AutoTokenizer
from dflash.chat import chat_prompt_ids
from dflash.model_files import cache_dir
from dflash.serve.client import Client
from dflash.train.data import collect_prompts

sock, model, n, tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
tok = AutoTokenizer.from_pretrained(str(cache_dir() / model))
prompts = collect_prompts(n)
lock = threading.Lock()
f = out.open("w")

def one(p):
    with Client(sock) as c:
        r = c.call("generate", {"prompt": p, "max_new_tokens": tokens, "chat": True})
    ids = chat_prompt_ids(tok, p)
    with lock:
        f.write(json.dumps({"prompt": p, "prompt_ids": ids, "response_ids": r["output_ids"]}) + "\n"); f.flush()
    return r["new_tokens"]

with ThreadPoolExecutor(8) as ex:
    total = 0
    for i, k in enumerate(ex.map(one, prompts)):
        total += k
        if i % 20 == 0:
            print(i, total, flush=True)
print("done", len(prompts), total)
