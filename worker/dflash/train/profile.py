"""Where one drafter training step's time goes, on this machine.

    python -m dflash.train.profile [--layers 4] [--anchors 32] [--seq-len 400] [--repeat 5] [--out F]

Times the parts of a step for the default target's geometry (SmolLM2-135M: hidden 576,
vocabulary 49,152) on random features: building the blocks, the drafter forward, the LM
head + loss (whole vocabulary vs the reduced one `dflash train` uses on CPU), backward,
and the optimizer; and one sequence per forward vs several packed. Medians of `--repeat`
runs after a warm-up; writes JSON (machine-readable) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash.bench.timing import median_ms
from dflash.engine.drafter import init_random_drafter
from dflash.models import ensure_default_target
from dflash.train.objective import build_blocks, pack_blocks, sample_anchors, weighted_loss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=400)
    p.add_argument("--pack", type=int, default=4, help="sequences in the packed variant")
    p.add_argument("--reduced-vocab", type=int, default=16000, help="softmax support size of the reduced loss")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int)
    p.add_argument("--out", default="bench-out/train_profile.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from dflash.engine.target import TargetModel
    from dflash.train.pipeline import drafter_config_for

    target = TargetModel.from_pretrained(ensure_default_target())
    dcfg = drafter_config_for(target, args.layers, 16, None, 16)
    drafter = init_random_drafter(dcfg).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    head, embed = target.lm_head.weight.detach(), target.embed_tokens.weight.detach()
    gen = torch.Generator().manual_seed(0)
    T, W = args.seq_len, dcfg.num_features * dcfg.hidden_size

    def sequence():
        ids = torch.randint(100, 20000, (T,), generator=gen)
        return ids, torch.randn(T, W, generator=gen), sample_anchors(T, T // 4, 16, args.anchors, gen)

    seqs = [sequence() for _ in range(args.pack)]
    vocab = torch.arange(args.reduced_vocab)
    remap = torch.full((head.shape[0],), -100, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    single = build_blocks(seqs[0][0], seqs[0][2], 16, 16, 7.0)
    packed = pack_blocks([build_blocks(i, a, 16, 16, 7.0) for i, _, a in seqs])
    feats_packed = torch.cat([f for _, f, _ in seqs])

    def forward(b, feats):
        return drafter(feats[None], embed[b.block_ids][None], b.positions, attn_mask=b.attn_mask)[0]

    def loss_of(hidden, b, reduced):
        if reduced:
            labels = remap[b.labels.clamp_min(0) % args.reduced_vocab].masked_fill(b.labels < 0, -100)
            return weighted_loss(hidden, head, labels, b.weights, vocab)
        return weighted_loss(hidden, head, b.labels, b.weights)

    def step(b, feats, reduced):
        opt.zero_grad(set_to_none=True)
        loss_of(forward(b, feats), b, reduced).backward()
        opt.step()

    hidden = forward(single, seqs[0][1]).detach().requires_grad_()
    parts = {
        "build blocks (1 seq)": lambda: build_blocks(seqs[0][0], seqs[0][2], 16, 16, 7.0),
        "drafter forward (1 seq)": lambda: forward(single, seqs[0][1]),
        "head + loss, whole vocabulary": lambda: loss_of(hidden, single, False),
        f"head + loss, reduced vocabulary ({args.reduced_vocab})": lambda: loss_of(hidden, single, True),
        "whole step, reduced vocabulary (1 seq)": lambda: step(single, seqs[0][1], True),
        "whole step, whole vocabulary (1 seq)": lambda: step(single, seqs[0][1], False),
        f"whole step, reduced vocabulary, {args.pack} seqs packed (per seq)": lambda: step(packed, feats_packed, True),
    }
    rows = {}
    for name, fn in parts.items():
        ms = median_ms(fn, args.repeat)  # after one warm-up call
        rows[name] = ms / args.pack if "packed" in name else ms
        print(f"{rows[name]:10.1f} ms  {name}", flush=True)
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "layers": args.layers,
              "anchors": args.anchors, "seq_len": T, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "median_ms": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
