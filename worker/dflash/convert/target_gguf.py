"""A target given as a GGUF file, as the Hugging Face folder every backend reads.

transformers loads a GGUF of the architectures it knows (qwen2, llama, ... see
`transformers.modeling_gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES`) by dequantizing
it to fp32; we do that once per file and save the result as a plain folder (safetensors,
config, tokenizer with its chat template), so later loads take seconds and need no GGUF
code. The hf backend runs that folder; the llamacpp backend runs the GGUF itself and
borrows the folder's tokenizer (and, for a drafter or a head, the embedding and LM head).

A backend that runs the file as it is (llamacpp) needs no weights in the folder: then only
the tokenizer and config are written (`weights=False`: seconds and megabytes), and the
embedding and head are read from the GGUF where something borrows them
(dflash.engine.target.hf_files). A folder without weights is made whole in place when a
backend asks for them. The fp32 weights take four bytes a parameter on disk and more while
transformers makes them, so a file too large for this machine's memory or the cache's
disk is refused before anything is loaded (`too_big`), naming what it needs; a model that
large runs in llama.cpp only.

An architecture transformers cannot load (llama.cpp knows many more: granite, olmo2,
smollm3, ...) runs in llama.cpp all the same: its tokenizer is built from the file's
tokenizer keys (transformers does that whatever the architecture) and its config holds the
shape llama.cpp's keys state, with no `model_type` (no transformers class reads it); llama.cpp
checks at load that it tokenises as that tokenizer does (dflash.engine.target.llamacpp). The
hf and ort backends refuse such a file, naming the architecture.

Before anything is loaded the file's header is read: a file that is not GGUF, is cut short
(a tensor's data past the end) or holds no causal language model is refused with a
`bad_target` naming the file and the architecture. The folder is written whole or
not at all (a temporary folder renamed into place), and it records the GGUF's size and
modification time, so a file replaced under the same name is converted again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflash.errors import DFlashError

MAGIC = b"GGUF"
# Architectures that are no causal language model (transformers reads some from GGUF), beside
# any whose file says its attention is not causal (an encoder: BERT's kin, a diffusion model).
NOT_CAUSAL = {"general", "tokenizer", "t5", "umt5", "t5encoder"}

# The config key naming the GGUF architecture of a folder written for llama.cpp alone (no
# model_type: transformers does not know the architecture).
ARCH_KEY = "gguf_architecture"

# What a folder made in the cache records of its source (one name for every kind of folder
# there: converted targets, materialised assistants).
MARKER = "pg_dflash.json"


def say(msg: str) -> None:
    print(f"[dflash] {msg}", file=sys.stderr, flush=True)


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def loadable_architectures() -> set[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return set(GGUF_SUPPORTED_ARCHITECTURES) - NOT_CAUSAL


@dataclass(frozen=True)
class TargetHeader:
    """What a target GGUF's header says (read without loading a tensor)."""

    architecture: str
    layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    name: str | None
    parameters: int  # every tensor's elements
    config: dict  # config.json's shape keys the file states (dflash.convert.gguf_file.CONFIG_KEYS), ids, tying
    causal: bool = True  # what ARCHITECTURE.attention.causal says (absent: causal)


