"""Target backends behind one protocol (protocol.py); `hf` is the reference (transformers)."""

from dflash.engine.target.protocol import Sequence, Target, TargetDefaults, TargetOutput, TargetRow

__all__ = ["Sequence", "Target", "TargetDefaults", "TargetOutput", "TargetRow"]
