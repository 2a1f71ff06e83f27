"""The training loop: AdamW, cosine schedule with warm-up, gradient clipping, resumable
checkpoints every few minutes, a progress bar with loss, rate and ETA, a loss curve PNG.

Only the drafter's own parameters train; the target's embedding and LM head are frozen
and borrowed. Features come from the on-disk cache, so the target never runs here.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash.engine.drafter import DFlashDrafter, save_drafter
from dflash.train.features import FeatureCache
from dflash.train.objective import build_blocks, cosine_lr, default_gamma, pack_blocks, sample_anchors, weighted_loss


@dataclass
class TrainConfig:
    epochs: int = 6
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_anchors: int = 32
    seqs_per_step: int = 4
    gamma: float | None = None
    time_budget_s: float | None = None
    checkpoint_minutes: float = 5.0
    reduced_vocab: bool = True
    schedule_by_time: bool = False  # with a time budget: the cosine schedule ends when the budget does
    pack: int = 1  # sequences per forward: 1 on CPU (dense masks grow quadratically), many on a GPU
    snapshot_dir: str | None = None  # also write a loadable drafter here at every checkpoint
    seed: int = 0


def vocab_subset(cache: FeatureCache, vocab_size: int) -> torch.Tensor:
    """Every token id seen in the training sequences (sorted): the loss's softmax support."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for s in cache.sequences:
        seen[torch.tensor(s["ids"])] = True
    return seen.nonzero()[:, 0]


def schedule_step(step: int, total: int, elapsed_s: float, time_budget_s: float | None) -> int:
    """Where the LR schedule stands: by steps, or, for a run bounded by a time budget rather
    than epochs, by the share of the budget spent (whichever is further along)."""
    if time_budget_s:
        return max(step, int(total * elapsed_s / time_budget_s))
    return step


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(drafter: DFlashDrafter, target, cache: FeatureCache, out: Path, cfg: TrainConfig,
          resume: bool = True) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    dcfg = drafter.config
    L, gamma = dcfg.block_size, cfg.gamma or default_gamma(dcfg.block_size)
    seqs = cache.sequences
    steps_per_epoch = max(1, len(seqs) // cfg.seqs_per_step)
    total = steps_per_epoch * cfg.epochs
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    head = target.lm_head.weight.detach()
    embed = target.embed_tokens.weight.detach()
    dev = head.device
    drafter.to(dev)
    vocab = vocab_subset(cache, head.shape[0]).to(dev) if cfg.reduced_vocab else None
    remap = None
    if vocab is not None:
        remap = torch.full((head.shape[0],), -100, dtype=torch.long, device=dev)
        remap[vocab] = torch.arange(len(vocab), device=dev)

    state = {"step": 0, "losses": [], "elapsed_s": 0.0}
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]

    def save_checkpoint():
        torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "state": state,
                    "config": asdict(cfg)}, out / "checkpoint.pt.tmp")
        (out / "checkpoint.pt.tmp").replace(ckpt)
        if cfg.snapshot_dir:
            save_drafter(drafter, cfg.snapshot_dir)

    drafter.train()
    start = time.monotonic() - state["elapsed_s"]
    last_ckpt = time.monotonic()
    bar = tqdm(total=total, initial=state["step"], desc="training drafter", unit="step")
    while state["step"] < total:
        step = state["step"]
        epoch, i = divmod(step, steps_per_epoch)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)  # fresh anchors every epoch
        order = torch.randperm(len(seqs), generator=gen)
        batch = order[i * cfg.seqs_per_step : (i + 1) * cfg.seqs_per_step].tolist()
        by_time = cfg.time_budget_s if cfg.schedule_by_time else None
        lr = cosine_lr(schedule_step(step, total, time.monotonic() - start, by_time), total, cfg.lr,
                       max(1, int(cfg.warmup_ratio * total)))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss_sum, n = 0.0, 0
        packs = [batch[k : k + max(1, cfg.pack)] for k in range(0, len(batch), max(1, cfg.pack))]
        for pack in packs:
            parts = []
            for j in pack:
                seq = seqs[j]
                ids = torch.tensor(seq["ids"])
                anchor_gen = torch.Generator().manual_seed(cfg.seed + 7919 * step + j)
                anchors = sample_anchors(len(ids), seq["response_start"], L, cfg.num_anchors, anchor_gen)
                if len(anchors):
                    parts.append((seq, build_blocks(ids, anchors, L, dcfg.mask_token_id, gamma)))
            if not parts:
                continue
            b = (pack_blocks([p for _, p in parts]) if len(parts) > 1 else parts[0][1]).to(dev)
            feats = torch.cat([cache.features(seq, torch.bfloat16) for seq, _ in parts]).to(dev).float()
            with autocast(dev):
                hidden = drafter(feats[None], embed[b.block_ids][None], b.positions, attn_mask=b.attn_mask)[0]
                labels = remap[b.labels.clamp_min(0)].masked_fill(b.labels < 0, -100) if remap is not None else b.labels
                loss = weighted_loss(hidden, head, labels, b.weights, vocab) * len(parts) / len(batch)
            loss.backward()
            loss_sum += loss.item() * len(batch)
            n += len(parts)
            state["sequences"] = state.get("sequences", 0) + len(parts)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        state["step"] += 1
        state["elapsed_s"] = time.monotonic() - start
        if n:
            state["losses"].append((state["step"], state["elapsed_s"], loss_sum / n))
            bar.set_postfix(loss=f"{loss_sum / n:.3f}", lr=f"{lr:.1e}")
        bar.update()
        if time.monotonic() - last_ckpt > cfg.checkpoint_minutes * 60:
            save_checkpoint()
            last_ckpt = time.monotonic()
        if cfg.time_budget_s and state["elapsed_s"] > cfg.time_budget_s:
            break
    bar.close()
    drafter.eval()
    save_checkpoint()
    save_drafter(drafter, out / "drafter")
    (out / "losses.json").write_text(json.dumps(state["losses"]))
    plot_losses(state["losses"], out / "loss.png")
    return state


def plot_losses(losses: list, path: Path) -> None:
    if not losses:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, secs, vals = zip(*losses)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, vals, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("weighted CE")
    ax.set_title(f"drafter training loss ({secs[-1] / 60:.1f} min)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
