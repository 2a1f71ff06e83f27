"""The `suffix` method replayed: what its proposer and policy reach on a suite, in seconds.

Plain decoding's greedy outputs say what every verify would keep, so the `suffix` method's
steps can be replayed without the target: the real suffix proposer (its own index of each
request, the suite's workload memory, its pooled calibration) and the real block-length
policy decide every step on the run's cost curve, exactly as in the engine, and an oracle
only says how many of the proposed tokens the target would have kept. Priced by the curve
alone: no lookup price and no per-step bookkeeping, so a measured run lands a little below
it (2-4 % on a 2-core Zen 4). Where the ceiling (dflash.bench.ceiling) says what the
proposer's chains could give at best, this says what the policy gets from them, so a change
to either is judged in seconds instead of a bench run of many minutes:

    python -m dflash.bench.replay RUN_DIR

replays a `dflash bench` run that had `ar` in it (its journal, RUN_DIR/samples.jsonl, holds
the outputs; its results.json the cost curve and the command that gave the suites; run it
from the folder the bench ran in, where its --prompts files are) with the code as it is now,
and prints each suite's replayed speedup beside the run's.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from types import SimpleNamespace

from dflash.chat import chat_prompt_ids
from dflash.engine.calibration import PointMass
from dflash.engine.costs import CostCurve
from dflash.engine.knobs import SpeculativeConfig
from dflash.engine.policy import BlockPolicy
from dflash.engine.proposers.protocol import Offer, RunningPrice
from dflash.engine.proposers.suffix import NAME, SuffixProposer
from dflash.engine.workloads import WorkloadMemory

WORKLOAD = "replay"


def replay_suffix(prompts: list[list[int]], outputs: list[list[int]], verify_s: list[float],
                  timings: list[tuple[float, float]] | None = None, max_new: int = 128,
                  cfg: SpeculativeConfig | None = None) -> dict:
    """The `suffix` method's steps over `prompts` in order as one workload, each request's
    output being plain decoding's greedy one (`outputs`), priced by `verify_s[L-1]`: its
    decoding steps (the first token comes with the prefill, as in the engine), τ,
    `decode_speedup` of the decoding steps over plain ones, and `speedup` of whole
    generations when `timings` gives plain decoding's measured (wall, prefill) seconds per
    prompt (as dflash.bench.ceiling does), else the former."""
    if len(prompts) != len(outputs) or (timings is not None and len(timings) != len(outputs)):
        raise ValueError("one output (and one timing) per prompt")
    cfg = cfg or SpeculativeConfig()
    curve = CostCurve(list(verify_s), [0.0] * len(verify_s))
    max_block = curve.max_block
    memory = WorkloadMemory()
    memory.load(WORKLOAD, [])
    proposer = SuffixProposer(memory, cfg)
    tokens = steps = 0
    plain = replayed = 0.0
    whole = [0.0, 0.0]
    for n, (prompt, output) in enumerate(zip(prompts, outputs)):
        cost, taken = _request(proposer, curve, cfg, list(prompt), list(output), max_new, max_block) if output else (
            0.0, 0)
        steps += taken
        if output:  # as the engine does when a generation finishes
            memory.remember(WORKLOAD, list(output))
        tokens += len(output)
        # Plain decoding's steps: one per token after the first, which comes with the prefill.
        plain_s = max(len(output) - 1, 0) * verify_s[0]
        plain += plain_s
        replayed += cost
        if timings is not None and plain_s:
            wall, prefill = timings[n]
            whole[0] += wall
            whole[1] += prefill + (wall - prefill) * cost / plain_s
    decode = plain / replayed if replayed else None
    return {"tokens": tokens, "steps": steps, "tau": tokens / steps if steps else None, "decode_speedup": decode,
            "speedup": whole[0] / whole[1] if timings is not None and whole[1] else decode}


def _request(proposer: SuffixProposer, curve: CostCurve, cfg: SpeculativeConfig, prompt: list[int], output: list[int],
             max_new: int, max_block: int) -> tuple[float, int]:
    """(seconds, steps) of one request's decoding steps; its first token came with the prefill."""
    # (no answer form: the replay prices the suffix proposer's chains alone)
    state = SimpleNamespace(prompt_ids=prompt, output_ids=output[:1], workload=WORKLOAD, proposals={}, constraint=None)
    state.proposals[NAME] = proposer.start(state)
    policy = BlockPolicy(curve, max_block, cfg,
                         {NAME: PointMass(cfg, max_block - 1, proposer.prior(WORKLOAD, cfg.max_prior_strength))})
    free = RunningPrice(0.0)  # no lookup price (the engine adds its measured one): the same inputs replay the same
    cost, steps = 0.0, 0
    while len(state.output_ids) < len(output):
        i = len(state.output_ids)
        most = min(max_new - i, policy.max_block)
        chain = proposer.propose([(state, most)])[0] if most > 1 else None
        policy.price(curve.solo())
        chosen, n = policy.choose([Offer(NAME, proposer, chain, free)] if chain is not None and len(chain.tokens) else [])
        drafts = chain.tokens[: n - 1].tolist() if chosen is not None else []
        kept = 0
        while kept < len(drafts) and i + kept < len(output) and drafts[kept] == output[i + kept]:
            kept += 1
        if chosen is not None:
            policy.observe(chosen, chain.confidence, len(drafts) + 1, kept, n)
            proposer.learn(WORKLOAD, chain.confidence, len(drafts) + 1, kept)
        else:
            policy.observe(None, [], 1, 0, 1)
        state.output_ids = output[: i + kept + 1]
        cost += curve.verify_s[len(drafts)]
        steps += 1
    return cost, steps


