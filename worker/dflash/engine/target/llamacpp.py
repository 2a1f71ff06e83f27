"""A quantized CPU target backend: llama.cpp (through llama-cpp-python's ctypes binding).

The target runs as it ships (the embedded SmolLM2 is a Q4_1 GGUF) in ggml's CPU kernels, so
a decode step reads a quarter of the fp32 path's bytes. Everything the loop needs comes
from one llama.cpp context:
- several sequences in one forward: one `llama_batch` whose rows carry their sequence id
  and position; each sequence has a KV stream of its own;
- logits of the asked rows: the rows flagged in the batch, returned in batch order;
- the drafter's target features: llama.cpp's own DFlash support captures the *input* of a
  layer (`llama_set_embeddings_layer_inp` / `llama_get_embeddings_layer_inp`, a staging
  API with C++ linkage that llama-cpp-python does not bind, so it is bound here by its
  mangled name); the input of layer i + 1 is the output of layer i, which is what the
  drafter's layer id i means (Hugging Face's hidden_states[i + 1]). The last layer's output
  has no such input, so a drafter that reads it cannot run on this backend;
- rollback: `llama_memory_seq_rm` from the first rejected position;
- batch invariance: no call holds more rows than BATCH_TOKENS (below), under which every
  row's numbers are the same whatever shares the call.
The drafter borrows the embedding and the LM head as torch tensors: they are read from
the target's Hugging Face folder (the same values, dequantized), as is the tokenizer.

A different numeric path from the fp32 reference: greedy output is the *backend's* greedy
output (exactly, drafts, batching or not), which can differ from the fp32 path where two
logits are close.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash.chat import tokenizer_disagreement
from dflash.engine.target.hf_files import BorrowedHead, read_hf_side
from dflash.engine.target.protocol import TargetOutput, TargetRow
from dflash.errors import DFlashError

NAME = "llamacpp"
# Sequences with KV memory at once (the scheduler's batch; more wait for a free one) and the
# context of each: every sequence has a KV stream of its own (about 1.5 GB in all for
# SmolLM2-135M at these defaults), so what a row attends to is laid out the same whatever
# else is cached (see BATCH_TOKENS).
MAX_SEQUENCES = 16
DEFAULT_CONTEXT = 4096
# Tokens per llama_decode call; larger forwards are split into calls of at most this many.
# Below 64 rows in a call (llama.cpp of llama-cpp-python 0.3.36, CPU) every row's logits and
# features are bit-identical whatever else is in the call (1 row or 63, one sequence or
# several); from 64 rows on ggml takes another matmul kernel, which rounds differently.
# Calls of at most 63 keep the output
# independent of batching, drafting and chunking: greedy with drafts is exactly plain
# greedy, and a batched request gets what it would alone (tests/test_llamacpp_target.py
# checks it, so a llama.cpp that changes this is caught). The same holds for attention only
# when each sequence's cells are its own (non-unified KV): in one shared stream a sequence's
# cells interleave with the others' in an order that depends on arrival, and the sums over
# them round differently, enough to change greedy outputs under concurrent callers.
BATCH_TOKENS = 63
CONTEXT_BATCH = 512  # the context's n_batch / n_ubatch (llama.cpp wants at least 64)


def available() -> bool:
    """Whether llama-cpp-python (with the feature-capture symbols) can be imported here."""
    try:
        _binding()
    except (ImportError, OSError, AttributeError):
        return False
    return True


def system_info() -> str:
    """What llama.cpp says of its own build: the CPU features it was compiled for (AMX_INT8 = 1
    in a build that can fault here)."""
    C = _binding()[0]
    return C.llama_print_system_info().decode().strip()


_BOUND: dict = {}


def _binding():
    """(llama_cpp module, set_layer_inp, get_layer_inp), bound once."""
    if not _BOUND:
        from llama_cpp import llama_cpp as C

        lib = C._lib
        set_inp = lib._Z30llama_set_embeddings_layer_inpP13llama_contextjb
        set_inp.argtypes = [C.llama_context_p_ctypes, ctypes.c_uint32, ctypes.c_bool]
        set_inp.restype = None
        get_inp = lib._Z30llama_get_embeddings_layer_inpP13llama_contextj
        get_inp.argtypes = [C.llama_context_p_ctypes, ctypes.c_uint32]
        get_inp.restype = ctypes.POINTER(ctypes.c_float)
        quiet = C.llama_log_callback(lambda level, text, user: None)
        C.llama_log_set(quiet, None)
        C.llama_backend_init()
        _BOUND.update(C=C, set_inp=set_inp, get_inp=get_inp, quiet=quiet)  # keep the callback alive
    return _BOUND["C"], _BOUND["set_inp"], _BOUND["get_inp"]


@dataclass
class LlamaCppSequence:
    """One sequence: `length` tokens cached under llama.cpp sequence id `seq_id` (assigned at
    its first forward, so admitted requests that have not run yet hold no id)."""

    seq_id: int | None = None
    length: int = 0


class LlamaCppTarget(BorrowedHead):
    backend = NAME
    build = None  # the GGUF as it ships (Target protocol)
    min_rows = 1  # nothing padded (Target protocol)

    def __init__(self, gguf: str | Path, hf_dir: str | Path, threads: int | None = None,
                 max_sequences: int = MAX_SEQUENCES, context: int = DEFAULT_CONTEXT):
        C, self._set_inp, self._get_inp = _binding()
        self._C = C
        gguf, hf_dir = Path(gguf), Path(hf_dir)
        side = read_hf_side(hf_dir, "llama.cpp", gguf, "GGUF file", gguf=gguf)
        cfg = side.config
        mp = C.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = C.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise DFlashError("bad_target", f"llama.cpp cannot load {gguf} (not a GGUF it can run: a corrupt file or "
                                            "an unsupported architecture)")
        self.gguf, self.hf_dir = gguf, hf_dir
        self.name = hf_dir.name
        self.hidden_size = C.llama_model_n_embd(self.model)
        self.num_layers = C.llama_model_n_layer(self.model)
        self.vocab_size = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        if (self.hidden_size, self.num_layers) != (cfg.hidden_size, cfg.num_hidden_layers):
            self._free_model()
            raise DFlashError("bad_target", f"{gguf} ({self.num_layers} layers of {self.hidden_size}) is not the model "
                                            f"in {hf_dir} ({cfg.num_hidden_layers} of {cfg.hidden_size})")
        self.context_length = min(int(getattr(cfg, "max_position_embeddings", 2048)), context)
        self.kv_tokens = self.context_length * max_sequences
        cp = C.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = self.kv_tokens, CONTEXT_BATCH, CONTEXT_BATCH, max_sequences
        cp.n_threads = cp.n_threads_batch = threads or torch.get_num_threads()
        cp.kv_unified = False  # a KV stream per sequence (see BATCH_TOKENS)
        cp.no_perf = True
        self.ctx = C.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self._free_model()
            raise DFlashError("bad_target", f"llama.cpp cannot make a context for {gguf} ({self.kv_tokens} KV tokens)")
        self.mem = C.llama_get_memory(self.ctx)
        self.threads = cp.n_threads
        self.max_sequences = max_sequences  # the scheduler's batch is capped by it
        self._free_ids = list(range(max_sequences - 1, -1, -1))
        self._captured: set[int] = set()
        self.batch = C.llama_batch_init(BATCH_TOKENS, 0, 1)
        b = self.batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(BATCH_TOKENS,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(BATCH_TOKENS,))
        self._nsq = np.ctypeslib.as_array(b.n_seq_id, shape=(BATCH_TOKENS,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(BATCH_TOKENS,))
        self._sid = [b.seq_id[i] for i in range(BATCH_TOKENS)]

        self._side = side
        if tuple(side.embed_shape) != (self.vocab_size, self.hidden_size):
            raise DFlashError("bad_target", f"{hf_dir}'s embedding {tuple(side.embed_shape)} does not fit {gguf}")
        self.tokenizer, self.eos_ids = side.tokenizer, side.eos_ids
        differs = tokenizer_disagreement(self.tokenizer, self._llama_ids) if self.tokenizer is not None else None
        if differs is not None:
            self.close()
            raise DFlashError("bad_target", f"llama.cpp tokenises {gguf} otherwise than the tokenizer in {hf_dir} "
                                            f"does ({differs}): prompts would reach the model as ids it does not "
                                            "make of that text")
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # of what it returns (logits, features); the weights stay quantized

    # --- the Target protocol -------------------------------------------------------------

    def new_sequence(self) -> LlamaCppSequence:
        return LlamaCppSequence()

    def free(self, seq: LlamaCppSequence) -> None:
        if seq.seq_id is not None:
            self._C.llama_memory_seq_rm(self.mem, seq.seq_id, -1, -1)
            self._free_ids.append(seq.seq_id)
        seq.seq_id, seq.length = None, 0

    def rollback(self, seq: LlamaCppSequence, length: int) -> None:
        if seq.seq_id is not None and length < seq.length:
            if not self._C.llama_memory_seq_rm(self.mem, seq.seq_id, length, -1):
                raise RuntimeError(f"llama.cpp could not drop positions >= {length} of sequence {seq.seq_id}")
        seq.length = min(seq.length, length)

    def forward_batch(self, rows: list[TargetRow], layer_ids: tuple[int, ...] = ()) -> TargetOutput:
        self._capture(layer_ids)
        for row in rows:
            if row.seq.seq_id is None:
                if not self._free_ids:
                    raise DFlashError("busy", f"the llama.cpp backend holds at most {self.max_sequences} sequences "
                                              "at once")
                row.seq.seq_id = self._free_ids.pop()
        # Every token as (row, index in row); calls of at most BATCH_TOKENS tokens.
        tokens = [(r, j) for r, row in enumerate(rows) for j in range(len(row.ids))]
        logits: list[list[np.ndarray]] = [[] for _ in rows]
        feats: list[list[np.ndarray]] = [[] for _ in rows]
        for k in range(0, len(tokens), BATCH_TOKENS):
            self._decode(rows, tokens[k:k + BATCH_TOKENS], layer_ids, logits, feats)
        for row in rows:
            row.seq.length += len(row.ids)
        out_logits = [torch.from_numpy(np.concatenate(ls)) if ls else torch.empty(0, self.vocab_size) for ls in logits]
        out_feats = [torch.from_numpy(np.concatenate(fs)) if layer_ids else None for fs in feats]
        return TargetOutput(out_logits, out_feats)

    # --- inside ------------------------------------------------------------------------------

    def _capture(self, layer_ids: tuple[int, ...]) -> None:
        for i in layer_ids:
            if not 0 <= i < self.num_layers - 1:
                raise DFlashError("incompatible_drafter", f"the llama.cpp backend gives the features of target layers "
                                                          f"0 to {self.num_layers - 2}; the drafter reads layer {i}")
            if i not in self._captured:
                self._set_inp(self.ctx, i + 1, True)  # the input of layer i + 1 is layer i's output
                self._captured.add(i)

    def _decode(self, rows, part, layer_ids, logits, feats) -> None:
        n = len(part)
        want = np.zeros(n, dtype=bool)
        for k, (r, j) in enumerate(part):
            row = rows[r]
            self._tok[k] = row.ids[j]
            self._pos[k] = row.seq.length + j
            self._sid[k][0] = row.seq.seq_id
            want[k] = j >= len(row.ids) - row.logits
        self._nsq[:n] = 1
        self._out[:n] = want
        self.batch.n_tokens = n
        rc = self._C.llama_decode(self.ctx, self.batch)
        if rc == 1:
            raise DFlashError("busy", f"the llama.cpp backend's KV cache ({self.context_length} tokens per "
                                      "sequence) is full")
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = int(want.sum())
        if n_out:
            got = np.ctypeslib.as_array(self._C.llama_get_logits(self.ctx), shape=(n_out, self.vocab_size))
            rows_of = np.array([r for r, _ in part])[want]
            for r in np.unique(rows_of):
                logits[r].append(got[rows_of == r].copy())
        if layer_ids:
            hid = np.empty((n, len(layer_ids), self.hidden_size), dtype=np.float32)
            for li, i in enumerate(layer_ids):
                hid[:, li] = np.ctypeslib.as_array(self._get_inp(self.ctx, i + 1), shape=(n, self.hidden_size))
            hid = hid.reshape(n, -1)
            rows_all = np.array([r for r, _ in part])
            for r in np.unique(rows_all):
                feats[r].append(hid[rows_all == r])

    def _llama_ids(self, text: str) -> list[int]:
        """llama.cpp's ids of `text`: its special-token text parsed, nothing added."""
        raw = text.encode()
        room = len(raw) + 1  # a token is at least one byte
        ids = (self._C.llama_token * room)()
        n = self._C.llama_tokenize(self._C.llama_model_get_vocab(self.model), raw, len(raw), ids, room, False, True)
        return list(ids[:n])

    def _free_model(self) -> None:
        self._C.llama_model_free(self.model)
        self.model = None

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._C.llama_batch_free(self.batch)
            self._C.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self._free_model()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
