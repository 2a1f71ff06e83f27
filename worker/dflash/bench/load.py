"""Throughput and latency under load, through the real worker socket (or through SQL).

    python -m dflash.bench.load --concurrency 1,2,4,8 --requests 16 --max-new-tokens 64 --out DIR
        [--socket PATH] [--via socket|sql --dsn DSN] [--suite chat] [--block-size N] [--threads N]
        [--against-plain]

Without --socket it starts its own worker (`dflash serve`, the default models, no embedder)
on a temporary socket and stops it at the end. For each concurrency C, C clients send the
same `--requests` prompts (prompt i of the suite is request i, greedy), each taking the
next one as soon as its last is answered. `tokens_per_s` is every request's new tokens over
the run's wall time; latencies are per request, send to answer. Outputs are compared with
the same prompt's output at concurrency 1 (run first when 1 is not asked for): a difference
is counted, and its first diverging position reported. `--via sql` sends each request as
`SELECT dflash_generate_stats(...)` from C PostgreSQL sessions (the database's
dflash.config socket_path must name the worker's socket; with a worker of its own the bench
sets it, and puts it back after).

`--against-plain` also sends every level's requests with block_size 1 (plain decoding) to
the same worker, right before or after the auto ones (alternating by round), so the two
share the machine's moment: each level's row then has `plain_tokens_per_s`, `vs_plain`
(the medians' ratio) and `plain_mismatches_vs_solo`. On a VM whose speed drifts 10-20 %
within minutes, two separate runs cannot tell a 3 % difference under load; this can.

`--against-llama-server` also starts llama-server on the target's GGUF (the default's Q4_1,
a named model's or `--target FILE.gguf`'s file, as given) with as many slots as the highest
level, its threads the worker's, and sends every level's requests to it beside the worker's
(the same token ids the worker's chat template made, greedy, no prompt cache): each row then
has `llama_server_tokens_per_s`, `vs_llama_server` and `llama_server_mismatches_vs_solo`
(against the worker's outputs: only a worker on the llamacpp backend shares its numerics).

Writes DIR/load.json ({"runs": [{"concurrency", "tokens_per_s", "p50_latency_s",
"p95_latency_s", "mismatches_vs_solo", ...}], ...}) and DIR/load.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dflash.processes import stop
from dflash.plots import pyplot
from dflash.serve.client import Client, WorkerError


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class SocketCaller:
    def __init__(self, socket_path: str):
        self.path = socket_path

    def __call__(self, params: dict) -> dict:
        with Client(self.path, connect_timeout=30) as c:
            return c.call("generate", params)


class SqlCaller:
    """One PostgreSQL session per client thread, calling dflash_generate_stats."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.local = threading.local()

    def __call__(self, params: dict) -> dict:
        import psycopg

        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = psycopg.connect(self.dsn, autocommit=True)
        args = [params["prompt"], params["max_new_tokens"], params.get("block_size")]
        row = conn.execute("SELECT dflash_generate_stats(%s, max_new_tokens => %s, temperature => 0, "
                           "block_size => %s)", args).fetchone()[0]
        return row


class LlamaServerCaller:
    """Requests by token ids to llama-server's /completion (dflash.bench.llamacpp.LlamaServer)."""

    def __init__(self, server):
        self.server = server

    def __call__(self, params: dict) -> dict:
        done = self.server.complete(params["prompt_ids"], params["max_new_tokens"])
        return {"new_tokens": len(done.tokens), "output_ids": done.tokens, "prompt_ids": params["prompt_ids"]}


def start_llama_server(args, tmp: str, slots: int):
    from dflash.bench.llamacpp import LlamaServer, ensure_built
    from dflash.model_files import resolve_target

    files = resolve_target(args.target, quiet=True, backend="llamacpp")  # llama-server reads the GGUF alone
    if files.gguf is None:
        raise SystemExit(f"dflash.bench.load: --against-llama-server needs a target with a GGUF; {files.folder} has none")
    ensure_built()
    threads = args.threads or os.cpu_count()
    return LlamaServer(Path(files.gguf), threads, parallel=slots, trace=False, log=Path(tmp) / "llama-server.log")


