"""The 1.5B's greedy answers to N offline training prompts (dflash.train.data.collect_prompts:
the bench's prompts excluded), through a running worker, 8 at a time; JSONL for
`python -m dflash.train.next_head --answers`. Usage: answers.py SOCKET N TOKENS OUT (the
script it ran, since made general: ../../zen3/qwen05-head/answers.py with the model named)."""
import runpy
import sys
from pathlib import Path

sys.argv[2:2] = ["qwen2.5-coder-1.5b-instruct"]
runpy.run_path(str(Path(__file__).parents[2] / "zen3" / "qwen05-head" / "answers.py"), run_name="__main__")
