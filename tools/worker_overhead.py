"""Round-trip overhead of the worker socket: the same request in-process and over the socket.

    python -m tools.worker_overhead [--n 100] [--out bench-out]

Runs the worker in this process (its own threads, a temp socket), so both paths use
the same loaded models; reports medians of n repetitions of an `embed` of one short
text and of a 1-token `generate`, and writes worker_overhead.json.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from dflash.bench.timing import median_ms, write_json_report
from dflash.embed import Embedder
from dflash.engine.engine import GenerationRequest
from dflash.loading import load_engine
from dflash.model_files import resolve_models
from dflash.serve.client import Client
from dflash.serve.server import Worker


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    target, drafter, is_random = resolve_models(None, None)
    engine = load_engine(target, drafter, random_drafter=is_random)
    embedder = Embedder()
    gen = {"prompt": "Hi", "max_new_tokens": 1}
    text = ["a short text"]
    with tempfile.TemporaryDirectory() as tmp:
        worker = Worker(engine, embedder, socket_path=f"{tmp}/w.sock")
        worker.start()
        try:
            client = Client(f"{tmp}/w.sock").connect()
            rows = {
                "embed_in_process_ms": median_ms(lambda: embedder.embed(text), args.n),
                "embed_socket_ms": median_ms(lambda: client.call("embed", {"texts": text}), args.n),
                "generate1_in_process_ms": median_ms(lambda: engine.generate(GenerationRequest(**gen)), args.n),
                "generate1_socket_ms": median_ms(lambda: client.call("generate", gen), args.n),
            }
            client.close()
        finally:
            worker.shutdown()
    rows["embed_overhead_ms"] = rows["embed_socket_ms"] - rows["embed_in_process_ms"]
    rows["generate1_overhead_ms"] = rows["generate1_socket_ms"] - rows["generate1_in_process_ms"]
    report = {"n": args.n, "threads": torch.get_num_threads(), "torch": torch.__version__, **rows}
    write_json_report(report, args.out, "worker_overhead.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
