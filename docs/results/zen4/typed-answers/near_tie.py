"""Where `dflash-auto` and constrained plain decoding (`ar`) parted on the llamacpp backend
in extraction-qwen/ (prompt 27, answer token 45): the gap between plain decoding's two best
logits there, read from one row as plain decoding has it (tests/test_draft_model.py's
`plain_margin`). Run from the repository root with Qwen2.5-Coder-1.5B installed:

    python docs/results/zen4/typed-answers/near_tie.py
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, ".")
from dflash.engine.engine import Engine, GenerationRequest  # noqa: E402
from dflash.loading import load_target  # noqa: E402
from dflash.model_files import QWEN_CODER_15B, resolve_target  # noqa: E402
from dflash.suites import load_suite_items  # noqa: E402
from tests.test_draft_model import first_difference, plain_margin  # noqa: E402

HERE = Path(__file__).parent
torch.set_num_threads(2)
files = resolve_target(QWEN_CODER_15B, quiet=True)
target = load_target(files.folder, "llamacpp", gguf=files.gguf)
rows = [json.loads(line) for line in open(HERE / "extraction-qwen" / "samples.jsonl")][1:]
runs = {(r["method"], r["index"]): r["output_ids"] for r in rows}
items = load_suite_items("extraction", None)
engine = Engine(target, None)
for i in range(len(items)):
    plain, auto = runs[("ar", i)], runs[("dflash-auto", i)]
    k = first_difference(plain, auto)
    if k is None:
        continue
    ids = engine.prompt_ids(GenerationRequest(prompt=items[i]["prompt"], chat=True))
    print(f"prompt {i}: parted at answer token {k} ({engine.decode(plain[k:k + 1])!r} against "
          f"{engine.decode(auto[k:k + 1])!r}); plain decoding's top-2 gap there: "
          f"{plain_margin(target, list(ids) + plain[:k]):.4f} logits")
