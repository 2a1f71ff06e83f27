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
- exactness whatever shares a step: a row's numbers do not depend on how many rows share
  its call (the weights' kernels: int8 activations quantized per row, exact integer sums;
  measured for every `MatMulNBits` of the graph, 1 to 16 rows, bit-identical; measured
  end to end: logits and features of a token decoded alone, in a verify block of any
  length, in a prefill chunk or beside other sequences, bit-identical). Two things would
  break it, both measured: attention over one row (a matrix-vector path that rounds
  differently, and the int8 network amplifies a 4e-6 difference to ~0.3 in the logits), so
  a sequence's attention always sees at least MIN_ROWS rows: a lone row goes through the
  weights once and through attention twice (the graph's `attention_rows`/`output_rows`;
  the copy's K/V lands past the sequence's length and is never read); and a call of more
  than 128 rows (another path again: a 129-token prompt prefilled in one call gave logits
  up to 1.0 away from the same prompt in two chunks, and a different greedy answer when it
  shared steps with other callers), so longer rows (prompts) run in calls of at most 128;
- several requests in one forward: ONNX Runtime's attention takes several sequences in one
  call only with one row each (the one-row path again), so the export's batch graphs
  (dflash.onnx_export_files.BATCH_GRAPHS) put the rows of up to 8 sequences on one row
  axis through the weights and give each sequence an attention node of its own, on its own
  K/V buffers: one call reads the weights once for all of them, and each sequence's rows
  go through the same kernels as alone (bit-identical, tested). A graph for k sequences
  runs fewer, its spare attention nodes over one row the call already has (a 1-token
  "prompt" on a scratch buffer, whose output nothing reads); the graphs' sessions open at
  the first call that needs them, each with its own copy of the weights (~160 MB).
The drafter borrows the embedding and the LM head from the Hugging Face folder (fp32).

A different numeric path from the fp32 reference: greedy output is this backend's greedy
output (exactly, with drafts, batched or not), which can differ from the fp32 path where
two logits are close.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash.engine.target.hf_files import BorrowedHead, read_hf_side
from dflash.engine.target.protocol import TargetOutput, TargetRow
from dflash.errors import DFlashError
from dflash.onnx_export_files import BATCH_GRAPHS, batch_file, read_build

NAME = "ort"
DEFAULT_CONTEXT = 4096
INITIAL_CAPACITY = 256  # K/V rows of a sequence at first; doubles as it grows
MIN_ROWS = 2  # attention over one row takes another kernel path (module doc): its rows at least
MAX_ROWS = 128  # and so does a call of more (module doc): longer rows go in calls of this many
BINDINGS_KEPT = 8  # batch bindings kept (each holds its sequences' K/V buffers)


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
    generation: int = 0  # bumped when the K/V buffers are replaced (bindings of them are stale)
    serial: int = field(default_factory=itertools.count().__next__)  # names it in the batch bindings' keys


def _attention_rows(n: int, rows: int) -> np.ndarray:
    """Which of a sequence's n rows its attention reads, `rows` >= n of them: all n, then
    the last again (only n = 1 is ever padded: MIN_ROWS)."""
    return np.minimum(np.arange(rows, dtype=np.int64), n - 1)


