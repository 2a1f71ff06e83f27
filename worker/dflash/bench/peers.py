"""`make peers`: llama.cpp beside our engine, on the same weights and prompts.

1. builds llama.cpp from the llama-cpp-python sdist (once, into the model cache);
2. converts the target to GGUF F32 with llama.cpp's converter, and our shipped drafter
   with `dflash convert` (F32 and as stored);
3. converts the same drafter with llama.cpp's own DFlashModel converter and checks that
   both files hold the same keys and the same tensors, byte for byte (the provenance keys
   `general.name` etc. that llama.cpp derives from the folder name, and our
   `pg_dflash.hf_config`, are the only allowed differences), and that llama.cpp's file
   reads back into our drafter bit for bit;
4. runs `dflash bench` with our `ar`/`dflash-16` and llama.cpp's `llamacpp-ar` /
   `llamacpp-dflash` (and both with the target as it ships, Q4_1) on N prompts per
   suite, then checks that llama.cpp's DFlash output equals its own plain decoding
   prompt by prompt (F32 target), and that its tau is within 10 % of ours per suite.

Everything lands in OUT (default bench-out/peers): the bench's files and peers.json with
every check. `--write-golden` refreshes tests/golden/dflash_gguf_layout.json from
llama.cpp's converter (the default test suite compares our converter with it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from dflash.bench import llamacpp
from dflash.convert.gguf_file import CONFIG_KEY

# Keys llama.cpp's converter derives from the folder name (ours writes general.name only).
PROVENANCE_KEYS = {"general.name", "general.basename", "general.finetune", "general.size_label"}
GOLDEN = Path(__file__).resolve().parents[3] / "tests" / "golden" / "dflash_gguf_layout.json"
TAU_TOLERANCE = 0.10


def gguf_layout(path: Path, with_data: bool = True) -> tuple[dict, dict]:
    """keys -> (value types, value); tensors -> (GGML type, shape, bytes)."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    keys = {k: ([t.name for t in f.types], f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, [int(x) for x in t.shape],
                        bytes(np.ascontiguousarray(t.data).view(np.uint8)) if with_data else None) for t in r.tensors}
    return keys, tensors


def compare_layouts(ours: Path, theirs: Path) -> dict:
    ko, to = gguf_layout(ours)
    kt, tt = gguf_layout(theirs)
    allowed = PROVENANCE_KEYS | {CONFIG_KEY}
    return {
        "ours": str(ours),
        "llama_cpp": str(theirs),
        "keys_only_ours": sorted(set(ko) - set(kt) - allowed),
        "keys_only_llama_cpp": sorted(set(kt) - set(ko) - allowed),
        "keys_differing": sorted(k for k in set(ko) & set(kt) - allowed if ko[k] != kt[k]),
        "provenance_keys_not_compared": sorted((set(ko) | set(kt)) & allowed),
        "tensors_only_ours": sorted(set(to) - set(tt)),
        "tensors_only_llama_cpp": sorted(set(tt) - set(to)),
        "tensors_differing": sorted(n for n in set(to) & set(tt) if to[n] != tt[n]),
        "tensors_compared": len(set(to) & set(tt)),
    }


def layout_equal(report: dict) -> bool:
    return not any(report[k] for k in ("keys_only_ours", "keys_only_llama_cpp", "keys_differing",
                                       "tensors_only_ours", "tensors_only_llama_cpp", "tensors_differing"))


def golden_layout(path: Path) -> dict:
    """What tests/golden holds: every key with its types (and its value, except the long
    tokenizer lists), every tensor with its type and shape."""
    keys, tensors = gguf_layout(path, with_data=False)
    long = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.chat_template")
    return {
        "source": f"llama.cpp's converter (vendor/llama.cpp/convert_hf_to_gguf.py in {llamacpp.SDIST} "
                  f"{llamacpp.VERSION}) on the shipped drafter, --outtype auto",
        "provenance_keys": sorted(PROVENANCE_KEYS),
        "keys": {k: {"types": t, "value": None if k in long else v} for k, (t, v) in keys.items()},
        "tensors": {n: {"type": t, "shape": s} for n, (t, s, _) in tensors.items()},
    }


