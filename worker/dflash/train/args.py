"""`dflash train`'s command-line options (torch-free, so building the CLI stays fast)."""

from __future__ import annotations

import argparse

from dflash.train.corpus import ANSWER_TOKENS


def _ids(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="the target: a Hugging Face folder, a GGUF file (converted once into the cache) or "
                   "a model name (dflash models --list) (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="run directory: features, checkpoints, drafter")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int)
    data = p.add_argument_group("data (default: the shipped corpus of the default target's answers; for another "
                                "target its own answers to the offline prompts, regenerated)")
    data.add_argument("--answers", help="a JSONL of answers (prompt, prompt_ids, response_ids) instead of the corpus")
    data.add_argument("--prompts", type=int, help="regenerate answers for this many offline prompts instead")
    data.add_argument("--prompt-file", help="regenerate answers for the prompts of this JSONL instead")
    data.add_argument("--max-new-tokens", type=int, default=ANSWER_TOKENS, help="answer length when regenerating")
    data.add_argument("--gen-batch", type=int, default=64, help="prompts per batched regeneration")
    data.add_argument("--sequences", type=int, help="train on the first N answers (default: all)")
    data.add_argument("--heldout", type=int, default=24, help="held-out answers per group (code, chat) for τ")
    data.add_argument("--topk", type=int, default=0, help="also store the target's top-k logits (soft targets)")
    data.add_argument("--features", help="the feature cache's folder (default RUN/features); runs of the same "
                                         "target, data and drafter layers can share one")
    model = p.add_argument_group("drafter")
    model.add_argument("--init-from", help="continue this drafter folder (and its lineage)")
    model.add_argument("--init", choices=["random", "target"], default="target",
                       help="a new drafter: random layers or target layers copied in (final norm: the target's)")
    model.add_argument("--layers", type=int, default=4, help="draft layers")
    model.add_argument("--block-size", type=int, default=16)
    model.add_argument("--target-layer-ids", type=_ids, help="comma-separated target layer ids (default: spread)")
    model.add_argument("--mask-token-id", type=int,
                       help="default: an embedding row no text is tokenised to (SmolLM2: 16; Qwen2.5: 151665)")
    opt = p.add_argument_group("objective and schedule")
    opt.add_argument("--lr", type=float, default=6e-4)
    opt.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    opt.add_argument("--warmup-steps", type=int)
    opt.add_argument("--epochs", type=int, default=6)
    opt.add_argument("--max-anchors", type=int, default=512, help="anchors per sequence (every response position)")
    opt.add_argument("--seqs-per-step", type=int, default=4)
    opt.add_argument("--block-tokens", type=int, default=8192, help="block slots per forward")
    opt.add_argument("--weighting", choices=["decay", "dpace", "uniform"], default="decay")
    opt.add_argument("--gamma", type=float, help="decay weighting's gamma (default 7 for block 16)")
    opt.add_argument("--loss-positions", type=int, help="only block slots 1..n carry loss (and run the LM head)")
    opt.add_argument("--train-block", type=int,
                     help="train at this block length (default: the drafter's; it still serves its own)")
    opt.add_argument("--soft-mix", type=float, default=0.0,
                     help="weight of the KL to the target's top-k (needs --topk)")
    opt.add_argument("--no-autocast", action="store_true", help="fp32 matmuls (default: bf16 autocast)")
    opt.add_argument("--time-budget-min", type=float,
                     help="the run's training time: it stops there; run again, it resumes within what is left")
    opt.add_argument("--cpu-budget-min", type=float,
                     help="the run's CPU time (all threads, every resume): it stops there")
    opt.add_argument("--schedule-by-budget", action="store_true",
                     help="the cosine ends when the time or CPU budget does, not after --epochs")
    opt.add_argument("--checkpoint-minutes", type=float, default=5.0)
    opt.add_argument("--eval-minutes", type=float, default=15.0, help="held-out τ estimate this often (keeps best/)")
    opt.add_argument("--stage", default="", help="a label for this stage in the drafter's lineage")
    opt.add_argument("--seed", type=int, default=0)
