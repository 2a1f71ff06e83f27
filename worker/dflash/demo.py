"""`dflash demo`: the whole product end to end on a throwaway PostgreSQL cluster.

Starts a temporary cluster (initdb + pg_ctl; as user postgres when run as root), starts
the worker on the embedded default models (or on `target`), runs CREATE EXTENSION dflash CASCADE and
SELECT dflash_generate(...), shows the recorded statistics, then stops everything.
Needs the PostgreSQL pieces installed (`make setup` does that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from dflash.localpg import start_local_cluster
from dflash.processes import stop


def run_demo(prompt: str, max_new_tokens: int = 64, target: str | None = None) -> int:
    import psycopg

    server = start_local_cluster()
    sock = server.socket_dir / "worker.sock"
    worker = None
    try:
        cmd = [sys.executable, "-m", "dflash.cli", "serve", "--socket", str(sock)]
        cmd += ["--target", target] if target else []
        if os.geteuid() == 0:
            cmd += ["--socket-group", server.os_user]
        print(f"$ {' '.join(cmd[2:])}", flush=True)
        worker = subprocess.Popen(cmd)
        end = time.monotonic() + 1800  # a named model's first start probes its backends
        while not sock.exists():
            if worker.poll() is not None or time.monotonic() > end:
                print("dflash demo: the worker did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            def sql(query, *args):
                shown = query
                for a in args:
                    shown = shown.replace("%s", "'" + str(a).replace("'", "''") + "'", 1)
                print(f"\n=# {shown}", flush=True)
                cur = conn.execute(query, args)
                rows = cur.fetchall() if cur.description else []
                for row in rows:
                    print("   " + " | ".join(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in row))
                return rows

            sql("CREATE EXTENSION dflash CASCADE")
            sql("SELECT dflash.set_config('socket_path', %s)", str(sock))
            sql(f"SELECT dflash_generate(%s, max_new_tokens => {max_new_tokens})", prompt)
            sql("SELECT mode, block_size, new_tokens, steps, round(tau::numeric, 2) AS tau,"
                " round(tokens_per_s::numeric, 1) AS tokens_per_s, round(total_ms::numeric) AS total_ms,"
                " target, drafter FROM dflash.generations")
            sql("SELECT generation_id, round(distance::numeric, 3) AS distance, left(output, 60)"
                " FROM dflash_recall('databases', 1)")
        return 0
    finally:
        if worker is not None:
            stop(worker, grace_s=60)
        server.stop()
