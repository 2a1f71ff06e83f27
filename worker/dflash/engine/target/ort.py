"""An int8 CPU target backend: the target as an ONNX graph run by ONNX Runtime.

The graph (made by dflash.convert.onnx_target from the target's Hugging Face folder) holds
8-bit block-quantized weights whose kernels reuse each weight block across the rows of a
call: verifying 4 drafted tokens cost about 1.35 plain steps on a 2-core AVX2 EPYC (Zen 3,
blocks of 32) and 1.05 on a Zen 5 (blocks of 64), where llama.cpp's Q4_1 kernels pay every
row in full (2.35 and 2.7). Everything the loop needs:
- K/V memory: per sequence and layer a buffer [1, kv_heads, capacity, head_dim] that ONNX
  Runtime's attention reads and writes in place (its shared past/present buffers: nothing
  is copied per step); it grows by doubling, and a rollback only moves the length back;
- logits of the asked rows only (the graph's `logit_rows` input), features of any layer
  (the graph's `features.{i}` outputs: the residual stream after layer i);
- exactness whatever shares a step: every call runs one sequence with at least two rows,
  one path through the kernels, whose numbers for a row do not depend on how many rows
  the call has (int8 activations are quantized per row, integer sums are exact; measured:
  bit-identical logits and features for a token decoded alone, in a verify block of any
  length, or in a prefill chunk). Two things would break it, both measured: a call of one
  row (attention takes a matrix-vector path that rounds differently, and the int8 network
  amplifies a 4e-6 difference to ~0.3 in the logits), so a lone row is padded to two; a
  call of more than 128 rows (another path again: a 129-token prompt prefilled in one call
  gave logits up to 1.0 away from the same prompt in two chunks, and a different greedy
  answer when it shared steps with other callers), so longer rows (prompts) run in calls of
  at most 128; and several sequences in one call, which ONNX Runtime's attention allows
  only one row each (through that same path), so each sequence runs in a call of its own.
The drafter borrows the embedding and the LM head from the Hugging Face folder (fp32).

A different numeric path from the fp32 reference: greedy output is this backend's greedy
output (exactly, with drafts, batched or not), which can differ from the fp32 path where
two logits are close.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash.engine.target.hf_files import BorrowedHead, read_hf_side
from dflash.engine.target.protocol import TargetOutput, TargetRow
from dflash.errors import DFlashError

NAME = "ort"
DEFAULT_CONTEXT = 4096
INITIAL_CAPACITY = 256  # K/V rows of a sequence at first; doubles as it grows
MIN_ROWS = 2  # a call of one row takes another kernel path (module doc)
MAX_ROWS = 128  # and so does a call of more (module doc): longer rows go in calls of this many


def available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class OrtSequence:
    """`length` tokens cached in per-layer K/V buffers (allocated at the first forward), and
    the ONNX Runtime binding of those buffers (made again only when they grow)."""

    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    length: int = 0
    binding: object | None = None
    buffers: list = field(default_factory=list)  # (past name, present name, OrtValue) per K/V buffer
    bound_layers: tuple | None = None  # the feature outputs the binding's last call wanted


class OrtTarget(BorrowedHead):
    backend = NAME
    min_rows = MIN_ROWS  # a lone row is padded to two (Target protocol)

    def __init__(self, model_file: str | Path, hf_dir: str | Path, threads: int | None = None,
                 context: int = DEFAULT_CONTEXT, build: dict | None = None):
        """`build`: what the graph was exported as (dflash.convert.onnx_target.BUILD), the
        `build` of the Target protocol."""
        import onnxruntime as ort

        model_file, hf_dir = Path(model_file), Path(hf_dir)
        side = read_hf_side(hf_dir, "ort", model_file, "ONNX model")
        cfg = side.config
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        # No spinning after a call: the drafter (PyTorch or its own ONNX Runtime session) runs
        # next, and spinning threads would take its cores.
        opts.add_session_config_entry("session.force_spinning_stop", "1")
        try:
            self.session = ort.InferenceSession(str(model_file), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise DFlashError("bad_target", f"ONNX Runtime cannot load {model_file} ({str(exc)[:200]})") from None
        inputs = {i.name: i for i in self.session.get_inputs()}
        if not {"seqlens_k", "total_sequence_length", "logit_rows", "past_key_values.0.key"} <= set(inputs):
            raise DFlashError("bad_target", f"{model_file} is not a graph made by dflash.convert.onnx_target")
        self.num_layers = sum(1 for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
        if self.num_layers != cfg.num_hidden_layers:
            raise DFlashError("bad_target", f"{model_file} ({self.num_layers} layers) is not the model in {hf_dir} "
                                            f"({cfg.num_hidden_layers})")
        kv_shape = inputs["past_key_values.0.key"].shape
        self.kv_heads = int(kv_shape[1])
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.hidden_size = int(cfg.hidden_size)
        self.model_file, self.hf_dir, self.build = model_file, hf_dir, build
        self.name = hf_dir.name
        self.threads = opts.intra_op_num_threads
        self.context_length = min(int(getattr(cfg, "max_position_embeddings", 2048)), context)
        self._embed, self._head = side.embed, side.head
        self.vocab_size = int(self._head.shape[0])
        self.tokenizer, self.eos_ids = side.tokenizer, side.eos_ids
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # of what it returns (logits, features); the weights are int8
        self._ortvalue = ort.OrtValue.ortvalue_from_numpy

    # --- the Target protocol -------------------------------------------------------------

    def new_sequence(self) -> OrtSequence:
        return OrtSequence()

    @staticmethod
    def free(seq: OrtSequence) -> None:
        seq.keys, seq.values, seq.length, seq.binding, seq.buffers = [], [], 0, None, []

    @staticmethod
    def rollback(seq: OrtSequence, length: int) -> None:
        seq.length = min(seq.length, length)

    def forward_batch(self, rows: list[TargetRow], layer_ids: tuple[int, ...] = ()) -> TargetOutput:
        for i in layer_ids:
            if not 0 <= i < self.num_layers:
                raise DFlashError("incompatible_drafter", f"the drafter reads target layer {i}; the target has "
                                                          f"{self.num_layers}")
        logits, feats = [], []
        for row in rows:  # one call per sequence, of at most MAX_ROWS rows (module doc)
            lgs, fts = [], []
            for k in range(0, len(row.ids), MAX_ROWS):
                part = row.ids[k:k + MAX_ROWS]
                asked = max(0, row.logits - (len(row.ids) - k - len(part)))  # asked rows are the last ones
                lg, ft = self._call(TargetRow(row.seq, part, min(asked, len(part))), layer_ids)
                row.seq.length += len(part)
                lgs.append(lg)
                if ft is not None:
                    fts.append(ft)
            logits.append(torch.cat(lgs) if len(lgs) > 1 else lgs[0] if lgs else torch.empty(0, self.vocab_size))
            feats.append(torch.cat(fts) if fts else (torch.empty(0, len(layer_ids) * self.hidden_size)
                                                      if layer_ids else None))
        return TargetOutput(logits, feats)

    # --- inside ------------------------------------------------------------------------------

    def _reserve(self, seq: OrtSequence, rows: int) -> None:
        """K/V buffers of at least `rows` rows (grown by doubling, the cached rows kept)."""
        have = seq.keys[0].shape[2] if seq.keys else 0
        if rows <= have:
            return
        if rows > self.context_length + MIN_ROWS:
            raise DFlashError("busy", f"the ort backend's K/V memory ({self.context_length} tokens per sequence) is full")
        cap = max(have, INITIAL_CAPACITY)
        while cap < rows:
            cap *= 2
        shape = (1, self.kv_heads, cap, self.head_dim)
        seq.binding = None
        for store in (seq.keys, seq.values):
            for layer in range(self.num_layers):
                new = np.zeros(shape, dtype=np.float32)
                if layer < len(store):
                    new[:, :, :have] = store[layer]
                    store[layer] = new
                else:
                    store.append(new)

    def _call(self, row: TargetRow, layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One ONNX Runtime run: the row's ids after its cached tokens (padded to MIN_ROWS;
        pad rows land past the sequence's length and are never read)."""
        seq, n = row.seq, len(row.ids)
        S = max(n, MIN_ROWS)
        total = seq.length + S
        self._reserve(seq, total)
        ids = np.zeros((1, S), dtype=np.int64)
        ids[0, :n] = row.ids
        want = np.arange(n - row.logits, n, dtype=np.int64) if row.logits else np.zeros(1, dtype=np.int64)
        # Outputs land in arrays of ours (no copy, no wrapper per K/V buffer): logits of the
        # asked rows, each asked layer's residual stream of the call's rows.
        logits = np.empty((len(want), self.vocab_size), dtype=np.float32)
        feats = [np.empty((1, S, self.hidden_size), dtype=np.float32) for _ in layer_ids]
        b = self._binding(seq, layer_ids)
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("seqlens_k", np.array([total - 1], dtype=np.int32))
        b.bind_cpu_input("total_sequence_length", np.array(total, dtype=np.int32))
        b.bind_cpu_input("logit_rows", want)
        for name, arr in zip(("logits", *(f"features.{i}" for i in layer_ids)), (logits, *feats)):
            b.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
        self.session.run_with_iobinding(b)
        out_logits = torch.from_numpy(logits) if row.logits else torch.empty(0, self.vocab_size)
        out_feats = torch.from_numpy(np.concatenate([f[0, :n] for f in feats], axis=-1)) if layer_ids else None
        return out_logits, out_feats

    def _binding(self, seq: OrtSequence, layer_ids: tuple[int, ...]):
        """The sequence's binding: its K/V buffers as past (in) and present (out, the same
        memory), bound while the buffers last; the caller binds the wanted outputs (logits,
        the features of `layer_ids`) to its own arrays each call. A call that wants other
        layers than the last one starts the outputs afresh (an output left bound would be
        written into the last call's array)."""
        b = seq.binding
        if b is None:
            b = seq.binding = self.session.io_binding()
            seq.buffers = [(f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}", self._ortvalue(store[layer]))
                           for layer in range(self.num_layers)
                           for kind, store in (("key", seq.keys), ("value", seq.values))]
            for past, _, value in seq.buffers:
                b.bind_ortvalue_input(past, value)
            seq.bound_layers = None
        if seq.bound_layers != layer_ids:
            b.clear_binding_outputs()
            for _, present, value in seq.buffers:
                b.bind_ortvalue_output(present, value)
            seq.bound_layers = layer_ids
        return b

    def close(self) -> None:
        self.session = None