def replay_run(run_dir: Path) -> list[dict]:
    """Every suite of a bench run replayed with the code as it is now, beside the run's own
    `suffix` and `dflash-auto` speedups."""
    from transformers import AutoTokenizer

    from dflash.bench.args import add_bench_args
    from dflash.loading import add_model_args
    from dflash.model_files import ensure_default_target
    from dflash.suites import load_prompts_file, load_suite

    missing = [f for f in ("results.json", "samples.jsonl") if not (run_dir / f).is_file()]
    if missing:
        raise SystemExit(f"{run_dir}: no {missing[0]} (not the --out folder of a `dflash bench` run)")
    report = json.loads((run_dir / "results.json").read_text())
    if "verify_s" not in report:
        raise SystemExit(f"{run_dir}: the run used no cost curve (no suffix or dflash method)")
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_bench_args(parser)
    args = parser.parse_args(shlex.split(report["command"])[2:])  # after "dflash bench"
    tokenizer = AutoTokenizer.from_pretrained(args.target or ensure_default_target(quiet=True))
    journal: dict[tuple[str, int], dict] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("method") == "ar":
            journal[(row["suite"], row["index"])] = row
    suites = [s for s in args.suites.split(",") if s and s != "none"]
    missing = [f for f in args.prompts if not Path(f).is_file()]
    if missing:
        raise SystemExit(f"the run's prompts file {missing[0]} is not here: replay from the folder the bench ran in")
    texts = [(s, load_suite(s, args.limit)) for s in suites] + [(Path(f).stem, load_prompts_file(f))
                                                               for f in args.prompts]
    got = {(r["suite"], r["method"]): r.get("speedup_vs_ar") for r in report["results"]}
    out = []
    for suite, prompts_text in texts:
        rows = [journal.get((suite, i)) for i in range(len(prompts_text))]
        if not all(rows):
            raise SystemExit(f"{run_dir}: suite {suite} has no `ar` output for every prompt")
        prompts = [chat_prompt_ids(tokenizer, t) for t in prompts_text]
        if any(len(p) != r["prompt_len"] for p, r in zip(prompts, rows)):
            raise SystemExit(f"{run_dir}: suite {suite}'s prompts tokenise differently now")
        r = replay_suffix(prompts, [r["output_ids"] for r in rows], report["verify_s"],
                          [(r["wall_s"], r["prefill_s"]) for r in rows], args.max_new_tokens)
        out.append({"suite": suite, **r, "suffix_reached": got.get((suite, "suffix")),
                    "dflash_auto_reached": got.get((suite, "dflash-auto"))})
    return out


def replay_table(rows: list[dict]) -> str:
    out = ["| suite | replayed tau | replayed speedup | suffix reached | dflash-auto reached |",
           "|---|---|---|---|---|"]
    for r in rows:
        cells = [r["suffix_reached"], r["dflash_auto_reached"]]
        out.append(f"| {r['suite']} | {r['tau']:.2f} | {r['speedup']:.2f} | "
                   + " | ".join("-" if x is None else f"{x:.2f}" for x in cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.bench.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a `dflash bench --out` folder of a run with `ar` in it")
    args = p.parse_args(argv)
    print(replay_table(replay_run(args.run_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
