"""What the remote backend costs per call over calling the inference server directly.

    python -m tools.remote_overhead [--n 30] [--max-new-tokens 16] [--out bench-out]
                                           [--endpoint URL] [--no-sql]

Against llama-server with the default target and drafter (started here, like
`python -m dflash.bench.llamacpp serve`, unless --endpoint names a running one), the same
greedy request with the same prompt ids four ways, in turn, n rounds:
directly (one streamed `/completion`, read to its end, as the remote engine sends it), the
remote engine in this process, a worker in remote mode over its socket, and
`SELECT dflash_generate(...)` on a throwaway local PostgreSQL cluster (dflash.localpg, as
`dflash.bench.sql_bench` uses; `remember` off: the call, not the memory; --no-sql skips
it). Every path checks that it got the direct answer's token ids. Reports each path's
median (and 10th/90th percentiles), the difference of each median to the direct one, and
the median of the per-round differences (`*_overhead_paired_ms`: the steadier estimate on a
shared machine). Writes remote_overhead.json.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import statistics
import tempfile
import time
import urllib.parse

from dflash.bench.llamacpp import default_server
from dflash.bench.timing import write_json_report
from dflash.engine.engine import GenerationRequest
from dflash.model_files import ensure_default_target
from dflash.remote.engine import remote_engine
from dflash.serve.client import Client
from dflash.serve.server import Worker

PROMPT = "Write a haiku about databases"


def direct(url: str, body: dict) -> list[int]:
    """One streamed completion, read to its end: the endpoint's own time for the call.
    Returns the token ids it streamed (parsed after the end, outside the hot loop's reads)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    lines = []
    try:
        conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        while line := resp.readline():
            lines.append(line)
    finally:
        conn.close()
    ids: list[int] = []
    for line in lines:
        if line.startswith(b"data: "):
            ids += json.loads(line[6:]).get("tokens", [])
    return ids


def paired_ms(paths: dict, n: int) -> dict:
    """n rounds, each calling every path once in turn (the first is the reference): each path's
    median, 10th and 90th percentile (ms), and the median of its per-round difference to the
    reference, which drift on a shared machine (it moves whole rounds) disturbs far less than
    a difference of medians."""
    names = list(paths)
    times = {k: [] for k in names}
    for _ in range(n):
        for k in names:
            t = time.perf_counter()
            paths[k]()
            times[k].append((time.perf_counter() - t) * 1000)
    out = {}
    ref = names[0]
    for k in names:
        v = sorted(times[k])
        out[k] = statistics.median(v)
        out[k.replace("_ms", "_p10_ms")] = v[max(0, round(0.1 * (n - 1)))]
        out[k.replace("_ms", "_p90_ms")] = v[round(0.9 * (n - 1))]
        if k != ref:
            out[k.replace("_ms", "_overhead_paired_ms")] = statistics.median(
                a - b for a, b in zip(times[k], times[ref]))
    out["raw_ms"] = {k: [round(x, 2) for x in v] for k, v in times.items()}
    return out


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def sql_caller(socket_dir: str):
    """A throwaway local cluster with the extension, pointed at a worker socket in its own
    socket folder; yields (the server, a connection)."""
    import psycopg

    from dflash.localpg import start_local_cluster

    server = start_local_cluster()
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION dflash CASCADE")
            conn.execute("SELECT dflash.set_config('remember', 'off')")  # the worker here has no embedder
            yield server, conn
    finally:
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.remote_overhead",
                                 description="per-call cost of the remote backend over calling llama-server directly")
    ap.add_argument("--n", type=int, default=30, help="calls per path (interleaved; medians)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads when started here")
    ap.add_argument("--endpoint", help="a running llama-server (default: start one)")
    ap.add_argument("--no-sql", action="store_true", help="skip the SQL path (no local PostgreSQL cluster)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    server = None if args.endpoint else default_server(threads=args.threads)
    url = args.endpoint or server.url
    try:
        engine = remote_engine(url, ensure_default_target(quiet=True))
        req = {"prompt": PROMPT, "max_new_tokens": args.max_new_tokens, "temperature": 0.0}
        ids = engine.prompt_ids(GenerationRequest(prompt=PROMPT))
        opts = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None,
                "stop": [], "stop_ids": []}
        body = engine.dialect.body(ids, opts)  # exactly what the remote engine sends
        want = direct(url, body)
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            pg = conn = None
            if not args.no_sql:
                pg, conn = stack.enter_context(sql_caller(tmp))
            sock = (pg.socket_dir / "remote.sock") if pg else f"{tmp}/w.sock"
            group = pg.socket_group if pg else None
            worker = Worker(engine, None, socket_path=str(sock), socket_group=group)
            worker.start()
            stack.callback(worker.shutdown)
            client = Client(str(sock)).connect()
            stack.callback(client.close)
            query = f"SELECT dflash_generate('{PROMPT}', max_new_tokens => {args.max_new_tokens}, temperature => 0)"
            if conn is not None:
                conn.execute("SELECT dflash.set_config('socket_path', %s)", (pg.server_path(sock),))
            # Each path once outside the timings: the same answer everywhere, or the numbers mean nothing.
            got = {"remote_engine": engine.generate(GenerationRequest(**req)).output_ids,
                   "worker_socket": client.call("generate", req)["output_ids"]}
            if conn is not None:
                conn.execute(query)
                got["sql"] = conn.execute("SELECT output_ids FROM dflash.generations ORDER BY id DESC LIMIT 1"
                                          ).fetchone()[0]
            bad = {k: v for k, v in got.items() if list(v) != want}
            if bad:
                raise SystemExit(f"remote_overhead: answers differ from the direct one {want}: {bad}")
            paths = {"direct_ms": lambda: direct(url, body),
                     "remote_engine_ms": lambda: engine.generate(GenerationRequest(**req)),
                     "worker_socket_ms": lambda: client.call("generate", req)}
            if conn is not None:
                paths["sql_ms"] = lambda: conn.execute(query).fetchone()
            load_before = os.getloadavg()
            rows = paired_ms(paths, args.n)
            load_after = os.getloadavg()
    finally:
        if server is not None:
            server.close()
    report = {"n": args.n, "max_new_tokens": args.max_new_tokens, "endpoint": "given" if args.endpoint else
              "llama-server (default target Q4_1, shipped drafter)", "threads": args.threads, "new_tokens": len(want),
              "cpu": cpu_model(), "cpus": os.cpu_count(),
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in load_after], **rows}
    for k in ("remote_engine", "worker_socket", "sql"):  # differences of the medians, beside the paired ones
        if f"{k}_ms" in rows:
            report[f"{k}_overhead_ms"] = rows[f"{k}_ms"] - rows["direct_ms"]
    report["raw_ms"] = report.pop("raw_ms")  # last: the long lists
    write_json_report(report, args.out, "remote_overhead.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
