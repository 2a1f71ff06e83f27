"""`dflash bench`'s options beside the model options, in one place: the CLI builds its
subcommand from them, and dflash.bench.replay reads a run's command back with them.
Torch-free, so building the CLI's parser loads no model code."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suites", default="code,chat,agent",
                   help="built-in suites (code, chat, agent, repetitive, extraction), comma-separated; none: only "
                        "--prompts")
    p.add_argument("--prompts", action="append", default=[], metavar="FILE.jsonl",
                   help='one more suite, named after the file: {"prompt": ...} per line (with a "json_schema", '
                        '"regex" or "choices" beside it: that prompt is constrained, its row counts `valid` outputs), '
                        "run whole, in file order, as one workload (repeatable; --limit does not apply)")
    p.add_argument("--methods", default="ar-hf,ar,dflash-4,dflash-8,dflash-16,dflash-auto,suffix,prompt-lookup,"
                   "assisted-ar",
                   help="ar, dflash-N, dflash-auto (every proposer), suffix (the suffix proposer alone), "
                        "draft-model (the --draft-model alone), draft-model-N (it alone at block size N every "
                        "step), ar-hf, "
                        "prompt-lookup, assisted-ar, llamacpp-* (llamacpp-ar-gguf, llamacpp-spec-gguf: llama.cpp's "
                        "plain and own speculative decoding of the target's GGUF as given)")
    p.add_argument("--assistant", help="AR draft model for assisted-ar: a transformers folder or a stored "
                   "assistant (default: the shipped one, for the default target)")
    p.add_argument("--limit", type=int, help="prompts per suite (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--resume", action="store_true",
                   help="reuse the generations journaled in OUT/samples.jsonl by an interrupted run with the same settings")
