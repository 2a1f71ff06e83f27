"""Every proposer the engine runs: one line each, in the order they offer (where two offers
are worth the same, the earlier wins). A proposer is a module with `build(engine)`, which
returns the proposer for that engine, or None where it cannot run there (no drafter given,
no head made for this target, no draft model)."""

from __future__ import annotations

import importlib

PROPOSERS = [
    "dflash.engine.proposers.dflash",  # the DFlash drafter: a block per pass, when chosen
    "dflash.engine.proposers.suffix_head",  # suffix chains (the next-token head picks a first token), head guesses
    "dflash.engine.proposers.forced",  # the tokens a request's grammar forces (json_schema, regex, choices)
    "dflash.engine.proposers.draft_model",  # a smaller model with the target's tokenizer, token by token, when chosen
]


def register(module: str) -> None:
    """Add a proposer module (engines built from now on run it)."""
    if module not in PROPOSERS:
        PROPOSERS.append(module)


def build(engine) -> list:
    """The proposers of `engine`, in registry order."""
    out = []
    for path in PROPOSERS:
        proposer = importlib.import_module(path).build(engine)
        if proposer is not None:
            out.append(proposer)
    return out
