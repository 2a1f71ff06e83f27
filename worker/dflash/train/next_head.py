"""Train the next-token head (dflash.engine.proposers.head) on the target's own greedy answers.

    python -m dflash.train.next_head [--out DIR] [--target NAME|GGUF|DIR] [--records 1500] [--heldout 150]
                                     [--epochs 3] [--vocab 2048] [--backends ort,ort-q4_1]
                                     [--answers FILE.jsonl | --prompts N [--max-new-tokens N]]

A head is made for one target (`--target`: a Hugging Face folder, a GGUF file or a model
name; default the embedded SmolLM2) and the backends named in it: the engine loads it only
for those (dflash.engine.proposers.head.fits). It is written to `--out`, by default
CACHE/heads/<target>/<backends>/, where `--head auto` finds it (dflash.model_files.head_candidates). Its examples are the target's own greedy
answers: the shipped corpus (dflash.train.corpus) for the default target, else `--answers`
(a JSONL of prompt, prompt_ids, response_ids, e.g. a `dflash train` run's data.jsonl) or the
target's answers to `--prompts N` offline prompts, regenerated into DIR/answers/ (kept: a
second run reuses them). For the first `--records` of them the target (on the first of
`--backends`, whose last feature output the head will read at inference) runs prompt +
answer once, and every answer position i gives one example: (the residual after the last
layer at i, answer token i + 1) -> answer token i + 2. The last `--heldout` records are never
trained on; the top-1 accuracy on them and its calibration by confidence go into the head's
config.json. The guessable tokens are the `--vocab` most frequent ones of the shipped
drafter's draft vocabulary (the default target) or of the training answers (another
target); their output embeddings, frozen, are the target's. About 6 minutes for the
features of 1,500 records and 4 for three epochs on a 2-core CPU (SmolLM2).

The backends: the default target's head is for `ort,ort-q4_1`; another target's for `ort` on
a CPU with ONNX Runtime (the backend a worker serves it on there), else `hf`, unless named.
The `llamacpp` backend cannot feed a head (it gives no last-layer output).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash.engine.proposers import head as head_mod
from dflash.errors import DFlashError


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


def train(target, folder: Path, records: list[dict], heldout: list[dict], vocab: list[int], epochs: int,
          lr: float = 2e-3, batch: int = 512, seed: int = 0) -> tuple[head_mod.NextHead, dict]:
    """The head for `target` (its Hugging Face folder `folder`, whose final norm it reads)."""
    from tqdm import tqdm

    from dflash.engine.target.hf_files import read_tensors

    torch.manual_seed(seed)
    final_norm = read_tensors(folder, ("model.norm.weight",))["model.norm.weight"].float()
    vocab_t = torch.tensor(vocab)
    out = target.head_weight().detach().float()[vocab_t]
    index = torch.full((target.vocab_size,), -100, dtype=torch.long)
    index[vocab_t] = torch.arange(len(vocab))
    tr = examples(target, records, "features")
    te = examples(target, heldout, "held-out features")
    head = head_mod.NextHead(target.hidden_size, final_norm)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    n = len(tr[0])
    batch = min(batch, n)  # a few answers (a short trial run) still make whole steps
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


# The default target's head reads the ort graph's last feature output (the ort-q4_1 graph is
# the same with other weights); another target's, the backend a CPU worker serves it on
# (`auto` and many callers choose ort; llama.cpp cannot feed a head), else hf, which every
# target runs on (a GPU).
DEFAULT_BACKENDS = "ort,ort-q4_1"


def other_target_backends() -> str:
    from dflash.engine.target import ort

    return "ort" if ort.available() and not torch.cuda.is_available() else "hf"


def training_answers(args, target) -> tuple[list[dict], str]:
    """(the answers the head learns from, what they are)."""
    from dflash.train.corpus import CORPUS_FILE, load_corpus
    from dflash.train.pipeline import corpus_fits, training_records

    if not args.answers and not args.prompts:
        records = load_corpus()
        if corpus_fits(target, records):
            return records, f"the shipped corpus ({CORPUS_FILE.name})"
        raise DFlashError("bad_corpus", f"the shipped corpus holds another target's answers, not {target.name}'s: "
                          "give --prompts N (the target answers N offline prompts) or --answers FILE.jsonl")
    # the target's own answers, on the backend the head is for (dflash.train.data.regenerate)
    records = training_records(target, Path(args.out) / "answers", prompts=args.prompts, prompt_file=None,
                               max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch,
                               answers=Path(args.answers) if args.answers else None)
    if not corpus_fits(target, records):
        raise DFlashError("bad_corpus", f"the answers were not made with {target.name}'s tokenizer and chat template")
    return records, str(args.answers) if args.answers else f"the target's answers to {args.prompts} offline prompts"


def main(argv: list[str] | None = None) -> int:
    from dflash.engine import draft_vocab
    from dflash.loading import load_target
    from dflash.model_files import SHIPPED_DRAFTER, default_target_dir, heads_dir, resolve_target
    from dflash.train.corpus import ANSWER_TOKENS
    from dflash.train.draft_vocab import choose

    p = argparse.ArgumentParser(prog="python -m dflash.train.next_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the head's folder (default: CACHE/heads/TARGET/BACKENDS/, where --head auto "
                   "finds it)")
    p.add_argument("--target", help="a Hugging Face folder, a GGUF file or a model name (dflash models --list) "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--records", type=int, default=1500)
    p.add_argument("--heldout", type=int, default=150)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--backends",
                   help="the backends the head is for, comma-separated: the features come from the first; the "
                        f"others must give the same last feature (default: {DEFAULT_BACKENDS} for the default "
                        "target, whose ort-q4_1 is the ort graph with other weights; for another, ort on a CPU "
                        "where ONNX Runtime is installed, else hf)")
    p.add_argument("--answers", help="a JSONL of the target's answers (prompt, prompt_ids, response_ids) instead of "
                   "the shipped corpus")
    p.add_argument("--prompts", type=int, help="the target answers this many offline prompts first (into OUT/answers)")
    p.add_argument("--max-new-tokens", type=int, default=ANSWER_TOKENS, help="answer length with --prompts")
    p.add_argument("--gen-batch", type=int, default=8, help="prompts per batched answer with --prompts")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        files = resolve_target(args.target, quiet=True)
        default = files.folder.resolve() == default_target_dir().resolve()
        backends = [b for b in (args.backends or (DEFAULT_BACKENDS if default else other_target_backends())).split(",")
                    if b]
        target = load_target(files.folder, backends[0], gguf=files.gguf)
        args.out = args.out or str(heads_dir(target.name) / "+".join(backends))
        records, source = training_answers(args, target)
        if len(records) <= args.heldout:
            raise DFlashError("bad_params", f"{len(records)} answers leave none to train on after --heldout "
                              f"{args.heldout}")
        held = records[-args.heldout:]
        train_on = records[:min(args.records, len(records) - args.heldout)]
        if default:
            vocab, vocab_source = (draft_vocab.read(SHIPPED_DRAFTER)[:args.vocab],
                                   "the shipped drafter's draft vocabulary, most frequent first")
        else:
            vocab = choose(train_on, 1.0, target.eos_ids, k=args.vocab)["token_ids"][:args.vocab]
            vocab_source = "the training answers' most frequent tokens"
    except DFlashError as exc:
        print(f"dflash: error: {exc.message}", file=sys.stderr)
        return 2
    out = Path(args.out)
    head, report = train(target, files.folder, train_on, held, vocab, args.epochs)
    info = {"target": target.name, "backends": backends, "layer": target.num_layers - 1,
            "input": "the residual after the last layer, before the final norm, and the next token's embedding",
            "vocab_source": vocab_source, "vocab_k": len(vocab),
            "corpus": {"source": source, "first_records": len(train_on), "heldout_last": len(held)},
            "trained": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **report}
    head_mod.save(out, head, vocab, info)
    print(f"held-out top-1 {report['heldout']['top1']:.3f} over {report['heldout']['positions']} positions; "
          f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
