"""Target backends behind one protocol (protocol.py); `hf` is the reference (transformers)."""

from dflash.engine.target.protocol import Sequence, Target, TargetOutput, TargetRow

__all__ = ["Sequence", "Target", "TargetOutput", "TargetRow"]
