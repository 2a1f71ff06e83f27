"""Where one drafter training step's time goes, on this machine.

    python -m tools.train_profile [--layers 4] [--seq-len 400] [--response 220] [--repeat 3] [--out F]

Times one sequence's step (every response position an anchor) for the default target's
geometry (SmolLM2-135M: hidden 576, vocabulary 49,152) on random features, part by part
and as whole steps: the engine drafter's dense-mask forward against the block-sparse
training forward (blockwise.py), fp32 against bf16 autocast, and the LM head + loss over
all 15 slots against only the first few. Medians of `--repeat` runs after a warm-up, in
wall time and in this process's CPU time (which a shared machine's other work inflates
far less); writes JSON (machine-readable) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import statistics
from dflash.engine.drafter import init_random_drafter
from dflash.model_files import ensure_default_target
from dflash.train.blockwise import forward_blocks
from dflash.train.objective import build_blocks, sample_anchors, slot_weights, token_losses
from dflash.train.trainer import autocast


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=400)
    p.add_argument("--response", type=int, default=220, help="response tokens (all of them anchor a block)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--skip-dense", action="store_true", help="skip the (slow) dense-mask variants")
    p.add_argument("--out", default="bench-out/train_profile.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from dflash.engine.target.hf import HFTarget
    from dflash.train.pipeline import drafter_config_for

    target = HFTarget.from_pretrained(ensure_default_target())
    dcfg = drafter_config_for(target, args.layers, 16, None, 16)
    drafter = init_random_drafter(dcfg).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5)
    head, embed = target.lm_head.weight.detach(), target.embed_tokens.weight.detach()
    gen = torch.Generator().manual_seed(0)
    T, W, L = args.seq_len, dcfg.num_features * dcfg.hidden_size, 16
    ids = torch.randint(100, 20000, (T,), generator=gen)
    feats = torch.randn(T, W, generator=gen).to(torch.bfloat16)
    anchors = sample_anchors(T, T - args.response, 512, gen)

    def blocks(positions):
        return build_blocks(ids, anchors, L, dcfg.mask_token_id, slot_weights(L, "decay", None, positions))

    def dense_forward(b, bf16):
        pos = torch.cat((torch.arange(T), b.positions.reshape(-1)))
        with autocast(torch.device("cpu"), bf16):
            return drafter(feats.float()[None], embed[b.block_ids.reshape(-1)][None], pos,
                           attn_mask=b.dense_mask())[0].view(len(anchors), L, -1)

    def sparse_forward(b, bf16):
        with autocast(torch.device("cpu"), bf16):
            return forward_blocks(drafter, (feats if bf16 else feats.float())[None], embed[b.block_ids][None],
                                  b.anchors[None])[0]

    def loss_of(hidden, b, bf16):
        sel = b.weights > 0
        with autocast(torch.device("cpu"), bf16):
            out = token_losses(hidden[sel], head, b.labels[sel])
        return (out["loss"] * b.weights[sel]).sum() / b.weights[sel].sum()

    def step(forward, b, bf16):
        opt.zero_grad(set_to_none=True)
        loss_of(forward(b, bf16), b, bf16).backward()
        opt.step()

    all_slots, eight, four = blocks(None), blocks(8), blocks(4)
    hidden = sparse_forward(all_slots, False).detach().requires_grad_()
    parts = {
        "forward, block-sparse, fp32": lambda: sparse_forward(all_slots, False),
        "forward, block-sparse, bf16": lambda: sparse_forward(all_slots, True),
        "head + loss, 15 slots, fp32": lambda: loss_of(hidden, all_slots, False),
        "head + loss, 15 slots, bf16": lambda: loss_of(hidden, all_slots, True),
        "head + loss, 4 slots, bf16": lambda: loss_of(hidden, four, True),
        "step, block-sparse, 15 slots, fp32": lambda: step(sparse_forward, all_slots, False),
        "step, block-sparse, 15 slots, bf16": lambda: step(sparse_forward, all_slots, True),
        "step, block-sparse, 8 slots, bf16": lambda: step(sparse_forward, eight, True),
        "step, block-sparse, 4 slots, bf16": lambda: step(sparse_forward, four, True),
    }
    if not args.skip_dense:
        parts = {"forward, dense mask, fp32": lambda: dense_forward(all_slots, False),
                 "step, dense mask, 15 slots, fp32 (the previous CPU step)":
                     lambda: step(dense_forward, all_slots, False),
                 **parts}
    rows, cpu_rows = {}, {}
    for name, fn in parts.items():
        fn()  # warm-up
        wall, cpu = [], []
        for _ in range(args.repeat):
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall.append((time.perf_counter() - t) * 1000)
            cpu.append((time.process_time() - c) * 1000)
        rows[name], cpu_rows[name] = statistics.median(wall), statistics.median(cpu)
        print(f"{rows[name]:10.1f} ms wall {cpu_rows[name]:10.1f} ms CPU  {name}", flush=True)
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "layers": args.layers,
              "anchors": len(anchors), "seq_len": T, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "median_ms_per_sequence": rows, "median_cpu_ms_per_sequence": cpu_rows,
              "blocks_per_cpu_s": {k: round(len(anchors) / (v / 1000), 1) for k, v in cpu_rows.items()
                                   if k.startswith("step")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
