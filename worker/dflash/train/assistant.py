"""A small autoregressive draft model: the classic speculative-decoding baseline.

`dflash bench --methods assisted-ar` runs transformers' assisted generation with it. To
be a fair baseline it is trained like the DFlash drafter: same target-regenerated data,
same initialisation idea (evenly spaced target layers), comparable compute.

Geometry: the target's own architecture with N decoder layers, the target's final norm,
and the target's embedding (tied to the LM head on SmolLM2), which stays frozen. Only
the layers and final norm train, and only they are stored (`assistant.safetensors`,
bf16, next to `config.json`): the embedding is a quarter of SmolLM2 and is copied from
the target when the model is materialised into a plain transformers folder.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from dflash.errors import DFlashError
from dflash.train.objective import cosine_lr
from dflash import model_files
from dflash.train.trainer import autocast, plot_losses, schedule_step

WEIGHTS = "assistant.safetensors"


def _stored(name: str) -> bool:
    return name.startswith("model.layers.") or name.startswith("model.norm.")


def build_assistant(target_model, layers: int, init_from_target: bool = True):
    """A `layers`-deep copy of the target's architecture sharing its (frozen) embedding."""
    cfg = copy.deepcopy(target_model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    model = AutoModelForCausalLM.from_config(cfg)
    src = target_model.state_dict()
    n = target_model.config.num_hidden_layers
    picks = [round(i * (n - 1) / max(1, layers - 1)) for i in range(layers)] if init_from_target else []
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.startswith("model.layers."):
                if picks:
                    i, rest = name[len("model.layers."):].split(".", 1)
                    p.copy_(src[f"model.layers.{picks[int(i)]}.{rest}"])
            elif name in src:
                p.copy_(src[name])
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    return model.to(next(target_model.parameters()).device)


def save_assistant(model, path: str | Path, extra: dict | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: t.detach().to("cpu", torch.bfloat16).contiguous() for k, t in model.state_dict().items() if _stored(k)}
    save_file(state, str(path / (WEIGHTS + ".tmp")), metadata={"format": "pt"})
    (path / (WEIGHTS + ".tmp")).replace(path / WEIGHTS)
    cfg = model.config.to_dict()
    cfg["dflash_assistant"] = {"embedding": "copied from the target when materialised", **(extra or {})}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def materialize_assistant(stored: str | Path, target_model, out: str | Path) -> Path:
    """Stored layers + the target's embedding -> a plain transformers folder at `out`."""
    stored, out = Path(stored), Path(out)
    if not (stored / WEIGHTS).is_file():
        raise DFlashError("bad_assistant", f"{stored} holds no {WEIGHTS}")
    cfg = json.loads((stored / "config.json").read_text())
    model = build_assistant(target_model, cfg["num_hidden_layers"], init_from_target=False)
    weights = load_file(str(stored / WEIGHTS))
    missing = {k for k in model.state_dict() if _stored(k)} - set(weights)
    if missing:
        raise DFlashError("bad_assistant", f"{stored / WEIGHTS} lacks {sorted(missing)[:3]}")
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    model.save_pretrained(out)
    return out


def train_assistant(model, records: list[dict], out: Path, *, lr: float = 6e-4, seqs_per_step: int = 32,
                    epochs: int = 6, time_budget_s: float | None = None, checkpoint_s: float = 60.0,
                    snapshot_dir: str | None = None, seed: int = 0) -> dict:
    """Next-token cross-entropy on the target's responses (prompt tokens are context only)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dev = next(model.parameters()).device
    seqs = [r["prompt_ids"] + r["response_ids"] for r in records if len(r["response_ids"]) >= 2]
    starts = [len(r["prompt_ids"]) for r in records if len(r["response_ids"]) >= 2]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps_per_epoch = max(1, len(seqs) // seqs_per_step)
    total = steps_per_epoch * epochs
    rng = random.Random(seed)
    state = {"step": 0, "losses": [], "sequences": 0}
    start = last = time.monotonic()
    model.train()
    bar = tqdm(total=total, desc="training AR assistant", unit="step")
    order: list[int] = []
    while state["step"] < total:
        if len(order) < seqs_per_step:
            order += rng.sample(range(len(seqs)), len(seqs))
        batch, order = order[:seqs_per_step], order[seqs_per_step:]
        width = max(len(seqs[j]) for j in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, j in enumerate(batch):
            x = torch.tensor(seqs[j])
            ids[row, : len(x)], mask[row, : len(x)] = x, 1
            labels[row, starts[j] : len(x)] = x[starts[j]:]
        elapsed = time.monotonic() - start
        progress = schedule_step(state["step"], total, elapsed / time_budget_s if time_budget_s else None)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(progress, total, lr, max(1, total // 25))
        with autocast(dev):
            loss = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] += 1
        state["sequences"] += len(batch)
        state["losses"].append((state["step"], time.monotonic() - start, loss.item()))
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update()
        if snapshot_dir and time.monotonic() - last > checkpoint_s:
            save_assistant(model, snapshot_dir)
            last = time.monotonic()
        if time_budget_s and time.monotonic() - start > time_budget_s:
            break
    bar.close()
    model.eval()
    state["elapsed_s"] = time.monotonic() - start
    save_assistant(model, out / "assistant", {"steps": state["step"], "sequences": state["sequences"],
                                               "train_seconds": round(state["elapsed_s"], 1)})
    if snapshot_dir:
        save_assistant(model, snapshot_dir)
    (out / "losses.json").write_text(json.dumps(state["losses"]))
    plot_losses(state["losses"], out / "loss.png")
    return state


def assistant_dir(path: str | Path | None, target_model, target_is_default: bool) -> Path | None:
    """A loadable transformers folder for the `assisted-ar` baseline, or None.

    `path` may be a plain transformers folder, or a stored assistant (layers only,
    `assistant.safetensors`, see dflash.train.assistant), which is materialised once
    into the cache with the target's embedding. Without `path`, the shipped assistant
    serves the default target."""
    if path is None:
        if not (target_is_default and (model_files.SHIPPED_ASSISTANT / "config.json").is_file()):
            return None
        path = model_files.SHIPPED_ASSISTANT
    path = Path(path)
    if not (path / "assistant.safetensors").is_file():
        return path
    out = model_files.cache_dir() / "assistants" / path.name
    stamp = f"{(path / 'assistant.safetensors').stat().st_size}-{(path / 'assistant.safetensors').stat().st_mtime_ns}"
    if not ((out / model_files.MARKER).is_file() and json.loads((out / model_files.MARKER).read_text()).get("stamp") == stamp):
        model_files.say(f"materialising the AR assistant {path.name} into {out} (once)")
        materialize_assistant(path, target_model, out)
        (out / model_files.MARKER).write_text(json.dumps({"source": str(path), "stamp": stamp}) + "\n")
    return out
