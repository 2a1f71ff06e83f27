"""The reference target backend: a Hugging Face causal LM run by transformers (CPU or CUDA).

Batched forwards are *packed*: the rows of every sequence in the step are laid end to end
in one [1, N] input with their own positions, so a 1-token verify row and a 128-token
prefill chunk share the forward without padding, and every weight is read once for all of
them. Attention is the only part that must know where one sequence ends: the backend
registers an attention function with transformers (`AttentionInterface`) that, per layer,
writes each row's new K/V into that sequence's own buffers and attends each row to its own
sequence (scaled_dot_product_attention on views, so nothing is gathered or copied). Each
sequence's KV lives in per-layer buffers that grow by doubling; a rollback only moves its
length back. The same model also serves the single-sequence `forward(ids, cache, ...)`
with an ordinary DynamicCache (training, feature extraction), through transformers' own
SDPA path, unchanged.

Written for transformers 5.x.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import Cache

from dflash.engine.target.protocol import TargetDefaults, TargetOutput, TargetRow
from dflash.errors import DFlashError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma3", "smollm3")
PACKED = "dflash_packed"
INITIAL_CAPACITY = 256


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass
class HFSequence:
    """One sequence's K/V: per layer [n_kv, capacity, head_dim] buffers, `length` rows valid."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)
    length: int = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: int) -> None:
        """Store k/v [n_kv, T, hd] at rows [at, at + T), growing the layer's buffers by doubling."""
        end = at + k.shape[1]
        buf = self.keys[layer]
        if buf is None or end > buf.shape[1]:
            cap = buf.shape[1] if buf is not None else INITIAL_CAPACITY
            while cap < end:
                cap *= 2
            for store in (self.keys, self.values):
                old = store[layer]
                new = k.new_empty(k.shape[0], cap, k.shape[2])
                if old is not None and at:
                    new[:, :at] = old[:, :at]
                store[layer] = new
        self.keys[layer][:, at:end] = k
        self.values[layer][:, at:end] = v


@dataclass
class _Part:
    seq: HFSequence
    at: int  # cached rows before this forward
    start: int  # first row in the packed input
    n: int  # rows in the packed input
    mask: torch.Tensor | None  # [n, at + n] causal mask (None for one row)


class _Plan(Cache):
    """The packed forward's 'cache' as transformers sees it: `update` writes each part's new
    K/V into its sequence and hands the layer's parts to the attention function."""

    def __init__(self, parts: list[_Part]):
        self.parts = parts
        self.layers = []
        self.layer = -1

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        for p in self.parts:
            p.seq.write(layer_idx, key_states[0, :, p.start : p.start + p.n], value_states[0, :, p.start : p.start + p.n],
                        p.at)
        self.layer = layer_idx
        _active.plan = self
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, *args, **kwargs):
        return 0, 0

    def get_query_offset(self, *args, **kwargs):
        return 0


_active = threading.local()


def _window_mask(p: _Part, window: int, device) -> torch.Tensor:
    q = torch.arange(p.at, p.at + p.n, device=device)[:, None]
    k = torch.arange(p.at + p.n, device=device)[None, :]
    return (k <= q) & (q - k < window)


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of each packed part to its own sequence's cached K/V (see the module doc)."""
    plan: _Plan = _active.plan
    layer, groups = plan.layer, query.shape[1] // key.shape[1]
    window = kwargs.get("sliding_window")
    outs = []
    for p in plan.parts:
        k = p.seq.keys[layer][None, :, : p.at + p.n]
        v = p.seq.values[layer][None, :, : p.at + p.n]
        q = query[:, :, p.start : p.start + p.n]
        mask = p.mask
        if window is not None and p.at + p.n > window:
            mask = _window_mask(p, window, q.device)
        if p.n == 1 and mask is None and groups > 1:
            # One query row: fold the heads that share a K/V head into the query length
            # (no K/V repeat), as transformers' SDPA path does for decoding.
            n_kv, hd = k.shape[1], k.shape[3]
            o = F.scaled_dot_product_attention(q.reshape(1, n_kv, groups, hd), k, v, scale=scaling)
            outs.append(o.reshape(1, n_kv * groups, 1, hd))
        else:
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED, packed_attention)


