"""The training loop: AdamW, warm-up then cosine or constant LR, gradient clipping,
resumable checkpoints, a periodic τ estimate on held-out answers that keeps the best
drafter, a progress bar with loss, and a loss curve PNG.

Only the drafter's own parameters train; the target's embedding and LM head are frozen
and borrowed. Features come from a feature store (disk or device), so the target never
runs here. A step takes `seqs_per_step` sequences with every anchor (up to
`max_anchors`), run in micro-batches of at most `block_tokens` block slots through the
block-sparse forward (blockwise.py); the LM head runs only at slots with a loss weight.

Compute is booked per device (`state["compute_s"]`), and a drafter written here carries
its lineage (`training.json`: every stage's device, seconds, sequences, blocks and τ
estimates), so a drafter continued in a later stage, on another machine, still knows
what it cost: that is the model card's τ-against-compute table.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash.engine.drafter import DFlashDrafter, save_drafter
from dflash.errors import DFlashError
from dflash.plots import pyplot
from dflash.train.blockwise import forward_blocks
from dflash.train.objective import (WEIGHTINGS, build_blocks, cosine_lr, dpace_weights, sample_anchors, slot_weights,
                                    token_losses)

LINEAGE_FILE = "training.json"


@dataclass
class TrainConfig:
    epochs: int = 6
    lr: float = 6e-4
    schedule: str = "cosine"  # or "constant": warm-up, then flat (open-ended runs in stages)
    warmup_ratio: float = 0.04
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_anchors: int = 512  # anchors per sequence: every response position, up to this many
    seqs_per_step: int = 4
    block_tokens: int = 8192  # block slots per forward (sequences are batched up to this)
    weighting: str = "decay"  # decay | dpace | uniform (objective.py)
    gamma: float | None = None
    dpace_alpha: float = 0.5
    loss_positions: int | None = None  # only block slots 1..n carry loss (and run the LM head)
    # Block length trained (default: the drafter's): each anchor's block is this many slots,
    # so a shorter one runs fewer drafter rows per anchor; the drafter still serves its own.
    train_block: int | None = None
    soft_mix: float = 0.0  # share of the KL-to-target-top-k term (needs a store with top-k)
    autocast: bool = True  # bf16 matmuls over fp32 weights (CUDA; CPUs with AMX/AVX512-BF16)
    head_chunk_rows: int | None = None  # LM head in chunks, recomputed in backward (big GPU batches)
    time_budget_s: float | None = None  # this call's training time (a resumed run gets it again)
    cpu_budget_s: float | None = None  # this call's process CPU time (fair budgets on a shared machine)
    schedule_by_budget: bool = False  # with a time or CPU budget: the cosine schedule ends when the budget does
    checkpoint_minutes: float = 5.0
    eval_minutes: float | None = None  # τ estimate on held-out answers this often (keeps best/)
    eval_max_new_tokens: int = 128
    snapshot_dir: str | None = None  # also write a loadable drafter here at every checkpoint
    seed: int = 0
    stage: str = ""  # a label for the lineage (what this stage changed)


def autocast(device: torch.device, enabled: bool = True):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def schedule_step(step: int, total: int, budget_share: float | None) -> int:
    """Where the LR schedule stands: by steps, or, for a run bounded by a budget (wall-clock
    or CPU time) rather than epochs, by the share of the budget spent (whichever is further)."""
    if budget_share is not None:
        return max(step, int(total * budget_share))
    return step


def _budget_shares(cfg: "TrainConfig", elapsed_s: float, cpu_s: float) -> list[float]:
    shares = [elapsed_s / cfg.time_budget_s] if cfg.time_budget_s else []
    return shares + ([cpu_s / cfg.cpu_budget_s] if cfg.cpu_budget_s else [])


def budget_share(cfg: "TrainConfig", elapsed_s: float, cpu_s: float) -> float | None:
    """How much of the run's budget is spent (the larger share of wall and CPU budget; the time
    and CPU time of every call on the run, so a resumed run continues its schedule);
    None when the schedule does not follow a budget."""
    if not cfg.schedule_by_budget:
        return None
    shares = _budget_shares(cfg, elapsed_s, cpu_s)
    return max(shares) if shares else None


def budget_spent(cfg: "TrainConfig", elapsed_s: float, cpu_s: float) -> bool:
    """Whether the run has used up its time or CPU budget: running it again does not train
    further (a larger budget does)."""
    return any(share >= 1.0 for share in _budget_shares(cfg, elapsed_s, cpu_s))


def training_block(cfg: "TrainConfig", dcfg) -> int:
    """The block length a run trains at: `cfg.train_block`, at most the drafter's own."""
    L = cfg.train_block or dcfg.block_size
    if not 2 <= L <= dcfg.block_size:
        raise DFlashError("bad_params",
                          f"train_block must be between 2 and the drafter's block size {dcfg.block_size}, got {L}")
    return L


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads, {platform.machine()})"


