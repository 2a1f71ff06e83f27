"""The shipped training corpus: the default target's own greedy answers to every offline prompt.

Regenerating answers is the slowest stage of drafter training on a CPU (hours) and a
good share of a GPU lease, so it is done once and shipped with the repository as a
compressed JSONL (`corpus/*.jsonl.xz`, data, not weights) with a machine-readable
manifest (settings, counts, sha256) and a card generated from it. Every training run,
CPU or GPU, starts from it; `load_corpus` refuses a file whose checksum does not match.

    python -m dflash.train.corpus generate --out RUN/answers.jsonl [--batch 64 --max-new-tokens 224]
    python -m dflash.train.corpus pack RUN/answers.jsonl     # -> corpus/ (xz, manifest, card)

`generate` appends to its JSONL and resumes where it stopped; it answers the prompts in
the shuffled order of `collect_prompts`, so any prefix of its output (the file while it
runs, or a pack of it) is a random sample of all prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import time
from collections import Counter
from pathlib import Path

from dflash.errors import DFlashError

CORPUS_DIR = Path(__file__).parent / "corpus"
CORPUS_NAME = "smollm2-135m-instruct-greedy"
CORPUS_FILE = CORPUS_DIR / f"{CORPUS_NAME}.jsonl.xz"
MANIFEST_FILE = CORPUS_DIR / f"{CORPUS_NAME}.json"
CARD_FILE = CORPUS_DIR / "README.md"
FIELDS = ("prompt", "prompt_ids", "response_ids")
# The longest answer the corpus holds, and the default length of answers regenerated for training.
ANSWER_TOKENS = 224


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_corpus(path: Path = CORPUS_FILE, manifest: Path | None = None, verify: bool = True) -> list[dict]:
    """The records of a packed corpus, after checking its sha256 against its manifest."""
    path = Path(path)
    manifest = Path(manifest) if manifest else path.with_name(path.name.removesuffix(".jsonl.xz") + ".json")
    if not path.is_file():
        raise DFlashError("bad_corpus", f"training corpus not found: {path}")
    if verify:
        if not manifest.is_file():
            raise DFlashError("bad_corpus", f"training corpus {path} has no manifest {manifest}")
        want = json.loads(manifest.read_text())["sha256"]
        got = sha256_of(path)
        if got != want:
            raise DFlashError("bad_corpus", f"training corpus {path} has sha256 {got}, its manifest says {want}")
    with lzma.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def source_of(prompts: list[str], seed: int = 0) -> dict[str, str]:
    """Which offline source each prompt came from (for the card's counts)."""
    from dflash.train.sources import prompts_by_source

    where = {}
    for name, items in prompts_by_source(seed).items():
        for p in items:
            where.setdefault(p, name)
    return {p: where.get(p, "other") for p in prompts}


def adapt_threads(cores: int | None = None) -> None:
    """Use every core while the machine is otherwise idle, one while it is busy: on a shared
    machine a niced job whose threads wait for each other at every op wastes its share."""
    import os

    import torch

    cores = cores or os.cpu_count() or 1
    torch.set_num_threads(cores if os.getloadavg()[0] < cores + 0.5 else 1)


def generate(out: Path, *, batch_size: int, max_new_tokens: int, window: int, limit: int | None,
             threads: int | None) -> int:
    """Answer the prompts (resumable). `threads` None adapts the thread count to the load."""
    import torch

    from dflash.engine.target.hf import HFTarget
    from dflash.model_files import ensure_default_target
    from dflash.train.data import collect_prompts, regenerate

    if threads:
        torch.set_num_threads(threads)
    target = HFTarget.from_pretrained(ensure_default_target())
    prompts = collect_prompts(limit)
    settings = {"target": target.name, "dtype": str(target.dtype).removeprefix("torch."), "decoding": "greedy",
                "chat_template": True, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                "window": window, "prompt_seed": 0, "device": str(target.device), "torch": torch.__version__}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    settings_file = Path(str(out) + ".settings.json")
    if settings_file.is_file():
        old = json.loads(settings_file.read_text())
        if old["max_new_tokens"] != max_new_tokens:
            raise DFlashError("bad_corpus", f"{out} was generated with max_new_tokens {old['max_new_tokens']}")
    settings_file.write_text(json.dumps(settings, indent=2) + "\n")
    t0 = time.monotonic()
    n = regenerate(target, prompts, Path(out), max_new_tokens=max_new_tokens, batch_size=batch_size, window=window,
                   before_batch=None if threads else adapt_threads)
    print(f"answered {n} prompts in {time.monotonic() - t0:.0f} s", flush=True)
    return n


def pack(jsonl: Path, dest_dir: Path = CORPUS_DIR, name: str = CORPUS_NAME, extra: dict | None = None) -> dict:
    """Compress the complete records of `jsonl` (in their generation order; a prompt answered
    twice, as by two writers on one file, keeps its first answer) into
    `dest_dir/name.jsonl.xz`, write its manifest and regenerate the card."""
    from dflash.train.data import excluded_prompts, load_records

    records, seen = [], set()
    for r in load_records(Path(jsonl)):
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            records.append(r)
    excluded = excluded_prompts()
    leaked = [r["prompt"] for r in records if r["prompt"].strip() in excluded]
    if leaked:
        raise DFlashError("bad_corpus", f"{len(leaked)} benchmark prompts in {jsonl}, e.g. {leaked[0][:60]!r}")
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    data = dest_dir / f"{name}.jsonl.xz"
    tmp = data.with_suffix(".tmp")
    with lzma.open(tmp, "wt", preset=9 | lzma.PRESET_EXTREME) as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in FIELDS}, separators=(",", ":")) + "\n")
    tmp.replace(data)
    settings_file = Path(str(jsonl) + ".settings.json")
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    from dflash.train.data import collect_prompts

    sources = source_of([r["prompt"] for r in records])
    resp = [len(r["response_ids"]) for r in records]
    eos_cut = sum(1 for r in records if len(r["response_ids"]) >= settings.get("max_new_tokens", 1 << 30))
    manifest = {
        "file": data.name, "sha256": sha256_of(data), "bytes": data.stat().st_size,
        "records": len(records), "prompts_available": len(collect_prompts()),
        "prompt_tokens": sum(len(r["prompt_ids"]) for r in records), "response_tokens": sum(resp),
        "mean_response_tokens": round(sum(resp) / max(1, len(resp)), 1), "hit_max_new_tokens": eos_cut,
        "by_source": dict(Counter(sources[r["prompt"]] for r in records).most_common()),
        "benchmark_prompts_excluded": len(excluded), "settings": settings, **(extra or {}),
    }
    (dest_dir / f"{name}.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (dest_dir / "README.md").write_text(card(manifest))
    return manifest


def card(m: dict) -> str:
    s = m.get("settings", {})
    sources = ", ".join(f"{k} {v:,}" for k, v in m["by_source"].items())
    return f"""# Training corpus: {m['file']}

The default target's own greedy answers to the offline prompts of `dflash.train.sources`:
what the DFlash drafter is trained on (the drafter learns to predict the target, so the
answers are the target's, never a dataset's). Generated by
`python -m dflash.train.corpus generate`, packed by `python -m dflash.train.corpus pack`;
`dflash.train.corpus.load_corpus()` checks the checksum below before use.

| | |
|---|---|
| file | `{m['file']}` ({m['bytes'] / 1e6:.1f} MB, xz), one JSON object per line: `prompt`, `prompt_ids` (chat template applied), `response_ids` (ending in eos unless cut at the token limit) |
| sha256 | `{m['sha256']}` |
| target | {s.get('target', '?')} ({s.get('dtype', '?')}, on {s.get('device', '?')}, torch {s.get('torch', '?')}) |
| decoding | {s.get('decoding', 'greedy')}, the target's chat template with its default system prompt, at most {s.get('max_new_tokens', '?')} new tokens, stopped at eos; batched ({s.get('batch_size', '?')} rows, left-padded) |
| prompts | {m['records']:,} answered of {m['prompts_available']:,} (`collect_prompts()`, shuffled with seed 0; answered in that order, so these are a random sample when not all) |
| by source | {sources} |
| tokens | {m['prompt_tokens']:,} prompt, {m['response_tokens']:,} response (mean {m['mean_response_tokens']} per answer; {m['hit_max_new_tokens']:,} answers reached the token limit) |
| exclusions | every benchmark prompt ({m['benchmark_prompts_excluded']:,}: the bench suites and HumanEval) is excluded by exact text, and checked again when packing; the chat suite's topics are not among the topic prompts |
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="answer the prompts with the target (resumable)")
    g.add_argument("--out", required=True)
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--window", type=int, default=512, help="prompts sorted by length within windows of this many")
    g.add_argument("--max-new-tokens", type=int, default=ANSWER_TOKENS)
    g.add_argument("--limit", type=int)
    g.add_argument("--threads", type=int, help="fixed thread count (default: all cores when idle, else one)")
    k = sub.add_parser("pack", help="compress a generated JSONL into the shipped corpus")
    k.add_argument("jsonl")
    k.add_argument("--dest", default=str(CORPUS_DIR))
    args = p.parse_args(argv)
    if args.cmd == "generate":
        generate(Path(args.out), batch_size=args.batch, max_new_tokens=args.max_new_tokens, window=args.window,
                 limit=args.limit, threads=args.threads)
    else:
        m = pack(Path(args.jsonl), Path(args.dest))
        print(json.dumps({k: v for k, v in m.items() if k != "settings"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
