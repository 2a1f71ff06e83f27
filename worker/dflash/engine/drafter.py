"""The DFlash draft model: a few Qwen3-style layers that draft a whole block in one pass.

Clean-room from the published description (see shared/reference/dflash-spec.md):
target features of the committed context are projected once (`fc`, `hidden_norm`)
and injected as extra keys/values in every layer; the block `[anchor, MASK...]`
attends bidirectionally to itself and to all committed context. The drafter has
no embedding or LM head: it borrows the target's.

The drafter's KV cache only ever holds committed context. Context K/V are
appended when their features arrive; block K/V live for one forward. That is the
reference's "write everything, then crop to start" without the crop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dflash.engine.drafter_config import DrafterConfig
from dflash.errors import DFlashError


class RMSNorm(nn.Module):
    """HF Qwen3 numerics: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class DraftCache:
    """Per-layer K/V of the committed context (post k_norm and RoPE), in buffers that grow
    by doubling, so a step copies nothing but its own new rows.

    Rows [0, length) are committed context. A forward writes its new context rows at
    `length` and the block's rows right after them, attends over the buffer's prefix, and
    then advances `length` past the context rows only: the block rows are scratch that the
    next forward overwrites (the reference's "write everything, then crop to start")."""

    def __init__(self, num_layers: int, capacity: int = 256):
        self.num_layers = num_layers
        self.keys: torch.Tensor | None = None  # [layers, B, n_kv, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.capacity = capacity
        self.length = 0

    def _reserve(self, k: torch.Tensor, rows: int) -> None:
        if self.keys is not None and rows <= self.keys.shape[3]:
            return
        cap = max(self.capacity, 1)
        while cap < rows:
            cap *= 2
        b, n_kv, _, hd = k.shape
        keys = k.new_empty(self.num_layers, b, n_kv, cap, hd)
        values = k.new_empty(self.num_layers, b, n_kv, cap, hd)
        if self.keys is not None and self.length:
            keys[:, :, :, : self.length] = self.keys[:, :, :, : self.length]
            values[:, :, :, : self.length] = self.values[:, :, :, : self.length]
        self.keys, self.values, self.capacity = keys, values, cap

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k`/`v` [B, n_kv, S + L, hd] after the committed rows; return the layer's
        K/V over committed context + these rows (views, no copy)."""
        end = self.length + k.shape[2]
        self._reserve(k, end)
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer: int):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.layer = layer
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def project(self, x, kv_in, cos_q, sin_q, cos_k, sin_k):
        """Queries of the block rows x, keys and values of kv_in (context then block rows),
        normed and rotated."""
        q = self.q_norm(self._heads(self.q_proj(x), self.n_heads))
        k = self.k_norm(self._heads(self.k_proj(kv_in), self.n_kv))
        v = self._heads(self.v_proj(kv_in), self.n_kv)
        return q * cos_q + rotate_half(q) * sin_q, k * cos_k + rotate_half(k) * sin_k, v

    def window_mask(self, positions: torch.Tensor, L: int, kv_len: int) -> torch.Tensor | None:
        """Sliding layers are causal with an absolute-position window (later z-lab drafters)."""
        if self.window is None:
            return None
        q_pos = positions[-L:][:, None]
        k_pos = torch.arange(kv_len, device=positions.device)[None, :] + (positions[-1] + 1 - kv_len)
        return (k_pos <= q_pos) & (q_pos - k_pos < self.window)

    def forward(self, x, ctx, cos, sin, cache: DraftCache | None, positions: torch.Tensor, attn_mask=None):
        """x: normed block [B, L, H]; ctx: projected new context [B, S, H];
        cos/sin: rows for the S + L positions; attn_mask (training only): [L, S + L] bool."""
        L, S = x.shape[1], ctx.shape[1]
        q, k, v = self.project(x, torch.cat((ctx, x), dim=1), cos[S:], sin[S:], cos, sin)
        if cache is not None:
            # Context K/V are committed and kept; block K/V are scratch for this pass only.
            k, v = cache.write(self.layer, k, v)
        mask = attn_mask
        if self.window is not None:
            if attn_mask is not None:
                raise DFlashError("bad_drafter", "training sliding-window drafters is not supported")
            mask = self.window_mask(positions, L, k.shape[2])
        gqa = self.n_heads != self.n_kv
        if gqa and attn_mask is not None and q.is_cuda:
            # Training on a GPU: with a dense mask, only the memory-efficient kernel avoids
            # materialising [heads, Q, K] scores, and it takes no grouped K/V: expand them.
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            gqa = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=False, scale=self.head_dim**-0.5, enable_gqa=gqa
        )
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], L, -1))

    def forward_packed(self, x, kv_in, rope: "PackedRope", parts: list["DraftPart"]):
        """x: normed block rows of every part [1, sum L, H]; kv_in: each part's context rows
        then its block rows [1, sum (S + L), H]. Each part attends to its own cache."""
        q, k, v = self.project(x, kv_in, *rope.q, *rope.k)
        outs = []
        for p in parts:
            kk, vv = p.cache.write(self.layer, k[:, :, p.kv_at : p.kv_at + p.S + p.L], v[:, :, p.kv_at : p.kv_at + p.S + p.L])
            mask = self.window_mask(p.positions, p.L, kk.shape[2])
            outs.append(F.scaled_dot_product_attention(q[:, :, p.q_at : p.q_at + p.L], kk, vv, attn_mask=mask,
                                                       scale=self.head_dim**-0.5, enable_gqa=self.n_heads != self.n_kv))
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        return self.o_proj(out.transpose(1, 2).reshape(1, x.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, cache, positions, attn_mask=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, cache, positions, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_packed(self, h, ctx, rope: "PackedRope", parts: list["DraftPart"], kv_order: torch.Tensor):
        a = self.input_layernorm(h)
        h = h + self.self_attn.forward_packed(a, torch.cat((ctx, a), dim=1)[:, kv_order], rope, parts)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def new_cache(self) -> DraftCache:
        return DraftCache(self.config.num_hidden_layers)

    def forward(
        self,
        context_features: torch.Tensor,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """context_features [B, S, n_feat*H] for the newly committed tokens;
        block_embeds [B, L, H] (target embeddings of anchor + masks);
        positions [S + L] absolute positions of those context rows then the block.
        Training packs many blocks into L and passes `attn_mask` [L, S + L] (True = visible).
        Returns the final-normed hidden states of the block [B, L, H]."""
        ctx = self.hidden_norm(self.fc(context_features))
        cos, sin = self.rotary(positions, block_embeds.dtype)
        h = block_embeds
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, cache, positions, attn_mask)
        if cache is not None:
            cache.length += context_features.shape[1]
        return self.norm(h)

    def forward_packed(self, parts: list["DraftPart"]) -> torch.Tensor:
        """Several requests' drafts in one pass: every projection and MLP runs once over all
        parts' rows, attention per part over its own cache. Each part brings its new context
        features [S, n_feat*H], its block embeddings [L, H] and positions [S + L]; returns
        the final-normed block states of all parts, laid end to end [sum L, H]."""
        device = parts[0].block.device
        ctx = self.hidden_norm(self.fc(torch.cat([p.context for p in parts])[None]))
        h = torch.cat([p.block for p in parts])[None]
        # kv rows in part order (context rows, then block rows), indexed into cat(ctx, block).
        order, q_rows, at_ctx, at_q, at_kv = [], [], 0, 0, 0
        n_ctx = ctx.shape[1]
        for p in parts:
            p.q_at, p.kv_at = at_q, at_kv
            order += range(at_ctx, at_ctx + p.S)
            order += range(n_ctx + at_q, n_ctx + at_q + p.L)
            q_rows += range(at_kv + p.S, at_kv + p.S + p.L)
            at_ctx, at_q, at_kv = at_ctx + p.S, at_q + p.L, at_kv + p.S + p.L
        cos, sin = self.rotary(torch.cat([p.positions for p in parts]), h.dtype)
        q_idx = torch.tensor(q_rows, device=device)
        rope = PackedRope((cos[q_idx], sin[q_idx]), (cos, sin))
        kv_order = torch.tensor(order, device=device)
        for layer in self.layers:
            h = layer.forward_packed(h, ctx, rope, parts, kv_order)
        for p in parts:
            p.cache.length += p.S
        return self.norm(h)[0]


@dataclass
class DraftPart:
    """One request's share of a packed drafter pass (see DFlashDrafter.forward_packed)."""

    context: torch.Tensor  # [S, n_feat * H] new context features
    block: torch.Tensor  # [L, H] embeddings of anchor + masks
    positions: torch.Tensor  # [S + L]
    cache: DraftCache
    q_at: int = 0  # where its rows start among the packed block rows / kv rows
    kv_at: int = 0

    @property
    def S(self) -> int:
        return self.context.shape[0]

    @property
    def L(self) -> int:
        return self.block.shape[0]


@dataclass
class PackedRope:
    q: tuple[torch.Tensor, torch.Tensor]  # cos, sin of the block rows
    k: tuple[torch.Tensor, torch.Tensor]  # cos, sin of all kv rows


# --- checkpoint I/O in the published layout ----------------------------------------


def _state_key(name: str) -> str | None:
    """Our parameter names equal the published tensor names; buffers are not stored."""
    return None if name.startswith("rotary.") else name


def read_drafter_folder(path: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The published folder's config and its tensors as stored (bf16 for published drafters)."""
    if not path.is_dir():
        raise DFlashError("bad_drafter", f"drafter directory not found: {path}")
    cfg = DrafterConfig.from_file(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError("bad_drafter", f"no .safetensors file in drafter directory {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise DFlashError("bad_drafter", f"drafter weights {f} are missing or corrupt: {exc}") from None
    return cfg, state


def drafter_from_state(cfg: DrafterConfig, state: dict[str, torch.Tensor]) -> DFlashDrafter:
    check_state(cfg, state)
    model = DFlashDrafter(cfg)
    model.load_state_dict(state, strict=False)
    return model


def check_state(cfg: DrafterConfig, state: dict[str, torch.Tensor]) -> None:
    """The tensors must be exactly those the config implies, with their shapes (checked on
    the meta device: no weights are allocated)."""
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    expected = {k: p for k, p in model.state_dict().items() if _state_key(k)}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DFlashError(
            "bad_drafter",
            f"drafter weights do not fit its config: missing {missing[:5]}, unexpected {unexpected[:5]}",
        )
    for k, t in state.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise DFlashError(
                "bad_drafter", f"drafter tensor {k} has shape {tuple(t.shape)}, config implies {tuple(expected[k].shape)}"
            )


def save_drafter(model: DFlashDrafter, path: str | Path, extra_config: dict | None = None) -> None:
    """Write config.json + bf16 model.safetensors (unprefixed names), as published."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.update(extra_config or {})
    state = {
        k: t.detach().to("cpu", torch.bfloat16).contiguous()
        for k, t in model.state_dict().items()
        if _state_key(k)
    }
    tmp = path / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def init_random_drafter(cfg: DrafterConfig, seed: int = 0, std: float = 0.02) -> DFlashDrafter:
    gen = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return model