def read_lineage(drafter_dir: Path | None) -> list[dict]:
    f = Path(drafter_dir) / LINEAGE_FILE if drafter_dir else None
    return json.loads(f.read_text()) if f and f.is_file() else []


def save_with_lineage(drafter: DFlashDrafter, path: Path, lineage: list[dict]) -> None:
    save_drafter(drafter, path)
    (Path(path) / LINEAGE_FILE).write_text(json.dumps(lineage, indent=1) + "\n")


@dataclass
class Batch:
    feats: torch.Tensor  # [B, T, F]
    block_ids: torch.Tensor  # [B, A, L]
    anchors: torch.Tensor  # [B, A]
    labels: torch.Tensor  # [B, A, L]
    weights: torch.Tensor  # [B, A, L]
    soft_ids: torch.Tensor | None = None  # [B, A, L, k]: the target's top-k for each slot's token
    soft_logits: torch.Tensor | None = None
    blocks: int = 0


def make_batch(store, seqs: list[dict], parts: list, device, soft: bool = True) -> Batch:
    """Pad a few sequences' blocks into one batch on `device` (features and soft targets are
    gathered where the store keeps them: on the device for DeviceFeatures). `soft` False
    skips the soft targets of a store that has them (a run that does not use them)."""
    B = len(parts)
    T = max(p.n_ctx for p in parts)
    A = max(len(p.anchors) for p in parts)
    L = parts[0].block_ids.shape[1]
    anchors = torch.zeros(B, A, dtype=torch.long)
    labels = torch.full((B, A, L), -100, dtype=torch.long)
    weights = torch.zeros(B, A, L)
    block_ids = torch.zeros(B, A, L, dtype=torch.long)
    k = getattr(store, "topk", 0) if soft else 0
    feats = soft_ids = soft_logits = None
    for b, (seq, p) in enumerate(zip(seqs, parts)):
        n = len(p.anchors)
        anchors[b, :n], labels[b, :n], weights[b, :n], block_ids[b, :n] = p.anchors, p.labels, p.weights, p.block_ids
        f = store.features(seq, torch.bfloat16).to(device, non_blocking=True)
        if feats is None:
            feats = torch.zeros(B, T, f.shape[-1], dtype=torch.bfloat16, device=device)
        feats[b, : len(f)] = f
        if k:
            # slot j of the block at anchor p holds token p+j: the target's distribution for it is row p+j-1
            ids, vals = store.soft_targets(seq)
            src = (p.positions - 1).clamp(0, p.n_ctx - 1).to(ids.device)
            if soft_ids is None:
                soft_ids = torch.zeros(B, A, L, k, dtype=torch.int32, device=device)
                soft_logits = torch.zeros(B, A, L, k, dtype=torch.float16, device=device)
            soft_ids[b, :n], soft_logits[b, :n] = ids[src].to(device), vals[src].to(device)
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return Batch(feats, move(block_ids), move(anchors), move(labels), move(weights), soft_ids, soft_logits,
                 blocks=sum(len(p.anchors) for p in parts))


