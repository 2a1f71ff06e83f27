"""The suffix proposer's ceiling: what it could give on a suite at best, on this device.

Replays a suite as one workload (prompts in order, each output joining the memory after
it, as the bench runs it) and asks the suffix proposer (dflash.engine.proposers.suffix)
for its chain at every step, then lets an oracle that knows the answer verify exactly as
far as the chain is right (shorter only where verifying that many costs more than plain
steps would on this device's cost curve). No lookup price, no policy, no drafter: about the
most the `suffix` method can reach (a policy without foresight gets less), and the most
`dflash-auto` can where the drafter is rarely worth its pass. A suite whose ceiling is well
below a speed goal does not reach it with this proposer on this device, whatever the
policy does.
"""

from __future__ import annotations

from dflash.engine.proposers.suffix import chain
from dflash.engine.proposers.suffix_index import SuffixIndex


def suffix_ceiling(prompts: list[list[int]], outputs: list[list[int]], verify_s: list[float],
                   timings: list[tuple[float, float]] | None = None) -> dict:
    """τ and speedup over plain steps of the oracle above, for greedy `outputs` of `prompts`
    (plain decoding's), priced by `verify_s[L-1]` (seconds to verify L tokens): `decode_speedup`
    of the decoding steps alone; `speedup` of whole generations when `timings` gives plain
    decoding's measured (wall, prefill) seconds per prompt (the prefill is the same for every
    method, and each prompt's decoding shrinks by its oracle's ratio), else the former; and
    how often the chain was right for exactly k tokens (`kept_histogram[k]`)."""
    if len(prompts) != len(outputs) or (timings is not None and len(timings) != len(outputs)):
        raise ValueError("one output (and one timing) per prompt")
    max_block = len(verify_s)
    memory = SuffixIndex()
    tokens = steps = 0
    plain = oracle = 0.0
    whole = [0.0, 0.0]  # plain decoding's wall, and the oracle's
    kept: list[int] = [0] * max_block
    for n, (prompt, output) in enumerate(zip(prompts, outputs)):
        prompt = list(prompt)
        own = SuffixIndex()
        own.add(0, prompt)
        i, cost = 0, 0.0
        while i < len(output):
            drafts, _ = chain([own, memory], prompt, output[:i], max_block - 1)
            k = 0
            # Kept drafts and the target's own token must fit in the output.
            while k < len(drafts) and i + k + 1 < len(output) and drafts[k] == output[i + k]:
                k += 1
            kept[k] += 1
            # All it got right, unless verifying that many costs more than decoding them plainly.
            L = max(x for x in range(1, k + 2) if x == 1 or verify_s[x - 1] <= x * verify_s[0])
            own.extend(0, output[i:i + L])
            cost += verify_s[L - 1]
            i += L
            steps += 1
        tokens += len(output)
        plain += len(output) * verify_s[0]
        oracle += cost
        if timings is not None and output:
            wall, prefill = timings[n]
            whole[0] += wall
            whole[1] += prefill + (wall - prefill) * cost / (len(output) * verify_s[0])
        if output:
            memory.add(n, list(output))
    decode = plain / oracle if oracle else None
    return {"tokens": tokens, "steps": steps, "tau": tokens / steps if steps else None, "decode_speedup": decode,
            "speedup": whole[0] / whole[1] if timings is not None and whole[1] else decode, "kept_histogram": kept}


def ceiling_table(results: list[dict]) -> str:
    """Markdown: each suite's ceiling beside what `suffix` and `dflash-auto` reached."""
    rows = [r for r in results if r.get("suffix_ceiling")]
    if not rows:
        return ""
    got = {(r["suite"], r["method"]): r.get("speedup_vs_ar") for r in results}
    out = ["", "The suffix proposer's ceiling (dflash.bench.ceiling: an oracle verifying exactly as far as its chain "
           "is right, on this run's cost curve, no lookup price; whole generations, plain decoding's prefill "
           "kept), and its policy replayed on the same outputs and prices (dflash.bench.replay: no lookup "
           "price, no per-step bookkeeping):", "",
           "| suite | ceiling tau | ceiling speedup | policy replayed | suffix reached | dflash-auto reached |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        c = r["suffix_ceiling"]
        replay = (r.get("suffix_replay") or {}).get("speedup")
        reached = [replay] + [got.get((r["suite"], m)) for m in ("suffix", "dflash-auto")]
        out.append(f"| {r['suite']} | {c['tau']:.2f} | {c['speedup']:.2f} | "
                   + " | ".join("-" if x is None else f"{x:.2f}" for x in reached) + " |")
    return "\n".join(out) + "\n"
