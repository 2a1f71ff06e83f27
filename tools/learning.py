"""A drafter that learns from its own workload, measured: τ and tokens/s per round.

    python -m tools.learning --rounds 3 --prompts-per-round 40 --out DIR

Everything runs through the SQL path on a throwaway cluster (dflash.localpg), with the
worker in this process on the embedded default models, as `dflash demo` and
`dflash.bench.sql_bench` do:

- a member role (`learning_app`) consents to training on its direct calls
  (dflash.training_consent) and sends the workload: repeated-template agent requests
  (tools.workload), `SELECT dflash_generate_stats(prompt, block_size => B)`;
- round 0 runs with the shipped drafter; after each round `dflash train --from-database`
  (dflash.train.from_database, as the role `learning_trainer` in dflash_trainer) fine-tunes the
  current drafter on every row collected so far for a fixed number of optimiser steps, keeps
  the newest 10 % back and adopts the new drafter only if their τ rose; an admin
  (`learning_admin`) then hot-swaps it with `SELECT dflash.reload_drafter()`;
- every round's prompts are new (never trained on): its τ is held-out τ. Each answer is
  compared with the target's own greedy answer (transformers `generate`, computed first).

Writes DIR/learning.json ({"rounds": [{"round", "tau", "tokens_per_s", "greedy_mismatches",
...}], ...}) after every round, and DIR/learning.png (τ and tokens/s per round). τ does not
depend on the machine's load (the fine-tunes are bounded by steps, not time); tokens/s does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import psycopg
import torch

from dflash.chat import chat_prompt_ids
from dflash.engine.stats import pooled_tau
from dflash.loading import load_engine
from dflash.localpg import start_local_cluster
from dflash.model_files import resolve_models
from dflash.plots import pyplot
from dflash.serve.server import Worker
from dflash.train import from_database
from dflash.train.from_database import Filters, Settings
from tools.workload import rounds as workload_rounds

APP, TRAINER, ADMIN = "learning_app", "learning_trainer", "learning_admin"
README_START, README_END = "<!-- learning-results:start -->", "<!-- learning-results:end -->"


def _log(msg: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def setup_database(server, sock: Path) -> str:
    """The extension, the worker's socket, and the three roles; returns the database's DSN."""
    dsn = server.dsn()
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute("CREATE EXTENSION dflash CASCADE")
        su.execute("SELECT dflash.set_config('socket_path', %s)", (server.server_path(sock),))
        su.execute("SELECT dflash.set_config('remember', 'off')")  # the drafter is measured, not recall
        su.execute(f"CREATE ROLE {APP} LOGIN IN ROLE dflash_user")
        su.execute(f"CREATE ROLE {TRAINER} LOGIN IN ROLE dflash_trainer")
        su.execute(f"CREATE ROLE {ADMIN} LOGIN IN ROLE dflash_admin")
    with psycopg.connect(dsn + f" user={APP}", autocommit=True) as app:
        app.execute("INSERT INTO dflash.training_consent DEFAULT VALUES")  # my direct calls may train it
    return dsn


def reference_outputs(target, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """The target's own greedy answers (transformers generate, one prompt at a time)."""
    tok = target.tokenizer
    out = []
    for p in prompts:
        ids = chat_prompt_ids(tok, p)
        x = torch.tensor([ids], device=target.device)
        with torch.inference_mode():
            gen = target.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                        do_sample=False, eos_token_id=target.eos_ids,
                                        pad_token_id=target.eos_ids[0])
        out.append(gen[0, len(ids):].tolist())
    return out


def run_round(dsn: str, prompts: list[str], reference: list[list[int]], max_new_tokens: int,
              block_size: int | None) -> dict:
    """The round's prompts through SQL as the application: pooled τ, tokens/s over the calls'
    wall time, and answers that differ from the target's greedy ones."""
    accepted = steps = tokens = mismatches = 0
    wall = 0.0
    versions = set()
    with psycopg.connect(dsn + f" user={APP}", autocommit=True) as app:
        for prompt, ref in zip(prompts, reference):
            t = time.perf_counter()
            stats = app.execute("SELECT dflash_generate_stats(%s, max_new_tokens => %s, block_size => %s)",
                                (prompt, max_new_tokens, block_size)).fetchone()[0]
            wall += time.perf_counter() - t
            accepted += stats["accepted"]
            steps += stats["num_steps"]
            tokens += stats["new_tokens"]
            mismatches += stats["output_ids"] != ref
            versions.add(stats["drafter_version"])
    return {"tau": pooled_tau(accepted, steps), "tokens_per_s": tokens / wall if wall else None,
            "greedy_mismatches": mismatches, "prompts": len(prompts), "new_tokens": tokens, "steps": steps,
            "wall_s": round(wall, 1), "drafter_versions": sorted(v for v in versions if v)}


