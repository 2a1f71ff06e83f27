"""`dflash train --from-database DSN`: fine-tune the deployment's drafter on its own workload.

Every `dflash.generations` row holds a prompt and the target's own answer, which is what a
DFlash drafter trains on. One run:

1. **Reads** the rows training may use (`dflash.training_rows`: tables whose owner shares
   them, direct calls of consenting roles; see sql/50_drafter_versions.sql), for this
   target and for the drafter being trained or the versions it descends from (other
   drafters' rows are skipped unless `--any-drafter`), narrowed by the filters. Answers are
   the stored token ids where the row has them, the text re-tokenised otherwise; prompts
   are tokenised as the worker did (chat template or not, from the row's parameters).
   Rows are written only into the run directory (`rows.jsonl`, `features/`).
2. **Keeps back** the newest rows (by time, `--heldout-fraction`, 10 %) and fine-tunes the
   starting drafter (the newest adopted version, else the worker's default) on the rest
   with `dflash train`'s objective, trainer and feature cache, for a time, CPU-time or
   step budget.
3. **Measures** τ of the old and the new drafter on the held-out prompts with the engine
   (greedy, the drafter's full block every step), and checks both give the same output.
4. **Adopts** the new drafter only if τ rose by more than `--margin` (relative): it is
   written as `RUN/<target>-dflash-learned-<version>/`; otherwise the candidate's weights
   are deleted. Either way the run is a row of `dflash.drafter_versions` (rows used, steps,
   τ before and after, time, and for an adopted drafter its path and digest).

`dflash client reload-drafter --path DIR` or `SELECT dflash.reload_drafter()` then makes
the worker load it; `dflash serve --learn` does all of this by itself (dflash.serve.learn).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash.errors import DFlashError
from dflash.engine.stats import pooled_tau


@dataclass
class Filters:
    """Which consented rows a run reads (all of them by default)."""

    source_table: str | None = None  # a table name, or "none": direct calls only
    role: str | None = None  # calling_role
    since: str | None = None  # a timestamp: rows created at or after it
    min_new_tokens: int = 2
    limit: int | None = None  # the newest N rows
    any_drafter: bool = False  # also rows another drafter served


@dataclass
class Settings:
    """What a run does with the rows besides training (the trainer's own: TrainConfig)."""

    heldout_fraction: float = 0.1
    min_rows: int = 20
    margin: float = 0.02  # adopt when tau_after > tau_before * (1 + margin)
    eval_rows: int = 32  # the newest held-out rows evaluated with the engine
    eval_max_new_tokens: int = 128
    steps: int | None = None  # about this many optimiser steps (whole epochs); else TrainConfig.epochs


@dataclass
class RunResult:
    rows_used: int
    heldout_rows: int
    last_row_id: int
    steps: int
    train_seconds: float
    tau_before: float | None
    tau_after: float | None
    adopted: bool
    parent_version: str | None
    drafter: str | None = None
    version: str | None = None
    sha256: str | None = None
    path: str | None = None
    version_id: int | None = None
    details: dict = field(default_factory=dict)


# Fine-tuning a working drafter on its workload (the defaults of `dflash serve --learn` and
# the learning benchmark): a gentler learning rate than training from scratch, a short warm-up.
FINE_TUNE = {"lr": 3e-4, "warmup_steps": 5, "seqs_per_step": 4, "steps": 64}


def fine_tune_config(**overrides):
    """The trainer's settings for a fine-tune (dflash.train.trainer.TrainConfig)."""
    from dflash.train.trainer import TrainConfig

    base = {k: v for k, v in FINE_TUNE.items() if k != "steps"}
    return TrainConfig(**{**base, "checkpoint_minutes": 1e9, "eval_minutes": None, **overrides})


def adopt(tau_before: float | None, tau_after: float | None, margin: float) -> bool:
    """The adoption rule: the new drafter must beat the old one's τ on the held-out rows by
    more than `margin` (relative). Used by `dflash train --from-database` and `--learn`."""
    if tau_before is None or tau_after is None:
        return False
    return tau_after > tau_before * (1.0 + margin)


# --- reading the rows ------------------------------------------------------------------------

LINEAGE = """
WITH RECURSIVE chain (version, parent, drafter, depth) AS (
    SELECT v.version, v.parent_version, v.drafter, 0 FROM dflash.drafter_versions v
    WHERE v.adopted AND v.target = %(target)s AND v.version = %(version)s
    UNION
    SELECT v.version, v.parent_version, v.drafter, c.depth + 1 FROM dflash.drafter_versions v
    JOIN chain c ON v.version = c.parent
    WHERE v.adopted AND v.target = %(target)s AND c.depth < 10000
)
SELECT c.version, c.parent, c.drafter FROM chain c"""

ROWS = """
SELECT r.id, r.created_at, r.prompt, r.output, r.output_ids, r.params, r.new_tokens
FROM dflash.training_rows r
WHERE r.target = %(target)s
  AND (%(any_drafter)s OR r.drafter_version = ANY(%(versions)s::text[])
       OR (r.drafter_version IS NULL AND r.drafter = ANY(%(names)s::text[])))
  AND (NOT %(direct_only)s OR r.source_table IS NULL)
  AND (%(source_oid)s::oid IS NULL OR r.source_table::oid = %(source_oid)s::oid)
  AND (%(role)s::name IS NULL OR r.calling_role = %(role)s::name)
  AND (%(since)s::timestamptz IS NULL OR r.created_at >= %(since)s::timestamptz)
  AND coalesce(r.new_tokens, cardinality(r.output_ids), 0) >= %(min_new_tokens)s
ORDER BY r.created_at DESC, r.id DESC
LIMIT %(limit)s"""

# A table by name ("schema.table", or a name visible on the search path) from the catalogs,
# which every role may read: the trainer has no rights on other roles' schemas.
TABLE_OID = """
SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname || '.' || c.relname = %(name)s OR (c.relname = %(name)s AND pg_catalog.pg_table_is_visible(c.oid))"""

NEWEST_ADOPTED = """
SELECT v.path, v.version FROM dflash.drafter_versions v
WHERE v.adopted AND v.target = %s ORDER BY v.id DESC"""

RECORD = """
INSERT INTO dflash.drafter_versions (target, adopted, drafter, version, sha256, path, parent_version, rows_used,
    heldout_rows, last_row_id, steps, train_seconds, tau_before, tau_after, margin, details)
VALUES (%(target)s, %(adopted)s, %(drafter)s, %(version)s, %(sha256)s, %(path)s, %(parent_version)s, %(rows_used)s,
    %(heldout_rows)s, %(last_row_id)s, %(steps)s, %(train_seconds)s, %(tau_before)s, %(tau_after)s, %(margin)s,
    %(details)s)
RETURNING id"""


def lineage(conn, target: str, version: str | None, name: str) -> tuple[list[str], list[str]]:
    """The versions (and names) of the drafter being trained and those it descends from."""
    versions, names = {version} - {None}, {name}
    if version:
        for v, parent, drafter in conn.execute(LINEAGE, {"target": target, "version": version}):
            versions |= {v, parent} - {None}
            names |= {drafter} - {None}
    return sorted(versions), sorted(names)


def read_rows(conn, target: str, versions: list[str], names: list[str], filters: Filters) -> list[dict]:
    """The rows training may read, oldest first."""
    import psycopg

    params = {"target": target, "versions": versions, "names": names, "any_drafter": filters.any_drafter,
              "direct_only": filters.source_table == "none", "source_oid": None, "role": filters.role,
              "since": filters.since, "min_new_tokens": filters.min_new_tokens, "limit": filters.limit}
    try:
        if filters.source_table not in (None, "none"):
            found = conn.execute(TABLE_OID, {"name": filters.source_table}).fetchall()
            if len(found) != 1:
                raise DFlashError("bad_filter", f"bad filter: no table {filters.source_table!r} (name it schema.table)")
            params["source_oid"] = found[0][0]
        cur = conn.execute(ROWS, params)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise DFlashError("forbidden", f"this role may not read dflash.training_rows ({exc.diag.message_primary}): "
                          "connect as a member of dflash_trainer") from None
    except (psycopg.errors.InvalidTextRepresentation, psycopg.errors.InvalidDatetimeFormat,
            psycopg.errors.DatetimeFieldOverflow) as exc:
        raise DFlashError("bad_filter", f"bad filter: {exc.diag.message_primary}") from None
    cols = [c.name for c in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()][::-1]


def starting_drafter(conn, target: str, default: Path | None) -> Path:
    """The newest adopted version whose folder is here, else `default` (the worker's)."""
    for path, _version in conn.execute(NEWEST_ADOPTED, (target,)):
        if path and Path(path).is_dir():
            return Path(path)
    if default is None:
        raise DFlashError("bad_drafter", f"no adopted drafter for {target} in dflash.drafter_versions and no default "
                          "drafter for this target: give --init-from DIR (the worker's drafter)")
    return Path(default)


def to_records(engine, rows: list[dict]) -> list[dict]:
    """Training records (prompt, prompt_ids, response_ids) from rows, tokenised as the worker
    tokenised them; rows without stored ids have their answer text re-tokenised."""
    from dflash.engine.engine import GenerationRequest

    tok = engine.tokenizer
    records = []
    for row in rows:
        params = row["params"] or {}
        try:
            prompt_ids = engine.prompt_ids(GenerationRequest(prompt=row["prompt"], chat=bool(params.get("chat", False))))
        except DFlashError:  # a prompt the target cannot take any more (too long): not training data
            continue
        response = list(row["output_ids"]) if row["output_ids"] else tok(row["output"], add_special_tokens=False).input_ids
        if len(prompt_ids) + len(response) > engine.target.context_length:
            continue
        records.append({"prompt": row["prompt"], "prompt_ids": prompt_ids, "response_ids": response, "id": row["id"],
                        "greedy": not params.get("temperature"), "stored_ids": bool(row["output_ids"])})
    return records


def split_by_time(records: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(training, held-out): the newest `fraction` of the records (at least one) held out.
    A prompt asked again is held out with its newest asking, never trained on."""
    n_held = max(1, round(len(records) * fraction))
    held = records[-n_held:]
    held_prompts = {r["prompt"] for r in held}
    return [r for r in records[:-n_held] if r["prompt"] not in held_prompts], held


# --- evaluation with the engine ----------------------------------------------------------------


def heldout_tau(engine, records: list[dict], max_new_tokens: int) -> dict:
    """Greedy generations of the held-out prompts at the drafter's full block: pooled τ, and
    each output (so two drafters' outputs can be compared: they must be the same)."""
    from dflash.engine.engine import GenerationRequest

    accepted = steps = 0
    outputs = []
    for r in records:
        n = max(1, min(max_new_tokens, len(r["response_ids"]),
                       engine.target.context_length - len(r["prompt_ids"])))
        res = engine.generate(GenerationRequest(input_ids=r["prompt_ids"], max_new_tokens=n,
                                                block_size=engine.block_size))
        accepted += res.stats.accepted
        steps += res.stats.num_steps
        outputs.append(res.output_ids)
    return {"tau": pooled_tau(accepted, steps), "steps": steps, "outputs": outputs}


def stored_mismatches(records: list[dict], outputs: list[list[int]]) -> int:
    """Held-out greedy rows with stored ids whose stored answer the engine did not reproduce
    (a row written by another device or dtype may differ; this is reported, not enforced)."""
    return sum(1 for r, out in zip(records, outputs)
               if r["greedy"] and r["stored_ids"] and r["response_ids"][: len(out)] != out)


# --- one run -------------------------------------------------------------------------------------


def fine_tune(target, drafter_dir: Path, records: list[dict], out: Path, cfg, stage: str) -> dict:
    """Fine-tune the drafter in `drafter_dir` on `records` with dflash train's trainer; the
    candidate lands in out/train/drafter."""
    from dflash.loading import load_drafter
    from dflash.train.features import FeatureCache
    from dflash.train.trainer import read_lineage, train

    drafter = load_drafter(drafter_dir).float()
    cache = FeatureCache(out / "features")
    cache.build(target, records, list(drafter.config.target_layer_ids))
    cfg.stage = stage
    return train(drafter, target, cache, out / "train", cfg, resume=False, lineage=read_lineage(drafter_dir))


def run(dsn: str, out: Path, *, target_dir: Path, init_from: Path | None, default_drafter: Path | None,
        filters: Filters = Filters(), settings: Settings = Settings(), cfg=None, device: str = "cpu",
        log=print) -> RunResult:
    """One fine-tuning run (see the module's docstring). Raises DFlashError with a clear
    message when too few rows match or the database refuses."""
    import psycopg
    import torch
    from psycopg.types.json import Jsonb

    from dflash.engine.costs import CostCurve
    from dflash.engine.engine import Engine
    from dflash.engine.target.hf import HFTarget
    from dflash.engine.versions import label
    from dflash.loading import load_versioned
    from dflash.train.trainer import TrainConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target_name = Path(target_dir).name
    t0 = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        start_dir = Path(init_from) if init_from else starting_drafter(conn, target_name, default_drafter)
        old, old_sha = load_versioned(start_dir)
        parent = label(old_sha)
        versions, names = lineage(conn, target_name, parent, start_dir.name)
        rows = read_rows(conn, target_name, versions, names, filters)
    if len(rows) < settings.min_rows:
        raise DFlashError("too_few_rows", f"only {len(rows)} rows of dflash.training_rows match (target "
                          f"{target_name}, drafter {start_dir.name} or its ancestors, the filters); at least "
                          f"{settings.min_rows} are needed. Rows train only with consent: share a table "
                          "(generation_targets.share_for_training) or list a role in dflash.training_consent")
    log(f"{len(rows)} rows read; fine-tuning {start_dir.name} ({parent})")

    target = HFTarget.from_pretrained(target_dir, device=device)
    engine = Engine(target, old.float(), start_dir.name, cost_curve=CostCurve.flat(old.config.block_size),
                    drafter_sha256=old_sha)
    records = to_records(engine, rows)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train_records, held = split_by_time(records, settings.heldout_fraction)
    held = held[-settings.eval_rows:]
    if not train_records:
        raise DFlashError("too_few_rows", "every row's prompt is among the held-out ones: nothing left to train on")
    cfg = cfg or TrainConfig()
    if settings.steps:
        per_epoch = max(1, len(train_records) // cfg.seqs_per_step)
        cfg.epochs = max(1, math.ceil(settings.steps / per_epoch))
    t_train = time.monotonic()
    state = fine_tune(target, start_dir, train_records, out, cfg,
                      f"fine-tune on {len(train_records)} workload rows (dflash train --from-database)")
    train_s = time.monotonic() - t_train
    candidate = out / "train" / "drafter"

    before = heldout_tau(engine, held, settings.eval_max_new_tokens)
    new, new_sha = load_versioned(candidate)
    engine.swap_drafter(new.float(), candidate.name, new_sha)
    after = heldout_tau(engine, held, settings.eval_max_new_tokens)
    differ = sum(a != b for a, b in zip(before["outputs"], after["outputs"]))
    adopted = adopt(before["tau"], after["tau"], settings.margin) and differ == 0
    log(f"held-out τ {before['tau']:.3f} -> {after['tau']:.3f} on {len(held)} prompts "
        f"({'adopted' if adopted else 'not adopted'})")

    result = RunResult(
        rows_used=len(train_records), heldout_rows=len(held), last_row_id=max(r["id"] for r in rows),
        steps=state["step"], train_seconds=round(train_s, 1), tau_before=before["tau"], tau_after=after["tau"],
        adopted=adopted, parent_version=parent,
        details={"filters": asdict(filters), "settings": asdict(settings), "train": asdict(cfg),
                 "rows_read": len(rows), "drafter_outputs_differ": differ,
                 "stored_mismatches": stored_mismatches(held, before["outputs"]),
                 "heldout_steps": {"before": before["steps"], "after": after["steps"]},
                 "threads": torch.get_num_threads(), "seconds": None})
    if adopted:
        final = out / f"{target_name}-dflash-learned-{label(new_sha)}"
        if final.exists():
            shutil.rmtree(final)
        candidate.rename(final)
        result.drafter, result.version, result.sha256, result.path = final.name, label(new_sha), new_sha, str(final)
    else:  # written only when adopted: the candidate's weights go
        shutil.rmtree(candidate, ignore_errors=True)
    shutil.rmtree(out / "train" / "best", ignore_errors=True)
    (out / "train" / "checkpoint.pt").unlink(missing_ok=True)
    result.details["seconds"] = round(time.monotonic() - t0, 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = {**asdict(result), "target": target_name, "margin": settings.margin,
               "details": Jsonb(result.details)}
        result.version_id = conn.execute(RECORD, row).fetchone()[0]
    (out / "summary.json").write_text(json.dumps(asdict(result), indent=1) + "\n")
    return result


def run_from_args(args) -> int:
    """`dflash train --from-database DSN` (options: dflash.train.args and dflash.train.db_args)."""
    import torch

    from dflash.model_files import default_target_dir, ensure_default_drafter, resolve_target
    from dflash.train.trainer import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = resolve_target(args.target, quiet=True).folder
    default_drafter = (ensure_default_drafter(target_dir, quiet=True)[0]
                       if target_dir.resolve() == default_target_dir().resolve() else None)
    cfg = TrainConfig(
        epochs=args.epochs, lr=args.lr, schedule=args.schedule, warmup_steps=args.warmup_steps,
        max_anchors=args.max_anchors, seqs_per_step=args.seqs_per_step, block_tokens=args.block_tokens,
        weighting=args.weighting, gamma=args.gamma, loss_positions=args.loss_positions,
        autocast=not args.no_autocast, time_budget_s=args.time_budget_min * 60 if args.time_budget_min else None,
        cpu_budget_s=args.cpu_budget_min * 60 if args.cpu_budget_min else None, schedule_by_budget=True,
        checkpoint_minutes=args.checkpoint_minutes, eval_minutes=None, seed=args.seed)
    filters = Filters(source_table=args.source_table, role=args.role, since=args.since,
                      min_new_tokens=args.min_new_tokens, limit=args.limit, any_drafter=args.any_drafter)
    settings = Settings(heldout_fraction=args.heldout_fraction, min_rows=args.min_rows, margin=args.margin,
                        eval_rows=args.eval_rows, eval_max_new_tokens=args.eval_max_new_tokens, steps=args.steps)
    res = run(args.from_database, Path(args.out), target_dir=Path(target_dir),
              init_from=Path(args.init_from) if args.init_from else None, default_drafter=default_drafter,
              filters=filters, settings=settings, cfg=cfg, device=args.device)
    print(json.dumps({k: v for k, v in asdict(res).items() if k != "details"}))
    return 0
