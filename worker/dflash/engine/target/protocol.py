"""What the engine needs of a target model, and nothing more.

A target backend holds the model and the KV memory of every sequence it serves. The engine
sees sequences only as handles: it asks for a new one per request, runs ONE batched forward
per step over rows of several sequences (a prefill chunk of one, a verify block of another:
ragged lengths are normal), rolls a sequence back after a partial acceptance and frees it at
the end. The drafter borrows the target's embedding and LM head, and reads the hidden
features of the layers it was trained on (id i = the output of decoder layer i, as
Hugging Face's `hidden_states[i + 1]`).

A backend is one file next to this one (`hf.py`: transformers, the reference; CUDA and CPU).
Nothing in the engine may assume more of a backend than this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


class Sequence(Protocol):
    """A backend's handle for one sequence's KV memory: `length` tokens are cached."""

    length: int


@dataclass
class TargetRow:
    """One sequence's part of a batched forward: `ids` are appended after the `seq.length`
    tokens already cached (the cache grows by len(ids)); logits are wanted for the last
    `logits` of them (0: none, e.g. a prefill chunk that is not the last)."""

    seq: Sequence
    ids: list[int]
    logits: int


@dataclass
class TargetOutput:
    """Per row, in the order given: fp32 logits [row.logits, V] and, when layers were asked
    for, the concatenated features of those layers for every one of the row's ids
    [len(ids), n_layers * hidden] (else None)."""

    logits: list[torch.Tensor]
    features: list[torch.Tensor | None]


@runtime_checkable
class Target(Protocol):
    name: str
    tokenizer: object | None
    vocab_size: int
    hidden_size: int
    num_layers: int
    context_length: int
    eos_ids: list[int]
    device: torch.device
    dtype: torch.dtype
    backend: str  # a short name for status and the tables ("hf", ...)
    # What the backend made of the weights, where it made something (the ort export's
    # precision and block size); part of every cached price's key. None: nothing.
    build: dict | None
    # The fewest rows a call of one sequence runs (a shorter one is padded to this many):
    # verifying fewer tokens costs what verifying this many does. 1 where nothing is padded.
    min_rows: int
    # Optional capabilities, declared (TargetDefaults gives a backend the "none" of each):
    # the most sequences it holds at once (llama.cpp's slots; None: as memory allows): the
    # scheduler's batch is capped by it;
    max_sequences: int | None
    # how the backend was chosen (--target-backend auto: each candidate's measured prices), for status;
    selection: dict | None
    # whether cached rows are exactly what prefilling the same tokens again would give (the
    # ort backend), so the prefix cache (dflash.engine.prefix_cache) may copy them: then
    #   copy_prefix(src, dst, n): a new sequence `dst` caches the first n tokens of `src`;
    #   shrink(seq): a kept sequence gives back the memory its cached rows do not use;
    #   kv_bytes(seq): the memory a kept sequence holds.
    # A backend without it prefills every prompt whole.
    copies_prefix: bool

    def new_sequence(self) -> Sequence: ...

    def free(self, seq: Sequence) -> None: ...

    def forward_batch(self, rows: list[TargetRow], layer_ids: tuple[int, ...] = ()) -> TargetOutput: ...

    def rollback(self, seq: Sequence, length: int) -> None:
        """Forget cached positions >= length (rejected drafts)."""

    def copy_prefix(self, src: Sequence, dst: Sequence, n: int) -> None: ...

    def shrink(self, seq: Sequence) -> None: ...

    def kv_bytes(self, seq: Sequence) -> int: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def head_weight(self) -> torch.Tensor:
        """The LM head [V, hidden], which the drafter borrows."""


class TargetDefaults:
    """The optional parts of the protocol as a backend has them unless it says otherwise:
    nothing built, nothing padded, no bound on sequences, not chosen by measuring, no
    prefix copies."""

    build: dict | None = None
    min_rows: int = 1
    max_sequences: int | None = None
    selection: dict | None = None
    copies_prefix: bool = False

    def copy_prefix(self, src: Sequence, dst: Sequence, n: int) -> None:
        raise NotImplementedError(f"the {self.backend} backend does not copy cached prefixes")

    def shrink(self, seq: Sequence) -> None:
        """Nothing to give back: a backend that reserves no spare rows."""

    def kv_bytes(self, seq: Sequence) -> int:
        raise NotImplementedError(f"the {self.backend} backend does not report a sequence's memory")
