"""The GPU check: one command that measures serving on a CUDA device (`make gpu-check`).

    python -m dflash.bench.gpu_check [--out DIR] [--readme FILE] [--dry-run | --quick]

Three parts, each timed, all in bf16 on `cuda` with the default models (or --target/--drafter):
1. `dflash bench` with methods ar, dflash-auto and dflash-16 on 20 prompts per suite
   (code, chat, agent), 128 new tokens;
2. the step profile (dflash.bench.step_profile) on the device;
3. the load benchmark through the worker socket (dflash.bench.load), concurrency 1 to 64,
   64 requests of 64 tokens.
Writes DIR/gpu_check.json (every part's results and the machine), DIR/gpu_check.md (the
tables) and, with --readme, the `gpu-check` section of that file. The full sizes would take
about 20 minutes on an H200 (estimated from the 2026-12-04 run, a plain step 30 ms there);
`--quick` (8 prompts per suite; load at 1, 8 and 64 callers, 16 requests of 32 tokens) fits
a 15-minute lease. `--dry-run` runs the same code on the CPU in fp32 with tiny sizes (2
prompts, 8 tokens, concurrency 1 and 2), to check the script where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FULL = {"device": "cuda", "dtype": "bfloat16", "limit": 20, "max_new": 128, "concurrency": "1,2,4,8,16,32,64",
        "requests": 64, "load_tokens": 64, "repeats": 7}
# --quick: the same parts sized for a lease of 15 device minutes, the models' transfer included
# (2026-12-04 on an H200 a plain step took 30 ms: FULL would need about 20 minutes).
QUICK = {**FULL, "limit": 8, "concurrency": "1,8,64", "requests": 16, "load_tokens": 32, "repeats": 5}
DRY = {"device": "cpu", "dtype": "float32", "limit": 2, "max_new": 8, "concurrency": "1,2", "requests": 4,
       "load_tokens": 8, "repeats": 1}
METHODS = "ar,dflash-auto,dflash-16"
SUITES = "code,chat,agent"


def machine(device: str) -> dict:
    import torch

    from dflash.engine.costs import cpu_name

    info = {"torch": torch.__version__, "cpu": cpu_name(), "device": device}
    if device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def run_check(args, sizes: dict) -> dict:
    from types import SimpleNamespace

    from dflash.bench import load, step_profile
    from dflash.bench.run import markdown, run_bench, write_report
    from dflash.loading import engine_from_args as load_engine

    out = Path(args.out)
    report = {"sizes": sizes, "machine": machine(sizes["device"]), "parts": {}}
    model_args = SimpleNamespace(target=args.target, drafter=args.drafter, device=sizes["device"],
                                 dtype=sizes["dtype"], threads=args.threads, draft_dtype="auto")
    engine = load_engine(model_args)

    t = time.perf_counter()
    bench = run_bench(engine, SUITES.split(","), METHODS.split(","), sizes["limit"], sizes["max_new"], None,
                      out / "bench" / "samples.jsonl")
    bench["command"] = f"dflash bench --device {sizes['device']} --dtype {sizes['dtype']} --methods {METHODS} " \
                       f"--limit {sizes['limit']} --max-new-tokens {sizes['max_new']}"
    write_report(bench, out / "bench")
    report["parts"]["bench"] = {"seconds": time.perf_counter() - t, "results": bench["results"],
                                "table": markdown(bench)}

    t = time.perf_counter()
    lengths = step_profile.LENGTHS if not args.dry_run else (1, 2, 4)
    profile = step_profile.profile(engine, lengths=lengths, repeats=sizes["repeats"])
    report["parts"]["step_profile"] = {"seconds": time.perf_counter() - t, **profile,
                                       "table": step_profile.table(profile)}
    del engine

    t = time.perf_counter()
    argv = ["--concurrency", sizes["concurrency"], "--requests", str(sizes["requests"]),
            "--max-new-tokens", str(sizes["load_tokens"]), "--max-active", "64", "--out", str(out / "load"),
            "--device", sizes["device"], "--dtype", sizes["dtype"]]
    for flag, value in (("--target", args.target), ("--drafter", args.drafter), ("--threads", args.threads)):
        if value is not None:
            argv += [flag, str(value)]
    load.main(argv)
    loaded = json.loads((out / "load" / "load.json").read_text())
    report["parts"]["load"] = {"seconds": time.perf_counter() - t, **loaded, "table": load.markdown(loaded)}
    return report


def tables(report: dict) -> str:
    m = report["machine"]
    where = m.get("gpu") or m["cpu"]
    parts = report["parts"]
    return (f"GPU check on {where} ({report['sizes']['device']}, {report['sizes']['dtype']}, torch {m['torch']})\n\n"
            f"Bench ({parts['bench']['seconds']:.0f} s):\n\n{parts['bench']['table']}\n"
            f"Step profile ({parts['step_profile']['seconds']:.0f} s):\n\n{parts['step_profile']['table']}\n"
            f"Load through the socket ({parts['load']['seconds']:.0f} s):\n\n{parts['load']['table']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-out/gpu-check")
    ap.add_argument("--readme", help="write the tables into this file's gpu-check section")
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny sizes: check the script without a GPU")
    ap.add_argument("--quick", action="store_true", help="smaller sizes for a 15-minute lease (QUICK)")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args(argv)
    sizes = DRY if args.dry_run else QUICK if args.quick else FULL
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("dflash.bench.gpu_check: no CUDA device (torch.cuda.is_available() is False); "
                             "--dry-run checks the script on the CPU")
    t = time.perf_counter()
    report = run_check(args, sizes)
    report["seconds"] = time.perf_counter() - t
    report["command"] = "python -m dflash.bench.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
    report["revision"] = _revision()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    text = tables(report)
    (out / "gpu_check.md").write_text(text)
    if args.readme:
        from dflash.bench.readme import replace_section

        start, end = "<!-- gpu-check:start -->", "<!-- gpu-check:end -->"
        replace_section(Path(args.readme), start, end,
                        f"{start}\n_Generated by `{report['command']}` ({report['seconds']:.0f} s):_\n\n{text}{end}")
    print(text)
    print(f"written: {out / 'gpu_check.json'} ({report['seconds']:.0f} s)", file=sys.stderr)
    return 0


def _revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