class HFTarget(TargetDefaults):
    backend = "hf"

    def __init__(self, model, tokenizer=None, name: str = "target"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        cfg = _text_config(model.config)
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_length = int(getattr(cfg, "max_position_embeddings", 2048))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        eos = getattr(model.generation_config, "eos_token_id", None) or getattr(cfg, "eos_token_id", None)
        self.eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or []))

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype=torch.float32) -> "HFTarget":
        path = Path(path)
        if not (path / "config.json").is_file():
            raise DFlashError("bad_target", f"target directory {path} has no config.json")
        config = AutoConfig.from_pretrained(path)
        if config.model_type not in SUPPORTED_FAMILIES:
            raise DFlashError(
                "bad_target",
                f"target family '{config.model_type}' is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})",
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        except (OSError, ValueError, RuntimeError) as exc:
            raise DFlashError("bad_target", f"cannot load target from {path}: {exc}") from None
        tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
        return cls(model.to(device), tokenizer, name=path.name)

    # --- the Target protocol: sequences and batched forwards --------------------------------

    def new_sequence(self) -> HFSequence:
        return HFSequence([None] * self.num_layers, [None] * self.num_layers)

    def free(self, seq: HFSequence) -> None:
        """Drop its K/V (the handle stays usable: an empty sequence again)."""
        seq.keys, seq.values, seq.length = [None] * self.num_layers, [None] * self.num_layers, 0

    @staticmethod
    def rollback(seq: HFSequence, length: int) -> None:
        seq.length = min(seq.length, length)

    @torch.inference_mode()
    def forward_batch(self, rows: list[TargetRow], layer_ids: tuple[int, ...] = ()) -> TargetOutput:
        device = self.device
        parts, ids, positions, keep = [], [], [], []
        start = 0
        for row in rows:
            n, at = len(row.ids), row.seq.length
            mask = torch.ones(n, at + n, dtype=torch.bool, device=device).tril(at) if n > 1 else None
            parts.append(_Part(row.seq, at, start, n, mask))
            ids += row.ids
            positions += range(at, at + n)
            keep += range(start + n - row.logits, start + n)
            start += n
        configs = {id(c): c for c in (self.model.config, self.config)}.values()
        before = [c._attn_implementation for c in configs]
        for c in configs:
            c._attn_implementation = PACKED
        try:
            out = self.model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                cache=_Plan(parts),
                use_cache=True,
                output_hidden_states=[i + 1 for i in layer_ids] if layer_ids else False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
            )
        finally:
            for c, impl in zip(configs, before):
                c._attn_implementation = impl
            _active.plan = None
        for p in parts:
            p.seq.length = p.at + p.n
        logits = out.logits[0].float()
        out_logits, out_feats, k = [], [], 0
        feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1) if layer_ids else None
        for row, p in zip(rows, parts):
            out_logits.append(logits[k : k + row.logits])
            k += row.logits
            out_feats.append(feats[p.start : p.start + p.n] if feats is not None else None)
        return TargetOutput(out_logits, out_feats)

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight.detach()

    # --- one sequence with an ordinary transformers cache (training, features, baselines) ---

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @staticmethod
    def crop(cache, length: int) -> None:
        """Drop K/V of positions >= length from a DynamicCache."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache, layer_ids: tuple[int, ...] | list[int] = (), last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` [T] after the prefix held in `cache` (which grows by T). Returns logits
        [T or 1, V] (fp32) and the concatenated features of `layer_ids` [T, n_feat * H]
        (None when no layers are asked for). Only the asked-for hidden states are kept:
        transformers takes a list of indices for `output_hidden_states` and stores None
        for the rest."""
        out = self.model(
            input_ids=ids[None],
            cache=cache,
            use_cache=True,
            output_hidden_states=[i + 1 for i in layer_ids] if layer_ids else False,
            logits_to_keep=1 if last_only else 0,
        )
        feats = None
        if layer_ids:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)
        return out.logits[0].float(), feats
