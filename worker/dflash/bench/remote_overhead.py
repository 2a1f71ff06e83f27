"""What the remote backend costs per call over calling the inference server directly.

    python -m dflash.bench.remote_overhead [--n 30] [--max-new-tokens 16] [--out bench-out]
                                           [--endpoint URL]

Against llama-server with the default target and drafter (started here, like
`python -m dflash.bench.llamacpp serve`, unless --endpoint names a running one), the same
greedy request with the same prompt ids three ways, in turn (interleaved medians):
directly (one streamed `/completion`, read to its end, as the remote engine sends it), the
remote engine in this process, and a worker in remote mode over its socket. Writes
remote_overhead.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import urllib.parse

from dflash.bench.llamacpp import default_server
from dflash.bench.timing import interleaved_medians_ms, write_json_report
from dflash.engine.engine import GenerationRequest
from dflash.model_files import ensure_default_target
from dflash.remote.engine import remote_engine
from dflash.serve.client import Client
from dflash.serve.server import Worker

PROMPT = "Write a haiku about databases"


def direct(url: str, body: dict) -> None:
    """One streamed completion, read to its end: the endpoint's own time for the call."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        while resp.readline():
            pass
    finally:
        conn.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--endpoint", help="a running llama-server (default: start one)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    server = None if args.endpoint else default_server(threads=args.threads)
    url = args.endpoint or server.url
    try:
        engine = remote_engine(url, ensure_default_target(quiet=True))
        req = {"prompt": PROMPT, "max_new_tokens": args.max_new_tokens}
        ids = engine.prompt_ids(GenerationRequest(prompt=PROMPT))
        opts = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None,
                "stop": [], "stop_ids": []}
        body = engine.dialect.body(ids, opts)  # exactly what the remote engine sends
        with tempfile.TemporaryDirectory() as tmp:
            worker = Worker(engine, None, socket_path=f"{tmp}/w.sock")
            worker.start()
            try:
                client = Client(f"{tmp}/w.sock").connect()
                rows = interleaved_medians_ms({
                    "direct_ms": lambda: direct(url, body),
                    "remote_engine_ms": lambda: engine.generate(GenerationRequest(**req)),
                    "worker_socket_ms": lambda: client.call("generate", req),
                }, args.n)
                client.close()
            finally:
                worker.shutdown()
        same = engine.generate(GenerationRequest(**req)).output_ids
    finally:
        if server is not None:
            server.close()
    report = {"n": args.n, "max_new_tokens": args.max_new_tokens, "endpoint": "given" if args.endpoint else
              "llama-server (default target Q4_1, shipped drafter)", "threads": args.threads, "new_tokens": len(same),
              **rows, "remote_engine_overhead_ms": rows["remote_engine_ms"] - rows["direct_ms"],
              "worker_socket_overhead_ms": rows["worker_socket_ms"] - rows["direct_ms"]}
    write_json_report(report, args.out, "remote_overhead.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
