"""The drafter's training forward over many blocks, with attention that skips what is masked.

Training runs every anchor of a sequence at once. Written as one attention over
[context ; all blocks] with a dense mask (the engine drafter's `attn_mask` path), almost
all of it is masked out: each block sees only the context before its anchor and its own
L slots, yet the dense form scores every block against every other block, so its cost
grows with the square of the anchors. Here each block attends to exactly two parts,
scored separately and normalised together (one softmax over [context ; own block]):

- the context (shared by the sequence's blocks), masked by `position < anchor`;
- its own L slots, as a batched [L, L] product per block.

Sequences are batched with padding ([B, T, F] features, [B, A, L] blocks; padding
blocks have no labels, padding context rows lie past every anchor), so a GPU runs one
large forward of plain matmuls and a CPU runs the same code with B = 1. The weights are
the `DFlashDrafter`'s own modules; only the attention core differs from its forward, and
a test holds the two equal.
"""

from __future__ import annotations

import torch

from dflash.engine.drafter import DFlashDrafter, rotate_half


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def forward_blocks(drafter: DFlashDrafter, feats: torch.Tensor, block_embeds: torch.Tensor,
                   anchors: torch.Tensor) -> torch.Tensor:
    """feats [B, T, n_feat*H] (context rows at positions 0..T-1), block_embeds [B, A, L, H],
    anchors [B, A] (block a of sequence b sits at anchors[b, a] + 0..L-1 and sees context
    rows < anchors[b, a]). Returns the final-normed block states [B, A, L, H]."""
    cfg = drafter.config
    B, A, L, H = block_embeds.shape
    nH, nKV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = nH // nKV
    # Only context rows some anchor can see matter.
    T = min(feats.shape[1], int(anchors.max()) if anchors.numel() else 0)
    T = max(T, 1)
    feats = feats[:, :T]
    ctx = drafter.hidden_norm(drafter.fc(feats))  # [B, T, H]
    dtype = block_embeds.dtype
    ctx_pos = torch.arange(T, device=feats.device)
    cos_c, sin_c = drafter.rotary(ctx_pos, dtype)  # [T, d]
    blk_pos = anchors[:, :, None] + torch.arange(L, device=anchors.device)
    cos_b, sin_b = drafter.rotary(blk_pos.reshape(-1), dtype)
    cos_b, sin_b = cos_b.view(B, A, L, 1, d), sin_b.view(B, A, L, 1, d)
    cos_c, sin_c = cos_c.view(1, T, 1, d), sin_c.view(1, T, 1, d)
    hidden_ctx = ctx_pos[None, None, :] >= anchors[:, :, None]  # [B, A, T]
    scale = d**-0.5
    h = block_embeds
    for layer in drafter.layers:
        attn = layer.self_attn
        a = layer.input_layernorm(h)
        q = _rope(attn.q_norm(attn.q_proj(a).view(B, A, L, nH, d)), cos_b, sin_b)
        kb = _rope(attn.k_norm(attn.k_proj(a).view(B, A, L, nKV, d)), cos_b, sin_b)
        vb = attn.v_proj(a).view(B, A, L, nKV, d)
        kc = _rope(attn.k_norm(attn.k_proj(ctx).view(B, T, nKV, d)), cos_c, sin_c)
        vc = attn.v_proj(ctx).view(B, T, nKV, d)
        # Query head j*g + i uses K/V head j (grouped-query attention, as SDPA's enable_gqa).
        q = q.view(B, A, L, nKV, g, d).permute(0, 3, 1, 4, 2, 5).reshape(B, nKV, A, g * L, d)
        kb, vb = kb.permute(0, 3, 1, 2, 4), vb.permute(0, 3, 1, 2, 4)  # [B, nKV, A, L, d]
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, nKV, T, d]
        s_ctx = (q.reshape(B, nKV, A * g * L, d) @ kc.transpose(-1, -2)).view(B, nKV, A, g * L, T) * scale
        s_ctx = s_ctx.masked_fill(hidden_ctx[:, None, :, None, :], float("-inf"))
        s_blk = (q @ kb.transpose(-1, -2)) * scale  # [B, nKV, A, gL, L]
        p = torch.softmax(torch.cat((s_ctx, s_blk), dim=-1).float(), dim=-1)
        p_ctx, p_blk = p[..., :T].to(vc.dtype), p[..., T:].to(vb.dtype)
        out = (p_ctx.reshape(B, nKV, A * g * L, T) @ vc).view(B, nKV, A, g * L, d) + p_blk @ vb
        out = out.view(B, nKV, A, g, L, d).permute(0, 2, 4, 1, 3, 5).reshape(B, A, L, nH * d)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)
