"""Train the next-token head (dflash.engine.proposers.head) on the target's own greedy answers.

    python -m dflash.train.next_head --out DIR [--records 1500] [--heldout 150] [--epochs 3]
                                     [--vocab 2048] [--backends ort,ort-q4_1]

The shipped corpus (dflash.train.corpus) holds the default target's greedy answers. For the
first `--records` of them the target (on the first of `--backends`, whose last feature
output the head will read at inference) runs prompt + answer once, and every answer position i gives one
example: (the residual after the last layer at i, answer token i + 1) -> answer token i + 2.
The last `--heldout` records are never trained on; the top-1 accuracy on them and its
calibration by confidence go into the head's config.json. The guessable tokens are the
`--vocab` most frequent ones of the shipped drafter's draft vocabulary (their output
embeddings, frozen, are the target's). About 6 minutes for the features of 1,500 records and
4 for three epochs on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash.engine.proposers import head as head_mod


def examples(target, records: list[dict], desc: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(residual at i, token i + 1, token i + 2) over every answer position of `records`."""
    from tqdm import tqdm

    from dflash.engine.target import TargetRow

    layer = target.num_layers - 1
    res, nxt, after = [], [], []
    for r in tqdm(records, desc=desc, mininterval=10):
        ids = r["prompt_ids"] + r["response_ids"]
        seq = target.new_sequence()
        try:
            feats = target.forward_batch([TargetRow(seq, ids, 1)], (layer,)).features[0]
        finally:
            target.free(seq)
        P = len(r["prompt_ids"])
        toks = torch.tensor(ids[P - 1:])  # the prompt's last token chose the answer's first
        n = len(toks) - 2
        if n > 0:
            res.append(feats[P - 1:P - 1 + n].half())
            nxt.append(toks[1:1 + n])
            after.append(toks[2:2 + n])
    return torch.cat(res), torch.cat(nxt), torch.cat(after)


def accuracy(head, data, embed, out, vocab: torch.Tensor) -> dict:
    """Top-1 accuracy on `data`, and by confidence (softmax peak) in fifths."""
    conf, right = [], []
    with torch.no_grad():
        for i in range(0, len(data[0]), 4096):
            r, x, y = (t[i:i + 4096] for t in data)
            p = head(r.float(), embed(x), out).softmax(-1)
            c, j = p.max(-1)
            conf.append(c)
            right.append(vocab[j] == y)
    conf, right = torch.cat(conf), torch.cat(right).float()
    bins = {}
    for lo in (0.0, 0.2, 0.4, 0.6, 0.8):
        sel = (conf >= lo) & (conf < lo + 0.2) if lo < 0.8 else conf >= lo
        if sel.any():
            bins[f"{lo:.1f}"] = {"share": round(sel.float().mean().item(), 3),
                                 "right": round(right[sel].mean().item(), 3)}
    return {"top1": round(right.mean().item(), 4), "by_confidence": bins, "positions": len(right)}


def train(target, records: list[dict], heldout: list[dict], vocab: list[int], epochs: int, lr: float = 2e-3,
          batch: int = 512, seed: int = 0) -> tuple[head_mod.NextHead, dict]:
    from tqdm import tqdm

    from dflash.engine.target.hf_files import read_tensors

    torch.manual_seed(seed)
    final_norm = read_tensors(target.hf_dir, ("model.norm.weight",))["model.norm.weight"].float()
    vocab_t = torch.tensor(vocab)
    out = target.head_weight().detach().float()[vocab_t]
    index = torch.full((target.vocab_size,), -100, dtype=torch.long)
    index[vocab_t] = torch.arange(len(vocab))
    tr = examples(target, records, "features")
    te = examples(target, heldout, "held-out features")
    head = head_mod.NextHead(target.hidden_size, final_norm)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    n = len(tr[0])
    steps = epochs * (n // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=max(steps, 1), pct_start=0.05)
    t0 = time.time()
    for _ in tqdm(range(epochs), desc="epochs"):
        perm = torch.randperm(n)
        for i in range(0, n - batch + 1, batch):
            j = perm[i:i + batch]
            logits = head(tr[0][j].float(), target.embed(tr[1][j]).float(), out)
            loss = F.cross_entropy(logits, index[tr[2][j]], ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    head.eval()
    report = {"train_positions": n, "epochs": epochs, "train_s": round(time.time() - t0),
              "heldout": accuracy(head, te, lambda x: target.embed(x).float(), out, vocab_t)}
    return head, report


def main(argv: list[str] | None = None) -> int:
    from dflash.engine import draft_vocab
    from dflash.loading import load_target
    from dflash.model_files import SHIPPED_DRAFTER, default_target_dir, ensure_default_target
    from dflash.train.corpus import load_corpus

    p = argparse.ArgumentParser(prog="python -m dflash.train.next_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--records", type=int, default=1500)
    p.add_argument("--heldout", type=int, default=150)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--backends", default="ort,ort-q4_1",
                   help="the backends the head is for, comma-separated: the features come from the first; the "
                        "others must give the same last feature (ort-q4_1 is the ort graph with other weights)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_default_target(quiet=True)
    backends = [b for b in args.backends.split(",") if b]
    target = load_target(default_target_dir(), backends[0])
    records = load_corpus()
    train_on, held = records[:args.records], records[-args.heldout:]
    vocab = draft_vocab.read(SHIPPED_DRAFTER)[:args.vocab]
    head, report = train(target, train_on, held, vocab, args.epochs)
    info = {"target": target.name, "backends": backends, "layer": target.num_layers - 1,
            "input": "the residual after the last layer, before the final norm, and the next token's embedding",
            "vocab_source": "the shipped drafter's draft vocabulary, most frequent first", "vocab_k": len(vocab),
            "corpus": {"first_records": args.records, "heldout_last": args.heldout},
            "trained": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **report}
    head_mod.save(Path(args.out), head, vocab, info)
    print(f"held-out top-1 {report['heldout']['top1']:.3f} over {report['heldout']['positions']} positions; "
          f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