def check_layouts(target_dir: Path, target_file: Path, drafter: Path, work: Path, write_golden: bool) -> dict:
    from dflash.convert import convert_drafter
    from dflash.convert.gguf_file import read_gguf_drafter
    from dflash.engine.drafter import read_drafter_folder

    out = {}
    for outtype in ("auto", "f32"):
        theirs = llamacpp.llamacpp_convert(drafter, work / f"drafter-llamacpp-{outtype}.gguf", outtype, target_dir)
        ours = convert_drafter(drafter, "gguf", work / f"drafter-ours-{outtype}.gguf", target=target_file,
                               outtype=outtype)
        report = compare_layouts(ours, theirs)
        # llama.cpp's file, read by our loader (it lacks our config key: the target gives the
        # layer count), must give back the published tensors bit for bit.
        cfg, state = read_gguf_drafter(theirs, num_target_layers=cfg_layers(target_dir))
        _, original = read_drafter_folder(drafter)
        report["llama_cpp_file_reads_back_bit_identical"] = all(
            _bits_equal(state[k].to(original[k].dtype), original[k]) for k in original) and set(state) == set(original)
        report["equal"] = layout_equal(report)
        out[outtype] = report
        if write_golden and outtype == "auto":
            GOLDEN.parent.mkdir(parents=True, exist_ok=True)
            GOLDEN.write_text(json.dumps(golden_layout(theirs), indent=1, sort_keys=True) + "\n")
    return out