def micro_batches(parts: list, block_tokens: int) -> list[list[int]]:
    """Indices of `parts` grouped so that each padded batch has at most `block_tokens` slots
    (sequences of similar anchor counts together, so little is padding)."""
    order = sorted(range(len(parts)), key=lambda i: len(parts[i].anchors))
    groups, cur = [], []
    for i in order:
        L = parts[i].block_ids.shape[1]
        if cur and (len(cur) + 1) * len(parts[i].anchors) * L > block_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def step_flops(dcfg, batch: Batch, head_rows: int, vocab: int, recompute_head: bool) -> float:
    """Floating-point operations one padded batch executes (forward + backward): the
    drafter's matmuls on block and context rows, attention over [context ; own block], and
    the LM head at the weighted rows (no weight gradient: it is frozen)."""
    B, A, L = batch.block_ids.shape
    T = batch.feats.shape[1]
    H, I, nH, nKV, d = (dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_attention_heads,
                        dcfg.num_key_value_heads, dcfg.head_dim)
    per_block_row = dcfg.num_hidden_layers * (2 * H * nH * d + 2 * H * nKV * d + 3 * H * I)
    per_ctx_row = dcfg.num_features * H * H + dcfg.num_hidden_layers * 2 * H * nKV * d
    attention = dcfg.num_hidden_layers * 2 * nH * d * (T + L)  # QK^T and PV, per block row
    dense = 2 * 3 * (B * A * L * (per_block_row + attention) + B * T * per_ctx_row)
    head = 2 * vocab * H * head_rows * (3 if recompute_head else 2)
    return float(dense + head)


def batch_loss(drafter: DFlashDrafter, embed: torch.Tensor, head: torch.Tensor, batch: Batch, cfg: TrainConfig,
               device: torch.device, accuracy: bool = False) -> tuple[torch.Tensor, dict]:
    """Weighted loss of one padded batch (weights normalised within it) and per-slot stats
    (teacher-forced accuracy per slot only when `accuracy`: the argmax costs a head pass)."""
    with autocast(device, cfg.autocast):
        hidden = forward_blocks(drafter, batch.feats.float() if not cfg.autocast else batch.feats,
                                embed[batch.block_ids], batch.anchors)
        sel = batch.weights > 0
        soft = (batch.soft_ids[sel], batch.soft_logits[sel]) if batch.soft_ids is not None else None
        out = token_losses(hidden[sel], head, batch.labels[sel], soft, cfg.soft_mix, cfg.head_chunk_rows, accuracy)
    w = batch.weights[sel]
    if cfg.weighting == "dpace":
        grid = torch.zeros(batch.weights.shape, device=device)
        grid[sel] = out["ce"].detach()
        w = dpace_weights(grid[..., 1:], sel[..., 1:], cfg.dpace_alpha)
        w = torch.cat((torch.zeros_like(w[..., :1]), w), dim=-1)[sel]
    loss = (out["loss"] * w).sum() / w.sum().clamp_min(1e-9)
    slot = sel.nonzero()[:, -1]
    L = batch.weights.shape[-1]
    stats = {"ce": float(out["ce"].detach().mean()),
             "flops": step_flops(drafter.config, batch, int(sel.sum()), head.shape[0], cfg.head_chunk_rows is not None)}
    if accuracy:
        stats["correct"] = torch.bincount(slot, weights=out["correct"].float(), minlength=L).cpu()
        stats["count"] = torch.bincount(slot, minlength=L).cpu().float()
    return loss, stats