def run_level(caller, requests: list[dict], concurrency: int) -> dict:
    """Send every request from `concurrency` clients; per-request latency and output."""
    results: list[dict | None] = [None] * len(requests)
    latency = [0.0] * len(requests)
    errors: list[str] = []
    lock = threading.Lock()
    nxt = iter(range(len(requests)))

    def client():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            t = time.perf_counter()
            try:
                results[i] = caller(requests[i])
            except (WorkerError, Exception) as exc:  # counted, not hidden
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
            latency[i] = time.perf_counter() - t

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["new_tokens"] for r in results if r)
    return {"concurrency": concurrency, "requests": len(requests), "wall_s": wall, "new_tokens": tokens,
            "tokens_per_s": tokens / wall if wall else None, "p50_latency_s": percentile(latency, 0.5),
            "p95_latency_s": percentile(latency, 0.95), "mean_latency_s": statistics.fmean(latency),
            "errors": len(errors), "error_samples": errors[:3], "_results": results}


def combine(rounds: list[dict]) -> dict:
    """One level's row over its rounds: the median of each figure; every mismatch and error."""
    out = dict(rounds[len(rounds) // 2])
    for key in ("tokens_per_s", "p50_latency_s", "p95_latency_s", "mean_latency_s", "wall_s"):
        out[key] = statistics.median(r[key] for r in rounds)
    out["mismatches_vs_solo"] = sum(r["mismatches_vs_solo"] for r in rounds)
    out["differences"] = [d for r in rounds for d in r["differences"]]
    out["errors"] = sum(r["errors"] for r in rounds)
    out["rounds"] = [{k: r[k] for k in ("tokens_per_s", "p50_latency_s", "p95_latency_s", "wall_s")} for r in rounds]
    out["_results"] = [x for r in rounds for x in r["_results"]]
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(solo: list, other: list) -> list[dict]:
    diffs = []
    for i, (s, o) in enumerate(zip(solo, other)):
        if s is None or o is None:
            continue
        at = first_difference(s["output_ids"], o["output_ids"])
        if at is not None:
            diffs.append({"request": i, "first_difference": at, "prompt_ids": s["prompt_ids"],
                          "solo_ids": s["output_ids"], "batched_ids": o["output_ids"]})
    return diffs


def top2_gaps(diffs: list[dict], target: str | None) -> None:
    """For each difference, the reference target's top-2 logit gap at the first diverging
    position after the solo prefix (below 1e-4 it is rounding; anything else a bug)."""
    if not diffs:
        return
    import torch

    from dflash.engine.target.hf import HFTarget
    from dflash.model_files import resolve_target

    # --target as the worker took it: a folder, a GGUF file or a model name (None: the default)
    model = HFTarget.from_pretrained(resolve_target(target, quiet=True).folder)
    for d in diffs:
        ids = d["prompt_ids"] + d["solo_ids"][: d["first_difference"]]
        logits, _ = model.forward(torch.tensor(ids), model.new_cache(), (), last_only=True)
        top = torch.topk(logits[-1], 2).values
        d["top2_gap"] = float(top[0] - top[1])


def start_worker(tmp: str, args) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, "worker.sock")
    cmd = [sys.executable, "-m", "dflash.cli", "serve", "--socket", sock, "--no-embedder",
           "--max-active", str(args.max_active)]
    for flag in ("target", "drafter", "threads", "device", "dtype", "target_backend"):
        value = getattr(args, flag, None)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    if args.via == "sql":
        cmd += ["--socket-group", "postgres"]
    log = open(os.path.join(tmp, "worker.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 600
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"dflash.bench.load: the worker exited ({proc.returncode}); see {log.name}")
        try:
            with Client(sock, connect_timeout=1) as c:
                c.call("status", {})
            return proc, sock
        except WorkerError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("dflash.bench.load: the worker did not start within 10 minutes")


def plot(report: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    runs = report["runs"]
    c = [r["concurrency"] for r in runs]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ax[0].plot(c, [r["tokens_per_s"] for r in runs], marker="o")
    ax[0].set(xlabel="concurrent callers", ylabel="tokens/s (all requests)", xscale="log", title="throughput")
    ax[1].plot(c, [r["p50_latency_s"] for r in runs], marker="o", label="p50")
    ax[1].plot(c, [r["p95_latency_s"] for r in runs], marker="o", label="p95")
    ax[1].set(xlabel="concurrent callers", ylabel="seconds per request", xscale="log", title="latency")
    ax[1].legend()
    for a in ax:
        a.set_xticks(c, [str(x) for x in c])
    fig.suptitle(report.get("title", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=110)


def markdown(report: dict) -> str:
    plain = all("vs_plain" in r for r in report["runs"])
    llama = all("vs_llama_server" in r for r in report["runs"])
    rows = ["| callers | tokens/s | × 1 caller | p50 latency s | p95 latency s | mismatches vs solo | errors |"
            + (" plain tokens/s | × plain | plain mismatches |" if plain else "")
            + (" llama-server tokens/s | × llama-server |" if llama else ""),
            "|---|---|---|---|---|---|---|" + ("---|---|---|" if plain else "") + ("---|---|" if llama else "")]
    base = report["runs"][0]["tokens_per_s"] or 1.0
    for r in report["runs"]:
        rows.append(f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} | "
                    f"{r['p50_latency_s']:.2f} | {r['p95_latency_s']:.2f} | {r['mismatches_vs_solo']} | {r['errors']} |"
                    + (f" {r['plain_tokens_per_s']:.1f} | {r['vs_plain']:.3f} | {r['plain_mismatches_vs_solo']} |"
                       if plain else "")
                    + (f" {r['llama_server_tokens_per_s']:.1f} | {r['vs_llama_server']:.2f} |" if llama else ""))
    return "\n".join(rows) + "\n"


def beside(run: dict, twin: dict, name: str) -> dict:
    """A level's combined row with a twin's run of the same requests beside it, as
    `{name}_tokens_per_s`, `vs_{name}`, `{name}_mismatches_vs_solo`, `{name}_rounds` and
    `{name}_errors` (plain: block_size 1 in the same worker; llama_server)."""
    run = dict(run)
    run[f"{name}_tokens_per_s"] = twin["tokens_per_s"]
    run[f"vs_{name}"] = run["tokens_per_s"] / twin["tokens_per_s"] if twin["tokens_per_s"] else None
    run[f"{name}_mismatches_vs_solo"] = twin["mismatches_vs_solo"]
    run[f"{name}_rounds"] = twin["rounds"]
    run[f"{name}_errors"] = twin["errors"]
    return run


def main(argv=None) -> int:
    from dflash.suites import load_suite
    from dflash.engine.costs import cpu_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--suite", default="chat")
    ap.add_argument("--block-size", type=int, help="fixed block size (default: auto)")
    ap.add_argument("--socket", help="a running worker's socket (default: start one)")
    ap.add_argument("--via", choices=["socket", "sql"], default="socket")
    ap.add_argument("--dsn", help="libpq DSN of a database with the extension (--via sql)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each level runs, alternating the order of levels; the table gives medians")
    ap.add_argument("--max-active", type=int, default=64, help="the started worker's batch (default 64)")
    ap.add_argument("--threads", type=int, help="the started worker's torch threads")
    ap.add_argument("--device", help="the started worker's device (default cpu)")
    ap.add_argument("--dtype", help="the started worker's dtype (default float32)")
    ap.add_argument("--target-backend", help="the started worker's target backend (default auto)")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--against-plain", action="store_true",
                    help="also run every level with block_size 1 in the same worker, interleaved (module doc)")
    ap.add_argument("--against-llama-server", action="store_true",
                    help="also send every level's requests to llama-server on the target's GGUF, with as many slots "
                         "as the highest level (module doc)")
    ap.add_argument("--out", default="bench-out/load")
    args = ap.parse_args(argv)
    if args.via == "sql" and not args.dsn:
        ap.error("--via sql needs --dsn")
    if args.against_plain and args.block_size:
        ap.error("--against-plain compares block length auto with plain decoding: leave out --block-size")
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels):
        ap.error("--concurrency takes positive integers")
    prompts = load_suite(args.suite, None)
    requests = [{"prompt": prompts[i % len(prompts)], "max_new_tokens": args.max_new_tokens, "chat": True,
                 "temperature": 0, **({"block_size": args.block_size} if args.block_size else {})}
                for i in range(args.requests)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dflash-load-") as tmp:
        os.chmod(tmp, 0o755)
        proc, sock = (None, args.socket) if args.socket else start_worker(tmp, args)
        restore = peer = None
        try:
            status = Client(sock).connect().call("status", {})
            if args.via == "sql":
                restore = _point_database_at(args.dsn, sock) if proc is not None else None
                caller = SqlCaller(args.dsn)
            else:
                caller = SocketCaller(sock)
            caller(dict(requests[0], max_new_tokens=4))  # warm up
            solo = None
            modes = {"auto": requests}
            callers = {"auto": caller, "plain": caller}
            if args.against_plain:
                modes["plain"] = [dict(q, block_size=1) for q in requests]
            if args.against_llama_server:
                peer = start_llama_server(args, tmp, max(levels))
                callers["llama-server"] = LlamaServerCaller(peer)
                modes["llama-server"] = []  # the worker's token ids, once its solo run made them
            rounds: dict[str, dict[int, list[dict]]] = {m: {c: [] for c in levels} for m in modes}
            for r in range(args.rounds):
                # Every round runs every level, in turn forward and back, so a machine whose
                # speed drifts during the run slows all levels alike; plain decoding's twin of
                # a level runs right beside it, first in every other round.
                order = ([1] if solo is None and 1 not in levels else []) + (levels if r % 2 == 0 else levels[::-1])
                for c in order:
                    for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                        if mode != "auto" and (solo is None or c not in levels):
                            continue  # the reference run: auto alone, first
                        run = run_level(callers[mode], modes[mode], c)
                        if c == 1 and solo is None:
                            solo = run["_results"]
                            if peer is not None:
                                if any(x is None for x in solo):
                                    raise SystemExit("dflash.bench.load: a solo request failed; llama-server gets "
                                                     "the token ids the worker's solo run made")
                                modes["llama-server"] = [{"prompt_ids": s["prompt_ids"], "max_new_tokens": q["max_new_tokens"]}
                                                         for s, q in zip(solo, requests)]
                        diffs = compare(solo, run["_results"])
                        run["mismatches_vs_solo"] = len(diffs)
                        run["differences"] = diffs
                        if c in levels:
                            rounds[mode][c].append(run)
                        print(f"round {r + 1}, concurrency {c}{'' if mode == 'auto' else ', ' + mode}: "
                              f"{run['tokens_per_s']:.1f} tok/s, p50 {run['p50_latency_s']:.2f} s, "
                              f"p95 {run['p95_latency_s']:.2f} s, {len(diffs)} mismatches, {run['errors']} errors",
                              file=sys.stderr, flush=True)
            runs = [combine(rounds["auto"][c]) for c in levels]
            if args.against_plain:
                runs = [beside(run, combine(rounds["plain"][c]), "plain") for run, c in zip(runs, levels)]
            if peer is not None:
                runs = [beside(run, combine(rounds["llama-server"][c]), "llama_server") for run, c in zip(runs, levels)]
        finally:
            if peer is not None:
                peer.close()
            if restore is not None:
                restore()
            if proc is not None and stop(proc, grace_s=60):  # seen on CUDA: the run's numbers must not go with it
                print("the worker did not stop within 60 s of SIGTERM: killed", file=sys.stderr)
    top2_gaps([d for r in runs for d in r["differences"]], args.target)
    for r in runs:
        r.pop("_results")
        for d in r["differences"]:
            for k in ("prompt_ids", "solo_ids", "batched_ids"):
                d.pop(k)
    report = {
        "runs": runs,
        "via": args.via,
        "suite": args.suite,
        "max_new_tokens": args.max_new_tokens,
        "block_size": args.block_size or "auto",
        "against_plain": args.against_plain,
        "against_llama_server": args.against_llama_server,
        "cpu": cpu_name(),
        "device": status.get("device"),
        "threads": status.get("threads"),
        "target_backend": status.get("target_backend"),
        "max_active": status.get("max_active"),
        "command": "python -m dflash.bench.load " + " ".join(argv if argv is not None else sys.argv[1:]),
        "title": f"{status.get('target')} on {cpu_name()}, {status.get('threads')} threads, via {args.via}",
    }
    (out / "load.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out)
    print(markdown(report))
    print(f"written: {out / 'load.json'}, {out / 'load.png'}", file=sys.stderr)
    return 0


def _point_database_at(dsn: str, sock: str):
    """Point the database's socket_path at our worker; returns how to put it back."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        old = conn.execute("SELECT value FROM dflash.config WHERE key = 'socket_path'").fetchone()[0]
        conn.execute("SELECT dflash.set_config('socket_path', %s)", (sock,))

    def restore():
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT dflash.set_config('socket_path', %s)", (old,))

    return restore


if __name__ == "__main__":
    raise SystemExit(main())
