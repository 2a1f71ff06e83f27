"""The proposers' names, in one place: what `GenerationRequest.proposers`, the step plans and
the per-proposer statistics call them (no imports, so the statistics can name them too)."""

DFLASH = "dflash"  # the DFlash drafter (dflash.engine.proposers.dflash)
SUFFIX = "suffix"  # the suffix proposer (dflash.engine.proposers.suffix)
HEAD = "head"  # the next-token head (dflash.engine.proposers.head)
POINT_MASS = (SUFFIX, HEAD)  # proposers whose drafts are no drafter's: kept out of its per-position counts
