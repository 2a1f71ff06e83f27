"""The SQL path, measured: `SELECT dflash_generate(...)` against a direct client call, and
the trigger queue's throughput.

    python -m dflash.bench.sql_bench [--n 50] [--rows 50] [--tokens 32] [--block-size N] [--out bench-out]
        [--workload SUITE|FILE.jsonl [--workload-tokens 128] [--workload-rows N] [--workload-schema FILE.json]]

`--workload` also fills a generation-enabled table with a suite's prompts (one row each, in
order, e.g. the `repetitive` suite's 42) twice, into two fresh tables: once with
`proposals => false` and once with the default `proposals => true`, where the suffix
proposer drafts from the table's earlier answers; the two fill times are the workload
memory's gain through SQL. `--workload-schema` makes it a typed fill: the answer column is
`jsonb`, every row generated under that JSON Schema (the table's `json_schema` option),
each prompt asked to describe the suite's prompt as such JSON (`SCHEMA_PROMPT`); the report
counts the answers that validate.

Everything runs in one process on a throwaway cluster (dflash.localpg): the worker (its
own threads, the embedded default models), its queue consumer, and the SQL client.
Writes sql_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import psycopg
import torch

from dflash.bench.timing import interleaved_medians_ms, write_json_report
from dflash.embed import Embedder
from dflash.engine.costs import cpu_name
from dflash.engine.engine import dtype_name
from dflash.engine.knobs import DEFAULT_MAX_BATCH
from dflash.loading import add_model_args, engine_from_args
from dflash.localpg import start_local_cluster
from dflash.serve.client import Client
from dflash.serve.queue import QueueConsumer
from dflash.serve.server import Worker


def measure_queue(conn, worker, server, args) -> dict:
    """Insert args.rows rows into a generate-on-insert table; time until the worker filled all."""
    conn.execute("ALTER ROLE dflash_worker LOGIN")
    conn.execute("CREATE TABLE bench_rows (id serial PRIMARY KEY, prompt text, answer text)")
    opts = {"max_new_tokens": args.tokens}
    if args.block_size:
        opts["block_size"] = args.block_size
    conn.execute("SELECT dflash.enable_generation('bench_rows', 'prompt', 'answer', %s)", (json.dumps(opts),))
    with conn.transaction():
        for i in range(args.rows):
            conn.execute("INSERT INTO bench_rows (prompt) VALUES (%s)",
                         (f"Write one sentence about the number {i}.",))
    # Claiming as `dflash serve --database` does by default: up to the batch's size at once.
    consumer = QueueConsumer(worker, server.dsn(user="dflash_worker"), poll_s=0.2, batch=DEFAULT_MAX_BATCH)
    t = time.perf_counter()
    consumer.start()
    while conn.execute("SELECT count(*) FROM bench_rows WHERE answer IS NULL").fetchone()[0]:
        time.sleep(0.2)
    elapsed = time.perf_counter() - t
    consumer.shutdown()
    tokens = conn.execute(
        "SELECT sum(new_tokens) FROM dflash.generations WHERE source_table = 'bench_rows'::regclass"
    ).fetchone()[0]
    return dict(queue_rows=args.rows, queue_tokens_per_row=args.tokens, queue_block_size=args.block_size,
                queue_seconds=elapsed, queue_rows_per_minute=args.rows / elapsed * 60, queue_new_tokens=tokens)


SCHEMA_PROMPT = "Describe this request as JSON with the fields of the schema.\n\nRequest: {prompt}"


def measure_workload(conn, worker, server, prompts: list[str], tokens: int, schema: dict | None = None) -> dict:
    """Fill two generation-enabled tables with the same prompts, proposals off then on (with
    `schema`: a jsonb answer column under that JSON Schema)."""
    out = {}
    if schema is not None:
        prompts = [SCHEMA_PROMPT.format(prompt=p) for p in prompts]
    for proposals in (False, True):
        table = f"bench_workload_{'on' if proposals else 'off'}"
        conn.execute(f"CREATE TABLE {table} (id serial PRIMARY KEY, prompt text, "
                     f"answer {'text' if schema is None else 'jsonb'})")
        opts = {"max_new_tokens": tokens, "proposals": proposals, **({"json_schema": schema} if schema else {})}
        conn.execute("SELECT dflash.enable_generation(%s, 'prompt', 'answer', %s)", (table, json.dumps(opts)))
        with conn.transaction():
            for prompt in prompts:
                conn.execute(f"INSERT INTO {table} (prompt) VALUES (%s)", (prompt,))
        consumer = QueueConsumer(worker, server.dsn(user="dflash_worker"), poll_s=0.2, batch=DEFAULT_MAX_BATCH)
        t = time.perf_counter()
        consumer.start()
        # until every row is filled or given up (a typed answer cut short fails, into queue_failed)
        while conn.execute("SELECT count(*) FROM dflash.queue WHERE tbl = %s::regclass", (table,)).fetchone()[0]:
            time.sleep(0.2)
        elapsed = time.perf_counter() - t
        consumer.shutdown()
        stats = conn.execute(
            "SELECT sum(new_tokens), sum(steps) FROM dflash.generations WHERE source_table = %s::regclass",
            (table,)).fetchone()
        key = "on" if proposals else "off"
        out[f"workload_proposals_{key}_seconds"] = elapsed
        out[f"workload_proposals_{key}_new_tokens"] = stats[0]
        out[f"workload_proposals_{key}_steps"] = stats[1]
    # Greedy either way: the same answer in both tables, row by row (proposals change speed only).
    differ = conn.execute(
        "SELECT id, a.answer, b.answer FROM bench_workload_off a JOIN bench_workload_on b USING (id) "
        "WHERE a.answer <> b.answer ORDER BY id").fetchall()
    out["workload_answers_differ"] = len(differ)
    out["workload_differing"] = [{"id": i, "off": a, "on": b} for i, a, b in differ]
    out["workload_rows"] = len(prompts)
    out["workload_failed"] = conn.execute("SELECT count(*) FROM dflash.queue_failed WHERE tbl::text LIKE "
                                          "'bench_workload_%'").fetchone()[0]
    if schema is not None:
        import jsonschema

        answers = [a for (a,) in conn.execute("SELECT answer FROM bench_workload_off UNION ALL "
                                               "SELECT answer FROM bench_workload_on").fetchall()]
        out["workload_schema"] = schema
        out["workload_valid"] = sum(jsonschema.Draft202012Validator(schema).is_valid(a) for a in answers)
        out["workload_answers"] = len(answers)
    out["workload_tokens_per_row"] = tokens
    out["workload_speedup"] = out["workload_proposals_off_seconds"] / out["workload_proposals_on_seconds"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50, help="repetitions for the latency medians")
    ap.add_argument("--rows", type=int, default=50, help="rows inserted for the queue throughput")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per queued row")
    ap.add_argument("--block-size", type=int, help="block size for the queued rows (default: the drafter's)")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--workload", help="a suite (code, chat, agent, repetitive) or a FILE.jsonl of {\"prompt\": ...} "
                    "filled into two tables, proposals off and on")
    ap.add_argument("--workload-tokens", type=int, default=128, help="new tokens per workload row")
    ap.add_argument("--workload-rows", type=int, help="the first N of the workload's prompts (default: all)")
    ap.add_argument("--workload-schema", help="a JSON Schema file: the workload's answers are jsonb under it")
    add_model_args(ap)  # the engine is built as `dflash serve` builds it, from the same options
    args = ap.parse_args(argv)

    # A serving engine, as `dflash serve` builds one for its default --max-active: the queue's
    # rows are generated together, so the target backend is chosen for several callers.
    engine = engine_from_args(args, serving=True)
    is_random = engine.random_drafter
    server = start_local_cluster()
    sock = server.socket_dir / "worker.sock"
    worker = Worker(engine, Embedder(), socket_path=str(sock),
                    socket_group=server.os_user if os.geteuid() == 0 else None)
    worker.start()
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "target": engine.target.name,
              "target_backend": engine.target.backend, "draft_dtype": dtype_name(engine.draft_dtype), "cpu": cpu_name(),
              "drafter": engine.drafter_name, "random_drafter": is_random}
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION dflash CASCADE")
            conn.execute("SELECT dflash.set_config('socket_path', %s)", (str(sock),))
            conn.execute("SELECT dflash.set_config('remember', 'off')")  # measure the call, not the memory
            client = Client(str(sock)).connect()
            params = {"prompt": "Hi", "max_new_tokens": 1, "chat": True}
            query = "SELECT dflash_generate('Hi', max_new_tokens => 1)"
            calls = {"client": lambda: client.call("generate", params), "sql": lambda: conn.execute(query).fetchone()}
            # Alternating calls, so drift on a shared machine hits both paths alike.
            med = interleaved_medians_ms(calls, args.n)
            report.update(generate1_client_ms=med["client"], generate1_sql_ms=med["sql"],
                          generate1_sql_overhead_ms=med["sql"] - med["client"])
            conn.execute("SELECT dflash.set_config('remember', 'on')")
            # With the memory row too (one more embed round trip and an HNSW insert).
            med = interleaved_medians_ms(calls, args.n)
            report.update(generate1_client_ms_2=med["client"], generate1_sql_remember_ms=med["sql"],
                          generate1_sql_remember_overhead_ms=med["sql"] - med["client"])
            client.close()
            if args.rows:
                report.update(measure_queue(conn, worker, server, args))
            if args.workload:
                from pathlib import Path

                from dflash.suites import load_prompts_file, load_suite

                prompts = (load_prompts_file(Path(args.workload)) if args.workload.endswith(".jsonl")
                           else load_suite(args.workload))
                schema = json.loads(Path(args.workload_schema).read_text()) if args.workload_schema else None
                conn.execute("ALTER ROLE dflash_worker LOGIN")
                report.update(measure_workload(conn, worker, server, prompts[: args.workload_rows],
                                               args.workload_tokens, schema))
    finally:
        worker.shutdown()
        server.stop()
    write_json_report(report, args.out, "sql_bench.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
