"""How long a long prompt delays requests that are decoding: chunked prefill, measured.

    python -m tools.prefill_delay [--prompt-tokens 4000] [--decoding 4] [--threads 2]
                                         [--step-tokens N] [--out DIR]

Four requests decode (plain steps, block size 1, so every step is alike); then a prompt of
`--prompt-tokens` tokens arrives. The engine steps every state together as the scheduler
does, with the per-step token budget (`--step-tokens`, the worker's default): each step
prefills at most one chunk of the long prompt beside the decoders' rows. Reported: the
decoders' step time before the prompt arrived, the longest step while it was prefilled
(the delay of their next token), the time of one step with a full chunk, and, for
comparison, the prefill of the whole prompt in one forward (what an unchunked prefill
would have cost every decoder). Writes DIR/prefill_delay.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash.bench.timing import write_json_report
from dflash.engine.costs import cpu_name
from dflash.engine.engine import GenerationRequest
from dflash.engine.knobs import DEFAULT_STEP_TOKENS


def _requests(engine, n: int, prompt_tokens: int):
    vocab = engine.target.vocab_size
    short = [GenerationRequest(input_ids=[(100 + 7 * i + j) % vocab for j in range(32)], max_new_tokens=512,
                               block_size=1) for i in range(n)]
    long = GenerationRequest(input_ids=[(500 + 13 * j) % vocab for j in range(prompt_tokens)], max_new_tokens=1,
                             block_size=1)
    return short, long


def measure(engine, prompt_tokens: int = 4000, decoding: int = 4, step_tokens: int = DEFAULT_STEP_TOKENS) -> dict:
    short, long = _requests(engine, decoding, prompt_tokens)
    states = [engine.admit(r) for r in short]
    while any(s.prefilling for s in states):
        engine.step(states, None)
    base = []
    for _ in range(12):
        t = time.perf_counter()
        engine.step(states, step_tokens)
        base.append(time.perf_counter() - t)
    big = engine.admit(long)
    during = []
    while big.prefilling:
        t = time.perf_counter()
        engine.step(states + [big], step_tokens)
        during.append(time.perf_counter() - t)
    for s in states + [big]:
        engine.release(s)
    # The unchunked alternative: the whole prompt in one forward, while the others wait.
    alone = engine.admit(long)
    t = time.perf_counter()
    engine.step([alone], None)
    whole = time.perf_counter() - t
    engine.release(alone)
    return {
        "prompt_tokens": prompt_tokens, "decoding": decoding, "step_tokens": step_tokens,
        "decode_step_ms": statistics.median(base[2:]) * 1e3,
        "steps_while_prefilling": len(during),
        "max_step_while_prefilling_ms": max(during) * 1e3,
        "median_step_while_prefilling_ms": statistics.median(during) * 1e3,
        "delay_of_next_token_ms": (max(during) - statistics.median(base[2:])) * 1e3,
        "whole_prefill_ms": whole * 1e3,
    }


def main(argv=None) -> int:
    import torch

    from dflash.loading import add_model_args, engine_from_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--decoding", type=int, default=4)
    ap.add_argument("--step-tokens", type=int, default=DEFAULT_STEP_TOKENS)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    engine = engine_from_args(args)
    report = measure(engine, args.prompt_tokens, args.decoding, args.step_tokens)
    report.update(cpu=cpu_name(), threads=torch.get_num_threads(), target=engine.target.name,
                  target_backend=engine.target.backend)
    write_json_report(report, args.out, "prefill_delay.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