class OrtTarget(BorrowedHead):
    backend = NAME  # the int8 build's; another build's adds its precision ("ort-q4_1")
    min_rows = 1  # a lone row goes through the weights alone (only its attention sees it twice) ...
    copies_prefix = True  # cached rows are exactly what prefilling the same tokens again gives

    def __init__(self, model_file: str | Path, hf_dir: str | Path, threads: int | None = None,
                 context: int = DEFAULT_CONTEXT):
        """The Target protocol's `build` (what the graph was exported as: format, precision,
        block size) is read from the export's manifest beside `model_file`."""
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
        self._opts, self._batch_sessions, self._batch_bindings, self._scratch_values = opts, {}, {}, None
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
        self.model_file, self.hf_dir, self.build = model_file, hf_dir, read_build(model_file.parent)
        # ... except in a build whose kernels round one row differently from several (the q4_1
        # build's 4-bit weights: dflash.convert.onnx_q41), where it goes through them twice.
        # (the int4 build's 4-bit kernels do so on some CPUs only: there it is measured, below)
        fewest = (self.build or {}).get("min_rows", 1)
        self.min_rows = 2 if fewest == "measured" else int(fewest)
        precision = (self.build or {}).get("precision", "int8")
        self.backend = NAME if precision == "int8" else f"{NAME}-{precision}"
        self.name = hf_dir.name
        self.threads = opts.intra_op_num_threads
        self.context_length = min(int(getattr(cfg, "max_position_embeddings", 2048)), context)
        self._side = side
        self.vocab_size = int(side.head_shape[0])
        self.tokenizer, self.eos_ids = side.tokenizer, side.eos_ids
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # of what it returns (logits, features); the weights are int8
        self._ortvalue = ort.OrtValue.ortvalue_from_numpy
        # Sequences per call: up to the largest batch graph, where the export has them.
        self.max_batch = max(BATCH_GRAPHS) if all((model_file.parent / batch_file(k)).is_file()
                                                  for k in BATCH_GRAPHS) else 1
        if fewest == "measured" and self.one_row_is_exact():
            self.min_rows = 1

    def one_row_is_exact(self) -> bool:
        """Whether rows that go through the weights one per call get the numbers they get
        among several here (this CPU's kernels): three new rows after a short context, fed
        one per call against one call of three (min_rows 1 for the lone calls), logits and
        the features compared bit for bit. A kernel that rounds one row otherwise does so
        for any numbers, so one comparison tells."""
        ids = [(11 + 97 * i) % self.vocab_size for i in range(8)]
        saved, self.min_rows = self.min_rows, 1
        try:
            runs = []
            for cuts in ((1, 1, 1), (3,)):
                seq, logits, features = self.new_sequence(), [], []
                self.forward_batch([TargetRow(seq, ids[:5], 0)], ())
                at = 5
                for c in cuts:
                    out = self.forward_batch([TargetRow(seq, ids[at:at + c], c)], (0,))
                    logits.append(out.logits[0].numpy().copy()), features.append(out.features[0].numpy().copy())
                    at += c
                self.free(seq)
                runs.append((np.concatenate(logits), np.concatenate(features)))
            return all(np.array_equal(a, b) for a, b in zip(*runs))
        finally:
            self.min_rows = saved

    # --- the Target protocol -------------------------------------------------------------

    def new_sequence(self) -> OrtSequence:
        return OrtSequence()

    def free(self, seq: OrtSequence) -> None:
        seq.keys, seq.values, seq.length, seq.binding, seq.buffers = [], [], 0, None, []
        seq.generation += 1
        for key in [k for k in self._batch_bindings if seq.serial in k[1]]:
            del self._batch_bindings[key]

    @staticmethod
    def rollback(seq: OrtSequence, length: int) -> None:
        seq.length = min(seq.length, length)

    def copy_prefix(self, src: OrtSequence, dst: OrtSequence, n: int) -> None:
        """`dst` (nothing cached) caches the first `n` tokens of `src`: their K/V rows
        copied. Exact: a row's K/V do not depend on the calls it was computed in (module
        doc), so the rows are what prefilling the same tokens in `dst` would write."""
        if dst.length or not 0 < n <= src.length:
            raise ValueError(f"copy_prefix: {n} rows of a sequence of {src.length} into one of {dst.length}")
        self._reserve(dst, n + MIN_ROWS)
        for store, source in ((dst.keys, src.keys), (dst.values, src.values)):
            for layer in range(self.num_layers):
                store[layer][:, :, :n] = source[layer][:, :, :n]
        dst.length = n

    def shrink(self, seq: OrtSequence) -> None:
        """Give back a kept sequence's spare K/V rows (reserved by doubling as it grew): the
        prefix cache only copies its cached rows from here on, so it holds those alone (and
        the few a call past them may write)."""
        rows = seq.length + MIN_ROWS
        if not seq.keys or rows >= seq.keys[0].shape[2]:
            return
        seq.binding, seq.buffers = None, []
        seq.generation += 1
        for store in (seq.keys, seq.values):
            for layer in range(len(store)):
                store[layer] = np.ascontiguousarray(store[layer][:, :, :rows])

    @staticmethod
    def kv_bytes(seq: OrtSequence) -> int:
        """The memory a sequence's K/V buffers hold."""
        return sum(a.nbytes for a in seq.keys) + sum(a.nbytes for a in seq.values)

    def forward_batch(self, rows: list[TargetRow], layer_ids: tuple[int, ...] = ()) -> TargetOutput:
        for i in layer_ids:
            if not 0 <= i < self.num_layers:
                raise DFlashError("incompatible_drafter", f"the drafter reads target layer {i}; the target has "
                                                          f"{self.num_layers}")
        logits, feats = [None] * len(rows), [None] * len(rows)
        group: list[int] = []  # rows that go in one call of a batch graph

        def flush():
            if len(group) == 1:
                self._alone(rows, group[0], layer_ids, logits, feats)
            elif group:
                self._together(rows, list(group), layer_ids, logits, feats)
            group.clear()

        for i, row in enumerate(rows):
            n = max(len(row.ids), MIN_ROWS)
            if not row.ids or len(row.ids) > MAX_ROWS:  # nothing to run, or a prompt in calls of its own
                self._alone(rows, i, layer_ids, logits, feats)
                continue
            if len(group) == self.max_batch or sum(max(len(rows[j].ids), MIN_ROWS) for j in group) + n > MAX_ROWS:
                flush()
            group.append(i)
        flush()
        return TargetOutput(logits, feats)

    # --- inside ------------------------------------------------------------------------------

    def _alone(self, rows, i, layer_ids, logits, feats) -> None:
        """Row i in calls of its own, of at most MAX_ROWS rows."""
        row = rows[i]
        lgs, fts = [], []
        for k in range(0, len(row.ids), MAX_ROWS):
            part = row.ids[k:k + MAX_ROWS]
            asked = max(0, row.logits - (len(row.ids) - k - len(part)))  # asked rows are the last ones
            lg, ft = self._call(TargetRow(row.seq, part, min(asked, len(part))), layer_ids)
            row.seq.length += len(part)
            lgs.append(lg)
            if ft is not None:
                fts.append(ft)
        logits[i] = torch.cat(lgs) if len(lgs) > 1 else lgs[0] if lgs else torch.empty(0, self.vocab_size)
        feats[i] = (torch.cat(fts) if fts else (torch.empty(0, len(layer_ids) * self.hidden_size)
                                                 if layer_ids else None))

    def _batch_session(self, k: int):
        if k not in self._batch_sessions:
            import onnxruntime as ort

            path = self.model_file.parent / batch_file(k)
            try:
                self._batch_sessions[k] = ort.InferenceSession(str(path), self._opts, providers=["CPUExecutionProvider"])
            except Exception as exc:  # onnxruntime raises its own exception types
                raise DFlashError("bad_target", f"ONNX Runtime cannot load {path} ({str(exc)[:200]})") from None
        return self._batch_sessions[k]

    def _together(self, rows, group: list[int], layer_ids, logits, feats) -> None:
        """The rows `group` of `rows` (at most max(BATCH_GRAPHS) sequences, at most MAX_ROWS
        rows in all) in one call of the smallest batch graph that holds them. Each sequence's
        attention sees at least MIN_ROWS rows (a lone row twice, as in `_call`); a spare place
        of the graph runs attention over one row (the call's first, as a 1-token prompt on a
        scratch buffer) whose output nothing reads."""
        k = min(b for b in BATCH_GRAPHS if b >= len(group))
        seqs = [rows[i].seq for i in group]
        sizes = [len(rows[i].ids) for i in group]
        attn = [max(n, MIN_ROWS) for n in sizes] + [1] * (k - len(group))  # attention rows per place
        for seq, S in zip(seqs, attn):
            self._reserve(seq, seq.length + S)
        starts, attn_starts = np.cumsum([0] + sizes), np.cumsum([0] + attn)
        ids = np.array([[t for i in group for t in rows[i].ids]], dtype=np.int64)
        attention_rows = np.concatenate([starts[j] + _attention_rows(n, attn[j]) for j, n in enumerate(sizes)]
                                        + [np.zeros(k - len(group), dtype=np.int64)])
        output_rows = np.concatenate([attn_starts[j] + np.arange(n, dtype=np.int64) for j, n in enumerate(sizes)])
        want = np.concatenate([np.arange(starts[j] + n - rows[i].logits, starts[j] + n, dtype=np.int64)
                               for j, (i, n) in enumerate(zip(group, sizes))])
        asked = len(want)
        if not asked:
            want = np.zeros(1, dtype=np.int64)
        out_logits = np.empty((len(want), self.vocab_size), dtype=np.float32)
        out_feats = [np.empty((1, ids.shape[1], self.hidden_size), dtype=np.float32) for _ in layer_ids]
        b = self._batch_binding(k, seqs, layer_ids)
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("attention_rows", attention_rows)
        b.bind_cpu_input("output_rows", output_rows)
        b.bind_cpu_input("row_counts", np.array(attn, dtype=np.int64))
        b.bind_cpu_input("logit_rows", want)
        for j in range(k):
            cached = seqs[j].length if j < len(seqs) else 0
            b.bind_cpu_input(f"seqlens_k.{j}", np.array([cached + attn[j] - 1], dtype=np.int32))
            b.bind_cpu_input(f"total_sequence_length.{j}", np.array(cached + attn[j], dtype=np.int32))
        for name, arr in zip(("logits", *(f"features.{i}" for i in layer_ids)), (out_logits, *out_feats)):
            b.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
        self._batch_session(k).run_with_iobinding(b)
        at_logit = 0
        for j, i in enumerate(group):
            row, at, n = rows[i], int(starts[j]), sizes[j]
            logits[i] = torch.from_numpy(out_logits[at_logit:at_logit + row.logits]) if row.logits and asked \
                else torch.empty(0, self.vocab_size)
            at_logit += row.logits
            feats[i] = (torch.from_numpy(np.concatenate([f[0, at:at + n] for f in out_feats], axis=-1))
                        if layer_ids else None)
            row.seq.length += n

    def _batch_binding(self, k: int, seqs: list[OrtSequence], layer_ids: tuple[int, ...]):
        """A binding of the k-sequence graph to these sequences' K/V buffers (and a scratch
        buffer in the spare places), kept while the buffers last (BINDINGS_KEPT of them,
        least recently used dropped); outputs as in `_binding`."""
        key = (k, tuple(s.serial for s in seqs), tuple(s.generation for s in seqs))
        entry = self._batch_bindings.pop(key, None)
        if entry is None:
            b = self._batch_session(k).io_binding()
            bound = []
            for j in range(k):
                values = self._values(seqs[j]) if j < len(seqs) else self._scratch()
                for (past, present, value) in values:
                    past, present = f"{past}.{j}", f"{present}.{j}"
                    b.bind_ortvalue_input(past, value)
                    bound.append((present, value))
            entry = [b, bound, None]
            while len(self._batch_bindings) >= BINDINGS_KEPT:
                del self._batch_bindings[next(iter(self._batch_bindings))]
        self._batch_bindings[key] = entry
        b, bound, layers = entry
        if layers != layer_ids:
            b.clear_binding_outputs()
            for present, value in bound:
                b.bind_ortvalue_output(present, value)
            entry[2] = layer_ids
        return b

    def _values(self, seq: OrtSequence) -> list:
        """(past name, present name, OrtValue) of each K/V buffer of `seq`, made once per buffer."""
        if not seq.buffers:
            seq.buffers = [(f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}", self._ortvalue(store[layer]))
                           for layer in range(self.num_layers)
                           for kind, store in (("key", seq.keys), ("value", seq.values))]
        return seq.buffers

    def _scratch(self) -> list:
        """K/V of one row for a spare place of a batch graph (written, never read)."""
        if self._scratch_values is None:
            buf = self._scratch_buf = np.zeros((1, self.kv_heads, 1, self.head_dim), dtype=np.float32)
            self._scratch_values = [(f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}", self._ortvalue(buf))
                                    for layer in range(self.num_layers) for kind in ("key", "value")]
        return self._scratch_values

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
        seq.binding, seq.buffers = None, []
        seq.generation += 1
        for store in (seq.keys, seq.values):
            for layer in range(self.num_layers):
                new = np.zeros(shape, dtype=np.float32)
                if layer < len(store):
                    new[:, :, :have] = store[layer]
                    store[layer] = new
                else:
                    store.append(new)

    def _call(self, row: TargetRow, layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One ONNX Runtime run: the row's ids after its cached tokens (attention sees at
        least MIN_ROWS rows, the weights at least `min_rows`: a lone row twice, the copy's
        K/V past the sequence's length, never read)."""
        seq, n = row.seq, len(row.ids)
        ids = row.ids + row.ids[-1:] * (self.min_rows - n)  # the rows through the weights
        S = max(len(ids), MIN_ROWS)
        total = seq.length + S
        self._reserve(seq, total)
        want = np.arange(n - row.logits, n, dtype=np.int64) if row.logits else np.zeros(1, dtype=np.int64)
        # Outputs land in arrays of ours (no copy, no wrapper per K/V buffer): logits of the
        # asked rows, each asked layer's residual stream of the call's rows.
        logits = np.empty((len(want), self.vocab_size), dtype=np.float32)
        feats = [np.empty((1, len(ids), self.hidden_size), dtype=np.float32) for _ in layer_ids]
        b = self._binding(seq, layer_ids)
        b.bind_cpu_input("input_ids", np.array([ids], dtype=np.int64))
        b.bind_cpu_input("attention_rows", _attention_rows(len(ids), S))
        b.bind_cpu_input("output_rows", np.arange(len(ids), dtype=np.int64))
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
            for past, _, value in self._values(seq):
                b.bind_ortvalue_input(past, value)
            seq.bound_layers = None
        if seq.bound_layers != layer_ids:
            b.clear_binding_outputs()
            for _, present, value in seq.buffers:
                b.bind_ortvalue_output(present, value)
            seq.bound_layers = layer_ids
        return b

    def close(self) -> None:
        self.session, self._batch_sessions, self._batch_bindings = None, {}, {}
