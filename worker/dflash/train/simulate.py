"""A fast τ estimate: the greedy speculative loop replayed from teacher-forced drafts.

With greedy decoding the target's output is fixed in advance: it is its greedy answer.
So every block the engine would draft can be computed at once: for each position p of
the answer, the drafter's block anchored at p (context features before p, slot 0 the
token at p) gives a draft, and its accepted length a(p) is how many leading drafts equal
the answer's next tokens. The loop is then replayed without the target: start at the
first answer token, commit a(p) + 1 tokens, move on, until max_new_tokens or eos, and
τ = (accepted + steps) / steps pooled over all steps, as `dflash bench` reports it.

Drafts are computed slot by slot (slot k's LM head only for blocks whose slots 1..k-1
all matched), so the head, the costliest part, runs a few times per block, not 15.

    python -m dflash.train.simulate --drafter DIR --bench code,chat --limit 40
    python -m dflash.train.simulate --drafter DIR --corpus-heldout 32

`--bench` answers the bench prompts once with the target (cached under
~/.cache/pg_dflash/simulate) and computes their features in fp32, as the engine does,
so its τ should match `dflash bench --methods dflash-16` on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash.train.blockwise import forward_blocks
from dflash.engine.stats import pooled_tau

HELDOUT_GROUPS = ("code", "chat")


def accepted_lengths(drafter, embed: torch.Tensor, head: torch.Tensor, feats: torch.Tensor, ids: torch.Tensor,
                     anchors: torch.Tensor, use_autocast: bool = False, chunk: int = 64) -> torch.Tensor:
    """[A] accepted drafts of the block at each anchor (teacher-forced context)."""
    L = drafter.config.block_size
    T = len(ids)
    out = []
    for s in range(0, len(anchors), chunk):
        a = anchors[s : s + chunk]
        blocks = torch.full((len(a), L), drafter.config.mask_token_id, dtype=torch.long, device=ids.device)
        blocks[:, 0] = ids[a]
        ctx = torch.autocast(feats.device.type, dtype=torch.bfloat16) if use_autocast else torch.autocast(
            feats.device.type, enabled=False)
        with torch.inference_mode(), ctx:
            hidden = forward_blocks(drafter, feats[None], embed[blocks][None], a[None])[0]
            accepted = torch.zeros(len(a), dtype=torch.long, device=ids.device)
            alive = torch.ones(len(a), dtype=torch.bool, device=ids.device)
            for k in range(1, L):
                pos = a + k
                alive &= pos < T
                rows = alive.nonzero()[:, 0]
                if not len(rows):
                    break
                draft = (hidden[rows, k].float() @ head.float().t()).argmax(-1)
                hit = draft == ids[pos[rows]]
                alive[rows] = hit
                accepted[rows[hit]] += 1
        out.append(accepted)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def replay(ids: list[int], response_start: int, accepted: dict[int, int], max_new_tokens: int,
           eos_ids: set[int]) -> list[int]:
    """The accepted counts of the steps the greedy loop takes over one answer."""
    steps = []
    p = response_start  # the first answer token comes from the prefill; it anchors the first block
    produced = 1
    if ids[p] in eos_ids:
        return steps
    while produced < max_new_tokens and p in accepted:
        a = accepted[p]
        steps.append(a)
        committed = ids[p + 1 : p + a + 2]
        produced += a + 1
        p += a + 1
        if any(t in eos_ids for t in committed) or p >= len(ids):
            break
    return steps


def simulate_tau(drafter, target, store, seqs: list[dict], max_new_tokens: int = 128, use_autocast: bool = False,
                 group_of=None) -> dict:
    """Pooled τ over `seqs` (sequences of a feature store), overall and per group."""
    embed = target.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    dev = head.device
    eos = set(target.eos_ids)
    group_of = group_of or (lambda s: s.get("group", "all"))
    steps_by: dict[str, list[int]] = {}
    was_training = drafter.training
    drafter.eval()
    for seq in seqs:
        ids = torch.tensor(seq["ids"], device=dev)
        rs = seq["response_start"]
        hi = min(len(ids) - 1, rs + max_new_tokens)
        anchors = torch.arange(rs, hi, device=dev)
        feats = store.features(seq, torch.float32).to(dev)
        acc = accepted_lengths(drafter, embed, head, feats, ids, anchors, use_autocast)
        steps = replay(seq["ids"], rs, dict(zip(anchors.tolist(), acc.tolist())), max_new_tokens, eos)
        steps_by.setdefault(group_of(seq), []).extend(steps)
    drafter.train(was_training)

    def tau(steps):
        return pooled_tau(sum(steps), len(steps))

    every = [a for v in steps_by.values() for a in v]
    return {"tau": tau(every), "steps": len(every), "by_group": {g: round(tau(v), 4) for g, v in steps_by.items()},
            "sequences": len(seqs)}


def heldout_split(records: list[dict], per_group: int) -> dict[str, str]:
    """{prompt: group} for the first `per_group` HumanEval-shaped stubs ("code") and
    topic / instruction-list prompts ("chat") of `records` in their order (the corpus's
    order is random): the held-out answers for τ estimates, never trained on."""
    from dflash.train.corpus import source_of

    src = source_of([r["prompt"] for r in records])
    picked: dict[str, str] = {}
    count = dict.fromkeys(HELDOUT_GROUPS, 0)
    for r in records:
        p = r["prompt"]
        g = "code" if p.startswith("def ") else "chat" if src[p] in ("topics", "project") else None
        if g and count[g] < per_group:
            picked[p] = g
            count[g] += 1
    return picked


def with_groups(sequences: list[dict], groups: dict[str, str]) -> list[dict]:
    """The store's sequences whose prompts are in `groups`, each tagged with its group."""
    return [{**s, "group": groups[s["prompt"]]} for s in sequences if s["prompt"] in groups]