def _bits_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def cfg_layers(target_dir: Path) -> int:
    cfg = json.loads((target_dir / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["num_hidden_layers"])


def check_runs(out: Path) -> dict:
    """From the bench's journal and results, per suite: each llama.cpp DFlash method's output
    equals the same runtime's plain decoding on the same weights, prompt by prompt, and
    llama.cpp's tau on the F32 target (our weights) vs our dflash-16's."""
    results = json.loads((out / "results.json").read_text())
    rows = {(r["suite"], r["method"]): r for r in results["results"]}
    samples = {}
    for line in (out / "samples.jsonl").read_text().splitlines()[1:]:
        r = json.loads(line)
        samples[(r["suite"], r["method"], r["index"])] = r["output_ids"]
    checks = {}
    for suite in sorted({s for s, _ in rows}):
        idx = sorted(i for s, m, i in samples if s == suite and m == "llamacpp-ar")
        pairs = {m: llamacpp.plain_of(m) for s, m in rows if s == suite and llamacpp.is_dflash_peer(m)}
        ours, theirs = rows[(suite, "dflash-16")]["tau"], rows[(suite, "llamacpp-dflash")]["tau"]
        checks[suite] = {
            "prompts": len(idx),
            "dflash_vs_ar_mismatches": {m: [i for i in idx if samples.get((suite, m, i)) != samples.get((suite, ar, i))]
                                        for m, ar in pairs.items()},
            "llamacpp_ar_vs_ours_mismatches": rows[(suite, "llamacpp-ar")]["greedy_mismatches"],
            "tau_ours_dflash16": ours,
            "tau_llamacpp": {m: rows[(suite, m)]["tau"] for m in pairs},
            "tau_relative_difference": (theirs - ours) / ours if ours and theirs else None,
            "tau_within_10_percent": bool(ours and theirs and abs(theirs - ours) <= TAU_TOLERANCE * ours),
        }
    return checks


README_START, README_END = "<!-- peers-results:start -->", "<!-- peers-results:end -->"


def readme_section(report: dict, results: dict, command: str) -> str:
    from dflash.bench.run import markdown

    layout = report["layout"]
    rows = ["| suite | prompts | llama.cpp DFlash vs its own AR, same weights: differing outputs | llama.cpp AR (F32) "
            "vs ours: differing outputs | tau ours (dflash-16) | tau llama.cpp DFlash (F32) | difference |",
            "|---|---|---|---|---|---|---|"]
    for suite, c in report["runs"].items():
        diff = c["tau_relative_difference"]
        same = ", ".join(f"{m}: {len(v)}" for m, v in c["dflash_vs_ar_mismatches"].items())
        rows.append(f"| {suite} | {c['prompts']} | {same} | {c['llamacpp_ar_vs_ours_mismatches']} | "
                    f"{c['tau_ours_dflash16']:.3f} | {c['tau_llamacpp']['llamacpp-dflash']:.3f} | "
                    f"{'-' if diff is None else f'{100 * diff:+.1f} %'} |")
    conv = "; ".join(f"{t}: {'same keys and tensors' if r['equal'] else 'DIFFERENT'} "
                     f"({r['tensors_compared']} tensors byte for byte), llama.cpp's file reads back "
                     f"{'bit-identical' if r['llama_cpp_file_reads_back_bit_identical'] else 'DIFFERENT'}"
                     for t, r in layout.items())
    return (f"{README_START}\n_Generated by `{command}` from its own run:_\n\n{markdown(results)}\n"
            f"Checks:\n\n" + "\n".join(rows) + f"\n\nConverters (`--outtype` {conv}).\n{README_END}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.bench.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-out/peers")
    ap.add_argument("--limit", type=int, default=20, help="prompts per suite")
    ap.add_argument("--suites", default="code,chat,agent")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, help="build jobs (default: all cores)")
    ap.add_argument("--methods", default="ar,dflash-16,llamacpp-ar,llamacpp-dflash,llamacpp-ar-q4_1,llamacpp-dflash-q4_1")
    ap.add_argument("--build-only", action="store_true", help="build llama.cpp and stop")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted bench run in OUT")
    ap.add_argument("--write-golden", action="store_true", help=f"refresh {GOLDEN.relative_to(GOLDEN.parents[2])}")
    ap.add_argument("--readme", help="write the results into this README between the peers-results markers")
    args = ap.parse_args(argv)
    needed = {"dflash-16", "llamacpp-ar", "llamacpp-dflash"} - set(args.methods.split(","))
    if needed:
        ap.error(f"--methods must include {', '.join(sorted(needed))} (the checks compare them)")

    from dflash.errors import DFlashError
    from dflash.model_files import ensure_default_drafter, ensure_default_target

    try:
        llamacpp.ensure_built(args.jobs)
        if args.build_only:
            return 0
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        target_dir = ensure_default_target()
        drafter, is_random = ensure_default_drafter(target_dir)
        target_file = llamacpp.target_gguf(target_dir, "f32")
        report = {"llama_cpp": f"{llamacpp.SDIST} {llamacpp.VERSION}", "target_gguf": str(target_file),
                  "drafter": str(drafter), "random_drafter": is_random}
        report["layout"] = check_layouts(target_dir, target_file, drafter, llamacpp.home() / "models",
                                         args.write_golden)
        (out / "peers.json").write_text(json.dumps(report, indent=2) + "\n")
        bench = ["bench", "--threads", str(args.threads), "--suites", args.suites, "--methods", args.methods,
                 "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out)]
        # `dflash bench` in a process of its own (the bench sits below the CLI)
        rc = subprocess.run([sys.executable, "-m", "dflash.cli", *bench, *(["--resume"] if args.resume else [])]).returncode
        if rc:
            return rc
        report["runs"] = check_runs(out)
    except DFlashError as exc:
        print(f"dflash: error: {exc.message}", file=sys.stderr)
        return 2
    (out / "peers.json").write_text(json.dumps(report, indent=2) + "\n")
    ok = all(r["equal"] and r["llama_cpp_file_reads_back_bit_identical"] for r in report["layout"].values())
    ok &= all(not any(c["dflash_vs_ar_mismatches"].values()) and c["tau_within_10_percent"]
              for c in report["runs"].values())
    print(json.dumps({"layout": {k: v["equal"] for k, v in report["layout"].items()}, "runs": report["runs"]}, indent=2))
    if args.readme:
        from dflash.bench.readme import replace_section

        command = "python -m dflash.bench.peers " + " ".join(argv if argv is not None else sys.argv[1:])
        results = json.loads((out / "results.json").read_text())
        replace_section(Path(args.readme), README_START, README_END, readme_section(report, results, command))
    print(f"peers: {'all checks pass' if ok else 'SOME CHECKS FAIL'}; details in {out / 'peers.json'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
