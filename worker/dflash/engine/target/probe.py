"""Whether a native target backend runs on this machine at all: probed once, in a child process.

A backend built from native code can die on a CPU it was not built for, and a dead worker
tells nobody why: llama.cpp's AMX kernels fault on the Xeons here (SIGSEGV inside
`llama_decode`, although the kernel grants the tile permission, so only running the kernel
tells). So the first time a backend runs for a key (the CPU as `costs.cpu_name` names it, the
target, and the backend's build: runtime versions, the native library's file, the export's
build, the GGUF file it reads), a child process loads it and runs a short batched decode
with features, teacher-forced on the reference path's greedy tokens (the hf backend, in a
child of its own, cached as well).
The verdict is kept in the model cache (dflash.model_files.probe_dir):
- usable: it ran, and at every position its greedy token is among the reference's TOP_K and
  equals the reference's own on at least AGREE of them (a quantized runtime may differ where two
  logits are close; a broken kernel gives garbage);
- unusable, with the reason: killed by a signal (its name), no answer within the time limit,
  an error, or disagreement (the counts).
A clean error while loading (a file the backend cannot read) is the caller's, raised as it
was and not kept: it says nothing of this CPU.
`auto` chooses among usable backends; a backend asked for by name that failed is a clean
`backend_unusable` error naming the backend, the reason and the CPU. A later start reads the
verdict and does not probe again; `dflash doctor --reprobe` forgets this CPU's verdicts.

The hf backend (PyTorch) is the reference and is not probed itself.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dflash.errors import DFlashError

KIND = "backend-probe"
FORMAT = 3  # of a verdict: a kept one of another format is probed again (2: the features asked apart)
REFERENCE = "hf"
MARK = "dflash-probe: "  # the child's answers on stdout; anything else it prints is noise
PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")
NEW_TOKENS = 6
TOP_K = 5
AGREE = 0.5  # the least share of positions where the backend's greedy token is the reference's
LOAD_TIMEOUT_S = float(os.environ.get("DFLASH_PROBE_LOAD_TIMEOUT_S", 900))  # a first export can take minutes
RUN_TIMEOUT_S = float(os.environ.get("DFLASH_PROBE_TIMEOUT_S", 120))  # the decode itself: seconds


@dataclass
class Spec:
    """How a child builds the target: `builder` ("module:function") called with `kwargs`,
    returning a Target. JSON both ways."""

    builder: str
    kwargs: dict = field(default_factory=dict)


@dataclass
class Verdict:
    backend: str
    usable: bool
    reason: str | None
    cpu: str
    probed_at: str
    seconds: float
    key: dict
    agreement: dict | None = None
    # Whether it gives the layer features a DFlash drafter reads (None: not asked, as for
    # a backend that failed before); `features_reason`: why not.
    features: bool | None = None
    features_reason: str | None = None
    # The clean error the backend raised while loading (a file it cannot read, say): a fact
    # of what it was given, not of this CPU, so such a verdict is not kept.
    error_code: str | None = None

    def line(self) -> str:
        if not self.key:
            return "usable (the reference: not probed)"
        if not self.usable:
            return f"UNUSABLE: {self.reason}"
        return "usable" if self.features else f"usable without layer features (no DFlash drafter): {self.features_reason}"


def build_of(backend: str) -> dict:
    """What decides whether `backend`'s native code runs here, besides the CPU and what the
    caller adds (an export's build): its runtime's version and, for llama.cpp, its library
    files (a rebuild with other flags changes them)."""
    from dflash.engine.target.fastest import runtime_versions

    versions = runtime_versions()
    if backend == "llamacpp":
        return {"llama-cpp-python": versions["llama-cpp-python"], "library": _library_stamp()}
    if backend.startswith("ort"):
        return {"onnxruntime": versions["onnxruntime"]}
    return {"torch": versions["torch"]}


def _library_stamp() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("lib/lib*.so*"))
    return ";".join(_stat_stamp(p.name, p.stat()) for p in libs) or None


def _stat_stamp(label: str, st) -> str:
    """A file's name or path with its size and time: what a verdict's key holds of a file."""
    return f"{label}:{st.st_size}:{int(st.st_mtime)}"


def file_stamp(path: str | Path | None) -> str | None:
    """A model file as a verdict's key holds it: a native backend that ran one GGUF says
    nothing of another given for the same target (a file it cannot load would otherwise mark
    the backend unusable for every file of that target)."""
    if path is None:
        return None
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return str(path.resolve())
    return _stat_stamp(str(path.resolve()), st)


def key_of(backend: str, target_dir: str | Path, build: dict | None = None) -> dict:
    from dflash.engine.costs import cpu_name

    return {"backend": backend, "cpu": cpu_name(), "target": Path(target_dir).name,
            "build": {**build_of(backend), **(build or {})}, "format": FORMAT}


def _path(directory: Path, key: dict) -> Path:
    from dflash.engine.costs import keyed_file

    return keyed_file(directory, KIND, key)


def cached(directory: Path, key: dict) -> Verdict | None:
    try:
        got = json.loads(_path(directory, key).read_text())
        verdict = Verdict(**got)
    except (OSError, ValueError, TypeError):
        return None
    return verdict if verdict.key == key else None


def verdicts(directory: Path, cpu: str | None = None) -> list[Verdict]:
    """Every verdict kept in `directory` (for this CPU only, where `cpu` is given)."""
    out = []
    for path in sorted(Path(directory).glob(f"{KIND}-*.json")):
        try:
            v = Verdict(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if cpu is None or v.cpu == cpu:
            out.append(v)
    return out


def forget(directory: Path, cpu: str) -> int:
    """Drop this CPU's verdicts (and the reference's tokens), so the next start probes again."""
    n = 0
    for path in Path(directory).glob(f"{KIND}-*.json"):
        try:
            if json.loads(path.read_text()).get("cpu") == cpu:
                path.unlink()
                n += 1
        except (OSError, ValueError):
            continue
    return n


def verdict(backend: str, target_dir: str | Path, spec: Spec, reference: Spec | None, directory: Path,
            build: dict | None = None) -> Verdict:
    """The kept verdict for `backend` on this machine and target, else a probe's (then kept).
    `build`: what else makes the backend's code (an export's build)."""
    key = key_of(backend, target_dir, build)
    got = cached(directory, key)
    if got is not None:
        return got
    ref = reference_tokens(target_dir, reference, directory) if reference is not None else None
    v = _probe(backend, key, spec, ref)
    if v.error_code is None:
        _keep(_path(directory, key), asdict(v))
    return v


def _keep(path: Path, record: dict) -> None:
    """Keep a verdict; where the cache cannot be written (a read-only model folder) the verdict
    still holds for this process, and the next start probes again."""
    from dflash.engine.costs import write_keyed

    try:
        write_keyed(path, record)
    except OSError as exc:
        print(f"dflash: warning: cannot keep a backend probe's verdict in {path.parent} ({exc}); "
              "the next start probes again", file=sys.stderr)


def require(backend: str, target_dir, spec: Spec, reference: Spec | None, directory: Path,
            build: dict | None = None) -> Verdict:
    """The verdict, or a clean error where the backend failed its probe here."""
    v = verdict(backend, target_dir, spec, reference, directory, build)
    if v.error_code is not None:
        raise DFlashError(v.error_code, v.reason)
    if not v.usable:
        raise DFlashError("backend_unusable", f"the {backend} target backend cannot run on this machine: {v.reason} "
                                              f"(CPU: {v.cpu}; probed {v.probed_at}). Choose another --target-backend, "
                                              "or probe again after a rebuild: dflash doctor --reprobe")
    return v


def reference_tokens(target_dir, spec: Spec, directory: Path) -> dict | None:
    """The reference path's prompts, greedy tokens and top-k per position (kept like a
    verdict); None where the reference itself could not run (then only crashes are judged)."""
    key = {**key_of(REFERENCE, target_dir), "prompts": list(PROMPTS), "new_tokens": NEW_TOKENS}
    path = _path(directory, key)
    try:
        got = json.loads(path.read_text())
        if got.get("key") == key:
            return got.get("reference")
    except (OSError, ValueError):
        pass
    answers, _, _, _ = _run_child(spec, None)
    ref = answers.get("plain")
    _keep(path, {"key": key, "cpu": key["cpu"], "reference": ref})
    return ref


def _probe(backend: str, key: dict, spec: Spec, ref: dict | None) -> Verdict:
    t = time.monotonic()
    answers, failure, part, code = _run_child(spec, ref)
    if code is not None:
        return Verdict(backend, False, failure, key["cpu"], datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       round(time.monotonic() - t, 2), key, error_code=code)
    agreement, features, features_reason = None, None, None
    if "plain" in answers:
        failure_plain = failure if part == "plain" else None
        if ref is not None and failure_plain is None:
            agreement = judge(ref, answers["plain"])
            if not agreement["agrees"]:
                failure_plain = (f"its greedy tokens disagree with the reference path's ({agreement['equal']} of "
                                 f"{agreement['positions']} equal, {agreement['in_top_k']} in the reference's top "
                                 f"{TOP_K})")
        if failure_plain is None:  # usable; the features are a second question
            features = failure is None and answers.get("features", {}).get("argmax") == answers["plain"]["argmax"] \
                and answers["features"].get("finite", False)
            if not features:
                features_reason = failure or "its logits with features asked for differ from those without"
        failure = failure_plain
    return Verdict(backend, failure is None, failure, key["cpu"],
                   datetime.now(timezone.utc).isoformat(timespec="seconds"), round(time.monotonic() - t, 2), key,
                   agreement, features, features_reason)


def judge(ref: dict, answer: dict) -> dict:
    """Whether the backend's greedy tokens (teacher-forced on the reference's) agree."""
    positions = equal = in_top = 0
    for want, top, got in zip(ref["tokens"], ref["top"], answer["argmax"]):
        for w, t, g in zip(want, top, got):
            positions += 1
            equal += g == w
            in_top += g in t
    finite = answer.get("finite", False)
    agrees = finite and positions > 0 and in_top == positions and equal >= AGREE * positions
    return {"positions": positions, "equal": equal, "in_top_k": in_top, "features_finite": finite, "agrees": agrees}


def _run_child(spec: Spec, ref: dict | None) -> tuple[dict, str | None, str, str | None]:
    """The child's answers by part ("plain": a batched decode, then "features": the same with
    layer features), why it failed (None: it did not), the part it was in then, and the
    code of the clean error it raised while loading (None: it raised none)."""
    job = json.dumps({"spec": asdict(spec), "reference": ref})
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", __name__], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    err: list[str] = []
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
    threading.Thread(target=lambda: [err.append(x) for x in proc.stderr], daemon=True).start()
    proc.stdin.write(job)
    proc.stdin.close()
    answers: dict = {}
    error, code, part = None, None, "load"
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                limit = LOAD_TIMEOUT_S if part == "load" else RUN_TIMEOUT_S
                return answers, f"no answer within {limit:.0f} s ({_PARTS[part]}: hung)", part, None
            if line is None:
                break
            if line.startswith(MARK):
                msg = json.loads(line[len(MARK):])
                if msg.get("loaded"):
                    part, deadline = "plain", time.monotonic() + RUN_TIMEOUT_S
                elif "answer" in msg:
                    answers[part] = msg["answer"]
                    part, deadline = "features", time.monotonic() + RUN_TIMEOUT_S
                elif "error" in msg:
                    error, code = msg["error"], msg.get("code") if part == "load" else None
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tail = _cause(err)
    if rc < 0:
        return (answers, f"killed by {signal.Signals(-rc).name} {_PARTS[part]}" + (f" ({tail})" if tail else ""),
                part, None)
    if code is not None:
        return answers, error, part, code
    if error is not None or "features" not in answers:
        why = error or f"exited with status {rc} and no answer" + (f" ({tail})" if tail else "")
        return answers, f"failed {_PARTS[part]}: {why}", part, None
    return answers, None, part, None


def _cause(err: list[str]) -> str:
    """What the child's error output says of its end: the runtime's assertion or Python's fatal
    error where it printed one (not faulthandler's stack and module list), else its last line."""
    lines = [x.strip() for x in err if x.strip()]
    said = [x for x in lines if any(k in x.lower() for k in ("assert", "fatal", "error"))]
    return " | ".join(said[-2:]) if said else (lines[-1] if lines else "")


_PARTS = {"load": "while loading", "plain": "in a batched decode", "features": "in a batched decode with layer features"}


# --- the child ---------------------------------------------------------------------------------


def _say(**msg) -> None:
    print(MARK + json.dumps(msg), flush=True)


def _child() -> None:
    import importlib

    job = json.loads(sys.stdin.read())
    spec, ref = Spec(**job["spec"]), job["reference"]
    module, _, func = spec.builder.partition(":")
    try:
        target = getattr(importlib.import_module(module), func)(**spec.kwargs)
    except DFlashError as exc:
        _say(error=exc.message, code=exc.code)
        return
    _say(loaded=True)
    if ref is None:  # the reference: tokenize, decode greedily
        tok = target.tokenizer
        prompts = [list(tok(p)["input_ids"]) if tok is not None else [(100 + 7 * i + j) % target.vocab_size
                                                                      for j in range(8)] for i, p in enumerate(PROMPTS)]
        forced = None
    else:
        prompts, forced = ref["prompts"], ref["tokens"]
    try:
        _say(answer=_decode(target, prompts, forced, ()))
        _say(answer=_decode(target, prompts, forced, tuple(sorted({0, max(0, target.num_layers // 2 - 1)}))))
    except DFlashError as exc:
        _say(error=exc.message)


def _decode(target, prompts: list[list[int]], forced: list[list[int]] | None, layers: tuple[int, ...]) -> dict:
    """NEW_TOKENS greedy steps of every prompt in one batch (teacher-forced on `forced`)."""
    import torch

    from dflash.engine.target.protocol import TargetRow

    seqs = [target.new_sequence() for _ in prompts]
    out = target.forward_batch([TargetRow(s, p, 1) for s, p in zip(seqs, prompts)], layers)
    argmax, top, tokens = [[] for _ in prompts], [[] for _ in prompts], [[] for _ in prompts]
    finite = True
    for step in range(NEW_TOKENS):
        nxt = []
        for i, (logits, feats) in enumerate(zip(out.logits, out.features)):
            finite &= bool(torch.isfinite(logits).all()) and (feats is None or bool(torch.isfinite(feats).all()))
            a = int(logits[-1].argmax())
            argmax[i].append(a)
            top[i].append([int(t) for t in logits[-1].topk(TOP_K).indices])
            nxt.append(forced[i][step] if forced is not None else a)
            tokens[i].append(nxt[-1])
        if step + 1 < NEW_TOKENS:
            out = target.forward_batch([TargetRow(s, [t], 1) for s, t in zip(seqs, nxt)], layers)
    for seq in seqs:
        target.free(seq)
    return {"prompts": prompts, "tokens": tokens, "top": top, "argmax": argmax, "finite": finite}


if __name__ == "__main__":
    _child()