def bench_store(target, layer_ids: list[int], suites: list[str], limit: int, max_new_tokens: int, cache_dir: Path):
    """The bench prompts' greedy answers (answered once, one at a time like the engine, and
    cached) with fp32 features in memory: (store, its sequences with "group" = suite)."""
    from dflash.suites import load_suite
    from dflash.train.data import load_records, regenerate
    from dflash.train.features import DeviceFeatures

    records = []
    for suite in suites:
        f = Path(cache_dir) / f"{target.name}-{suite}-{max_new_tokens}.jsonl"
        prompts = load_suite(suite, limit)
        regenerate(target, prompts, f, max_new_tokens=max_new_tokens, batch_size=1)
        by_prompt = {r["prompt"]: r for r in load_records(f)}
        records += [{**by_prompt[p], "group": suite} for p in prompts]
    store = DeviceFeatures().build(target, records, layer_ids, min_response=1, feature_dtype=torch.float32)
    group = {r["prompt"]: r["group"] for r in records}
    return store, [{**s, "group": group[s["prompt"]]} for s in store.sequences]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, action="append", help="drafter folder (repeat to compare several)")
    p.add_argument("--target", help="target folder (default: the embedded SmolLM2)")
    p.add_argument("--bench", help="comma-separated bench suites (code,chat)")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--corpus-heldout", type=int, help="held-out corpus answers per group (needs --features)")
    p.add_argument("--features", help="a feature cache directory (for --corpus-heldout)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--autocast", action="store_true", help="bf16 drafter matmuls (faster, not the engine's numerics)")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args(argv)

    from dflash.loading import load_drafter
    from dflash.engine.target.hf import HFTarget
    from dflash.model_files import default_target_dir, ensure_default_target

    target = HFTarget.from_pretrained(args.target or ensure_default_target())
    drafters = [load_drafter(d) for d in args.drafter]
    layer_ids = drafters[0].config.target_layer_ids
    if any(d.config.target_layer_ids != layer_ids for d in drafters):
        raise SystemExit("compare drafters of the same target layers only (they share the features)")
    t = time.monotonic()
    if args.bench:
        cache_dir = Path(default_target_dir()).parent / "simulate"
        store, seqs = bench_store(target, layer_ids, args.bench.split(","), args.limit, args.max_new_tokens, cache_dir)
    else:
        from dflash.train.features import FeatureCache

        from dflash.train.corpus import load_corpus

        store = FeatureCache(Path(args.features))
        seqs = with_groups(store.sequences, heldout_split(load_corpus(), args.corpus_heldout or 32))
    results = []
    for name, drafter in zip(args.drafter, drafters):
        res = simulate_tau(drafter, target, store, seqs, args.max_new_tokens, use_autocast=args.autocast)
        res.update(drafter=str(name), seconds=round(time.monotonic() - t, 1), autocast=args.autocast)
        print(json.dumps(res, indent=2), flush=True)
        results.append(res)
    if args.out:
        Path(args.out).write_text(json.dumps(results if len(results) > 1 else results[0], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