def train(drafter: DFlashDrafter, target, store, out: Path, cfg: TrainConfig, resume: bool = True,
          heldout: list[dict] | None = None, lineage: list[dict] | None = None,
          prompts: set[str] | None = None) -> dict:
    """Train on `store.sequences` (a FeatureCache or DeviceFeatures), or only on those of
    `prompts` (a cache shared between runs holds other runs' answers too); `heldout`
    sequences of the same store are never trained on and serve the periodic τ estimate.
    `lineage` is the starting drafter's history (read_lineage); this stage is appended to it."""
    from dflash.train.simulate import simulate_tau

    if cfg.weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}")
    if cfg.soft_mix and not getattr(store, "topk", 0):
        raise ValueError("soft_mix needs a feature store built with top-k soft targets (topk > 0)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    dcfg = drafter.config
    L = training_block(cfg, dcfg)
    held = {s["prompt"] for s in heldout or []}
    seqs = [s for s in store.sequences if s["prompt"] not in held and (prompts is None or s["prompt"] in prompts)]
    steps_per_epoch = max(1, len(seqs) // cfg.seqs_per_step)
    total = steps_per_epoch * cfg.epochs
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, int(cfg.warmup_ratio * total))
    head = target.lm_head.weight.detach()
    embed = target.embed_tokens.weight.detach()
    dev = head.device
    train_head = head.to(torch.bfloat16) if cfg.autocast else head  # frozen: cast once, not every step
    drafter.to(dev)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    slot_w = slot_weights(L, cfg.weighting, cfg.gamma, cfg.loss_positions)

    state = {"step": 0, "losses": [], "elapsed_s": 0.0, "cpu_s": 0.0, "sequences": 0, "blocks": 0, "evals": [],
             "best_tau": None, "lineage": list(lineage or [])}
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False, map_location=dev)
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        state.update(saved["state"])
    label = device_label(dev)

    def this_stage() -> dict:
        return {"stage": cfg.stage, "device": label, "device_type": dev.type,
                "seconds": round(state["elapsed_s"], 1), "cpu_seconds": round(state["cpu_s"], 1),
                "steps": state["step"], "flops": state.get("flops", 0.0), "answers": len(seqs),
                "sequences": state["sequences"],
                "blocks": state["blocks"], "config": asdict(cfg), "evals": state["evals"]}

    def full_lineage() -> list[dict]:
        return state["lineage"] + [this_stage()]

    def save_checkpoint():
        torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "state": state,
                    "config": asdict(cfg)}, out / "checkpoint.pt.tmp")
        (out / "checkpoint.pt.tmp").replace(ckpt)
        if cfg.snapshot_dir:
            save_with_lineage(drafter, cfg.snapshot_dir, full_lineage())

    def evaluate():
        drafter.eval()
        res = simulate_tau(drafter, target, store, heldout, max_new_tokens=cfg.eval_max_new_tokens,
                           use_autocast=cfg.autocast)
        drafter.train()
        entry = {"step": state["step"], "seconds": round(state["elapsed_s"], 1),
                 "cpu_seconds": round(state["cpu_s"], 1), "sequences": state["sequences"],
                 "blocks": state["blocks"], "tau": res["tau"], "by_group": res.get("by_group", {})}
        state["evals"].append(entry)
        improved = state["best_tau"] is None or res["tau"] > state["best_tau"]
        if improved:
            state["best_tau"] = res["tau"]
            save_with_lineage(drafter, out / "best", full_lineage())
        tqdm.write(f"[train] step {state['step']}: held-out τ {res['tau']:.3f} {entry['by_group']}"
                   f"{' (best)' if improved else ''}")
        return entry

    drafter.train()
    if heldout and cfg.eval_minutes and not state["evals"]:
        evaluate()  # the starting point, for the τ-against-compute table
    # Wall-clock and this process's CPU time (all threads) spent training, evaluation excluded.
    start = time.monotonic() - state["elapsed_s"]
    cpu_start = time.process_time() - state["cpu_s"]
    last_ckpt = last_eval = time.monotonic()
    bar = tqdm(total=total, initial=state["step"], desc="training drafter", unit="step")
    slot_correct, slot_count = torch.zeros(L), torch.zeros(L)
    while state["step"] < total and not budget_spent(cfg, state["elapsed_s"], state["cpu_s"]):
        step = state["step"]
        epoch, i = divmod(step, steps_per_epoch)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)  # fresh order every epoch
        order = torch.randperm(len(seqs), generator=gen)
        batch_seqs = [seqs[j] for j in order[i * cfg.seqs_per_step : (i + 1) * cfg.seqs_per_step].tolist()]
        sched = schedule_step(step, total, budget_share(cfg, state["elapsed_s"], state["cpu_s"]))
        if cfg.schedule == "constant":
            lr = cfg.lr * min(1.0, (step + 1) / warmup)
        else:
            lr = cosine_lr(sched, total, cfg.lr, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        anchor_gen = torch.Generator().manual_seed(cfg.seed + 7919 * step)
        parts, used = [], []
        for seq in batch_seqs:
            ids = torch.tensor(seq["ids"])
            anchors = sample_anchors(len(ids), seq["response_start"], cfg.max_anchors, anchor_gen)
            if len(anchors):
                parts.append(build_blocks(ids, anchors, L, dcfg.mask_token_id, slot_w))
                used.append(seq)
        n_blocks = sum(len(p.anchors) for p in parts)
        loss_sum = 0.0
        for group in micro_batches(parts, cfg.block_tokens):
            batch = make_batch(store, [used[g] for g in group], [parts[g] for g in group], dev,
                               soft=cfg.soft_mix > 0)
            loss, stats = batch_loss(drafter, embed, train_head, batch, cfg, dev, accuracy=step % 10 == 0)
            share = batch.blocks / n_blocks
            (loss * share).backward()
            loss_sum += loss.item() * share
            state["flops"] = state.get("flops", 0.0) + stats["flops"]
            if "correct" in stats:
                slot_correct += stats["correct"]
                slot_count += stats["count"]
        if not parts:
            state["step"] += 1
            continue
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        state["step"] += 1
        state["sequences"] += len(parts)
        state["blocks"] += n_blocks
        state["elapsed_s"] = time.monotonic() - start
        state["cpu_s"] = time.process_time() - cpu_start
        state["losses"].append((state["step"], state["elapsed_s"], loss_sum))
        acc = (slot_correct[1:4] / slot_count[1:4].clamp_min(1)).tolist()
        bar.set_postfix(loss=f"{loss_sum:.3f}", acc1_3="/".join(f"{a:.2f}" for a in acc), lr=f"{lr:.1e}")
        bar.update()
        if state["step"] % 100 == 0:
            state.setdefault("slot_accuracy", []).append(
                (state["step"], (slot_correct / slot_count.clamp_min(1)).tolist()))
            slot_correct.zero_()
            slot_count.zero_()
        now = time.monotonic()
        if heldout and cfg.eval_minutes and now - last_eval > cfg.eval_minutes * 60:
            cpu_now = time.process_time()
            evaluate()
            last_eval = time.monotonic()
            start += last_eval - now  # evaluation time is not training compute
            cpu_start += time.process_time() - cpu_now
        if time.monotonic() - last_ckpt > cfg.checkpoint_minutes * 60:
            save_checkpoint()
            last_ckpt = time.monotonic()
    bar.close()
    if heldout and cfg.eval_minutes and (not state["evals"] or state["evals"][-1]["step"] != state["step"]):
        evaluate()
    drafter.eval()
    save_checkpoint()
    save_with_lineage(drafter, out / "drafter", full_lineage())
    (out / "losses.json").write_text(json.dumps(state["losses"]))
    plot_losses(state["losses"], out / "loss.png")
    return state


def plot_losses(losses: list, path: Path) -> None:
    if not losses:
        return
    plt = pyplot()
    if plt is None:
        return

    steps, secs, vals = zip(*losses)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, vals, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("weighted loss")
    ax.set_title(f"drafter training loss ({secs[-1] / 60:.1f} min)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