def read_header(path: Path) -> TargetHeader:
    """The header, once the file is known whole: every tensor's data lies inside the file.
    Read once a process per file as it is (a large vocabulary's takes seconds, and a command
    looks at its target's more than once)."""
    path = Path(path)
    if not is_gguf(path):
        if not path.is_file():
            raise DFlashError("bad_target", f"GGUF file not found: {path}")
        raise DFlashError("bad_target", f"{path} is not a GGUF file (it does not start with 'GGUF')")
    st = path.stat()
    return _read_header(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_header(path: Path, size: int, mtime_ns: int) -> TargetHeader:
    """read_header's work; `size` and `mtime_ns` key the cache (a file replaced is read again)."""
    import gguf

    from dflash.convert.gguf_file import CONFIG_KEYS, field_value, open_gguf

    try:
        reader = open_gguf(path, code="bad_target")
    except DFlashError as exc:
        arch = _architecture_only(path)
        raise DFlashError("bad_target", exc.message + (f" (architecture '{arch}')" if arch else "")) from None
    arch = field_value(reader, gguf.Keys.General.ARCHITECTURE)
    if not arch:
        raise DFlashError("bad_target", f"{path} names no architecture (general.architecture)")
    short = next((t for t in reader.tensors if t.data.nbytes != t.n_bytes), None)
    if short is not None:
        raise DFlashError("bad_target", f"{path} is truncated: tensor {short.name} has {short.data.nbytes:,} of "
                          f"{short.n_bytes:,} bytes (architecture '{arch}')")
    tokens = field_value(reader, gguf.Keys.Tokenizer.LIST)
    config = {name: read(v) for name, (key, read) in CONFIG_KEYS.items()
              if isinstance(v := field_value(reader, f"{arch}.{key}"), (int, float))}  # (a list: per layer)
    config.update({name: int(v) for name, key in (("bos_token_id", gguf.Keys.Tokenizer.BOS_ID),
                                                  ("eos_token_id", gguf.Keys.Tokenizer.EOS_ID))
                   if (v := field_value(reader, key)) is not None})
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    if tokens is not None:
        config["vocab_size"] = len(tokens)
    return TargetHeader(str(arch), config.get("num_hidden_layers"), config.get("hidden_size"), config.get("vocab_size"),
                        field_value(reader, gguf.Keys.General.NAME), sum(int(t.n_elements) for t in reader.tensors),
                        config, field_value(reader, f"{arch}.attention.causal", True) is not False)


# A conversion's peak memory: this many bytes per fp32 byte of weights, plus a base (the
# interpreter, torch, transformers, the file's reader and one tensor in flight); an upper
# bound of the named models' peaks (docs/models.md).
CONVERSION_PEAK = 1.25
CONVERSION_BASE = 2 << 30


def available_memory() -> int:
    """Bytes of memory the kernel says a new allocation can have (MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return sys.maxsize  # not Linux: not checked


def too_big(parameters: int, out: Path) -> str | None:
    """Why the fp32 conversion of a file of this many parameters cannot be made here (None: it
    can): its peak memory above what is available, or its folder above the free disk under `out`."""
    weights = 4 * parameters
    need, have = int(CONVERSION_PEAK * weights) + CONVERSION_BASE, available_memory()
    if need > have:
        return (f"its fp32 conversion (for the hf and ort backends) needs about {need / 2**30:.1f} GiB of memory, "
                f"{have / 2**30:.1f} GiB are available")
    parent = next((p for p in (out, *out.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(parent).free
    if weights > free:
        return (f"its fp32 conversion (for the hf and ort backends) takes {weights / 2**30:.1f} GiB of disk, "
                f"{free / 2**30:.1f} GiB are free under {parent}")
    return None


def _architecture_only(path: Path) -> str | None:
    """The architecture a file that gguf cannot read whole says it holds, from its keys alone
    (the tensors are not looked at), for the error message; None where even that fails."""
    import gguf

    class KeysOnly(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            self.tensors = []

    try:
        arch = KeysOnly(path).fields.get(gguf.Keys.General.ARCHITECTURE)
        return str(arch.contents()) if arch is not None else None
    except Exception:  # a file that is broken already in its keys  # noqa: BLE001
        return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"gguf": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path)}


def _marker(folder: Path) -> dict | None:
    """What a folder made in the cache records of its source; None where it records nothing."""
    try:
        return json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def has_weights(folder: Path) -> bool:
    """Whether a target folder holds the weights: False only for one converted from a GGUF
    with its tokenizer and config alone (a user's own folder is taken as it is)."""
    marker = _marker(folder)
    return marker is None or marker.get("weights", True) is not False


def summary(gguf: Path, folder: Path) -> tuple[str, int, bool]:
    """(architecture, parameters, causal) of `gguf`: from the marker of its current conversion
    in `folder` where that records them (a large vocabulary's header takes seconds to read,
    at every start of a command that asks), else from the header."""
    marker = _marker(folder) or {}
    if "parameters" in marker and is_current(Path(folder), Path(gguf)):
        return marker["architecture"], int(marker["parameters"]), True  # only a causal model is converted
    header = read_header(gguf)
    return header.architecture, header.parameters, header.causal


def unknown_architecture(folder: Path) -> str | None:
    """The GGUF architecture of a folder written for llama.cpp alone, which transformers does
    not know (None for any other folder)."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get(ARCH_KEY)
    except (OSError, ValueError, AttributeError):
        return None


def is_current(folder: Path, gguf: Path, weights: bool = False) -> bool:
    """Whether `folder` is a finished conversion of the file `gguf` is now, with the weights
    where `weights` asks for them (a marker without the file's stamp, as the first releases
    wrote for the embedded default, counts as current).
    The same bytes at another path or time count too: a packaged model's copy in another
    virtual environment must not convert the folder again, which would also leave the ONNX
    exports made from it behind (their key holds the folder's files)."""
    marker = _marker(folder)
    if marker is None:
        return False
    if weights and marker.get("weights", True) is False:
        return False
    if "size" not in marker:
        return True
    st = gguf.stat()
    if (marker["size"], marker["mtime_ns"]) == (st.st_size, st.st_mtime_ns):
        return True
    return marker.get("sha256") is not None and marker["size"] == st.st_size and file_sha256(gguf) == marker["sha256"]


def convert_target(gguf: Path, out: Path, source: str, quiet: bool = False, weights: bool = True) -> Path:
    """`gguf` as a Hugging Face folder at `out` (once; returns `out`). `weights=False`: the
    tokenizer and config at least (what llama.cpp and a remote backend need of the model;
    seconds, not minutes, and megabytes, not gigabytes): a folder made whole is kept."""
    gguf = Path(gguf)
    if (out / MARKER).is_file() and is_current(out, gguf, weights):
        return out
    header = read_header(gguf)
    known = loadable_architectures()
    readable = header.architecture in known  # else llama.cpp alone can run it
    listed = f"transformers reads GGUF targets of: {', '.join(sorted(known))}"
    if header.architecture in NOT_CAUSAL or not header.causal:
        raise DFlashError("bad_target", f"{gguf}: architecture '{header.architecture}' cannot be run as a target "
                                        f"(not a causal language model; {listed})")
    if weights and not readable:
        raise DFlashError("bad_target", f"{gguf}: architecture '{header.architecture}' cannot be run by the hf and ort "
                                        f"backends ({listed}); --target-backend llamacpp runs the file as it is")
    why = too_big(header.parameters, out) if weights else None
    if why is not None:
        raise DFlashError("bad_target", f"{gguf} ({header.parameters / 1e9:.1f} B parameters): {why}; "
                                        "--target-backend llamacpp runs the file as it is")
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    size = gguf.stat().st_size
    if not quiet:
        say(f"converting {gguf.name} ({header.architecture}, {size / 2**20:,.0f} MiB) to a Hugging Face folder in "
            f"{out}{'' if weights else ' (its tokenizer and config)'} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    stages = tqdm(total=3, desc="preparing target", unit="stage", disable=quiet, file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        try:
            stages.set_postfix_str("tokenizer")
            # transformers builds a GGUF's tokenizer from its tokenizer keys, whatever the
            # architecture; AutoTokenizer would first read the config, known architectures only
            tok = (AutoTokenizer if readable else PreTrainedTokenizerFast).from_pretrained(gguf.parent,
                                                                                          gguf_file=gguf.name)
            stages.update()
            stages.set_postfix_str("dequantize weights" if weights else "config")
            model = (AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
                     if weights else None)
            config = (model.config if weights else AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
                      if readable else None)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 (whatever transformers finds wrong with the file, it is the file's)
            raise DFlashError("bad_target", f"{gguf} (architecture '{header.architecture}'): transformers cannot "
                              f"load it: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        # The weights are plain fp32 now; drop the GGUF marker so save_pretrained writes safetensors.
        if config is not None and hasattr(config, "quantization_config"):
            del config.quantization_config
        stages.update()
        stages.set_postfix_str("save")
        if weights:
            model.hf_quantizer = None
            model.is_quantized = False
            model.save_pretrained(tmp)
            del model
        elif config is not None:
            config.save_pretrained(tmp)
        else:
            # the shape llama.cpp's keys state, for what reads a config (no model_type:
            # transformers has no class for it; dflash.engine.target.hf_files reads it plainly)
            (tmp / "config.json").write_text(json.dumps({ARCH_KEY: header.architecture, **header.config},
                                                        indent=2) + "\n")
        tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": source, "architecture": header.architecture,
                                              "weights": weights, "parameters": header.parameters,
                                              **_stamp(gguf)}) + "\n")
        stages.update()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        stages.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