def fine_tune(dsn: str, worker: Worker, out: Path, target_dir: Path, args) -> dict:
    """`dflash train --from-database` on the application's rows; if adopted, the admin makes
    the worker load it."""
    cfg = from_database.fine_tune_config(lr=args.lr, seqs_per_step=args.seqs_per_step)
    try:
        res = from_database.run(dsn + f" user={TRAINER}", out, target_dir=target_dir, init_from=worker.drafter_dir,
                                default_drafter=None, filters=Filters(role=APP),
                                settings=Settings(steps=args.train_steps, min_rows=args.min_rows,
                                                  eval_max_new_tokens=args.max_new_tokens),
                                cfg=cfg, log=_log)
    except Exception as exc:  # recorded in the report: a round without a new drafter
        _log(f"fine-tune failed: {exc}")
        return {"error": str(exc), "adopted": False}
    summary = {k: getattr(res, k) for k in ("adopted", "rows_used", "heldout_rows", "steps", "train_seconds",
                                            "tau_before", "tau_after", "version", "parent_version")}
    if res.adopted:
        with psycopg.connect(dsn + f" user={ADMIN}", autocommit=True) as admin:
            swap = admin.execute("SELECT dflash.reload_drafter()").fetchone()[0]
        summary["reloaded"] = swap["drafter_version"]
    return summary


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    rows = report["rounds"]
    x = [r["round"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(x, [r["tau"] for r in rows], marker="o")
    a.set_title("τ on each round's new prompts")
    a.set_xlabel("round (0: shipped drafter)")
    a.set_ylabel("mean acceptance length τ")
    b.plot(x, [r["tokens_per_s"] for r in rows], marker="o", color="tab:orange")
    b.set_title("tokens/s through SQL")
    b.set_xlabel("round")
    for ax in (a, b):
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
    fig.suptitle(f"learning from the workload ({report['settings']['prompts_per_round']} prompts per round, "
                 f"block {report['settings']['block_size'] or 'auto'})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def readme_section(report: dict) -> str:
    """The README's table of a run: one row per round, from learning.json."""
    lines = ["| round | drafter | τ (held-out prompts) | tokens/s | greedy mismatches | fine-tune before it |",
             "|---|---|---|---|---|---|"]
    for r in report["rounds"]:
        ft = r.get("fine_tune") or {}
        if "error" in ft:
            tune = f"failed: {ft['error']}"
        elif ft:
            tune = (f"{ft['rows_used']} rows, {ft['steps']} steps, {ft['train_seconds']:.0f} s; held-out τ "
                    f"{ft['tau_before']:.2f} → {ft['tau_after']:.2f}, {'adopted' if ft['adopted'] else 'not adopted'}")
        else:
            tune = "– (shipped drafter)"
        lines.append(f"| {r['round']} | {r['drafter_version'] or r['drafter']} | {r['tau']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['greedy_mismatches']} / {r['prompts']} | {tune} |")
    gain = report.get("tau_gain")
    s = report["settings"]
    return (f"{README_START}\n_Generated by `{report['command']}` ({report['date']}, {report['threads']} threads, "
            f"{s['max_new_tokens']} new tokens, block {s['block_size'] or 'auto'}):_\n\n" + "\n".join(lines)
            + (f"\n\nτ from round 0 to round {report['rounds'][-1]['round']}: {gain:+.0%}.\n" if gain is not None else "\n")
            + README_END)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="fine-tuned rounds after round 0")
    ap.add_argument("--prompts-per-round", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16,
                    help="verify length every step (default 16: τ measures the drafter; 0: block length auto)")
    ap.add_argument("--train-steps", type=int, default=from_database.FINE_TUNE["steps"],
                    help="optimiser steps per fine-tune")
    ap.add_argument("--lr", type=float, default=from_database.FINE_TUNE["lr"])
    ap.add_argument("--seqs-per-step", type=int, default=from_database.FINE_TUNE["seqs_per_step"])
    ap.add_argument("--min-rows", type=int, default=Settings.min_rows, help="fewest rows a fine-tune accepts")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0, help="which workload prompts")
    ap.add_argument("--out", default="bench-out/learning")
    ap.add_argument("--readme", help="write the table into this README between the learning-results markers")
    ap.add_argument("--from-json", help="only rewrite the README table from this learning.json")
    args = ap.parse_args(argv)
    if args.from_json:
        from dflash.bench.readme import replace_section

        replace_section(Path(args.readme or "README.md"), README_START, README_END,
                        readme_section(json.loads(Path(args.from_json).read_text())))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    block = args.block_size or None

    target_dir, drafter_dir, _ = resolve_models(None, None, quiet=True)
    engine = load_engine(target_dir, drafter_dir)
    prompts = workload_rounds(args.rounds + 1, args.prompts_per_round, args.seed)
    server = start_local_cluster()
    sock = server.socket_dir / "worker.sock"
    worker = Worker(engine, None, socket_path=str(sock), socket_group=server.socket_group, drafter_dir=drafter_dir,
                    drafter_roots=[out])
    worker.start()
    report = {"rounds": [], "settings": {k: getattr(args, k) for k in ("rounds", "prompts_per_round",
                                                                      "max_new_tokens", "block_size", "train_steps",
                                                                      "lr", "seqs_per_step", "seed")},
              "command": "python -m tools.learning " + " ".join(argv if argv is not None else sys.argv[1:]),
              "target": engine.target.name, "drafter": engine.drafter_name, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
              "load_average_at_start": os.getloadavg()[0], "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    fine_tuned = None
    try:
        dsn = setup_database(server, sock)
        for r, round_prompts in enumerate(prompts):
            if r:
                _log(f"fine-tuning on the {r * args.prompts_per_round} rows so far")
                fine_tuned = fine_tune(dsn, worker, out / f"fine-tune-{r}", Path(target_dir), args)
            _log(f"round {r}: target greedy references")
            reference = reference_outputs(engine.target, round_prompts, args.max_new_tokens)
            _log(f"round {r}: {len(round_prompts)} prompts through SQL with drafter {engine.drafter_name}")
            row = {"round": r, **run_round(dsn, round_prompts, reference, args.max_new_tokens, block),
                   "drafter": engine.drafter_name, "drafter_version": engine.drafter_version,
                   "fine_tune": fine_tuned}
            report["rounds"].append(row)
            _log(f"round {r}: τ {row['tau']:.3f}, {row['tokens_per_s']:.1f} tokens/s, "
                 f"{row['greedy_mismatches']} greedy mismatches")
            first = report["rounds"][0]["tau"]
            report["tau_gain"] = row["tau"] / first - 1 if first else None
            (out / "learning.json").write_text(json.dumps(report, indent=1) + "\n")
            plot(report, out / "learning.png")
        with psycopg.connect(dsn + f" user={ADMIN}", autocommit=True) as admin:
            report["drafter_versions"] = [dict(zip(("version", "adopted", "rows_used", "steps", "tau_before",
                                                    "tau_after", "train_seconds"), v)) for v in admin.execute(
                "SELECT version, adopted, rows_used, steps, tau_before, tau_after, train_seconds "
                "FROM dflash.drafter_versions ORDER BY id")]
        (out / "learning.json").write_text(json.dumps(report, indent=1) + "\n")
    finally:
        worker.shutdown(timeout=30)
        server.stop()
    if args.readme:
        from dflash.bench.readme import replace_section

        replace_section(Path(args.readme), README_START, README_END, readme_section(report))
    print(json.dumps({"rounds": [{k: r[k] for k in ("round", "tau", "tokens_per_s", "greedy_mismatches")}
                                 for r in report["rounds"]], "tau_gain": report.get("tau_gain")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
