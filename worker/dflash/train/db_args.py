"""Command-line options for learning from the workload (torch-free, so building the CLI stays
fast): `dflash train --from-database DSN ...` (`dflash serve --learn ...`'s are in
dflash.serve.learn). Defaults live in dflash.train.from_database (Filters, Settings)."""

from __future__ import annotations

import argparse

from dflash.train.from_database import Filters, Settings


def add_from_database_arguments(p: argparse.ArgumentParser) -> None:
    """`dflash train --from-database DSN`: fine-tune on dflash.generations (the corpus options
    do not apply; the trainer's do)."""
    g = p.add_argument_group("learning from the workload (dflash train --from-database DSN)")
    g.add_argument("--from-database", metavar="DSN",
                   help="fine-tune the current drafter on the generations stored in this database "
                        "(connect as a member of dflash_trainer)")
    add_filter_arguments(g)
    g.add_argument("--min-rows", type=int, default=Settings.min_rows, help="refuse with fewer matching rows")
    g.add_argument("--heldout-fraction", type=float, default=Settings.heldout_fraction,
                   help="the newest rows kept back to measure τ of the old and the new drafter")
    g.add_argument("--margin", type=float, default=Settings.margin,
                   help="adopt the new drafter only if its held-out τ beats the old one's by more than this (relative)")
    g.add_argument("--eval-rows", type=int, default=Settings.eval_rows, help="held-out prompts run through the engine")
    g.add_argument("--eval-max-new-tokens", type=int, default=Settings.eval_max_new_tokens)
    g.add_argument("--steps", type=int, help="about this many optimiser steps (whole epochs; default: --epochs)")


def add_filter_arguments(g) -> None:
    g.add_argument("--source-table", help="only rows generated for this table ('none': direct calls only)")
    g.add_argument("--role", help="only rows of this calling role")
    g.add_argument("--since", help="only rows created at or after this timestamp")
    g.add_argument("--min-new-tokens", type=int, default=Filters.min_new_tokens,
                   help="only answers of at least this many tokens")
    g.add_argument("--limit", type=int, help="only the newest N rows")
    g.add_argument("--any-drafter", action="store_true",
                   help="also rows served by drafters outside the trained drafter's lineage")


def check_from_database_arguments(args) -> None:
    """The corpus options do not go with --from-database."""
    clash = [name for name in ("answers", "prompts", "prompt_file", "sequences", "topk", "init")
             if getattr(args, name, None) not in (None, False, 0, "target")]
    if clash:
        from dflash.errors import DFlashError

        raise DFlashError("bad_params", "--from-database trains on the database's rows; drop "
                          + ", ".join("--" + c.replace("_", "-") for c in clash))
