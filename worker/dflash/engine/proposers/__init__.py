"""Proposers behind one protocol (protocol.py): `dflash` (the block drafter), ..."""

from dflash.engine.proposers.protocol import Draft, Proposer

__all__ = ["Draft", "Proposer"]
