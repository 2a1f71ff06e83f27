"""A drafter in llama.cpp's DFlash GGUF layout: written with the `gguf` package, read back.

The layout is the one llama.cpp's own DFlash converter writes (`DFlashModel` in
vendor/llama.cpp/conversion/qwen.py of llama-cpp-python 0.3.36) and its loader reads
(src/models/dflash.cpp); `make peers` converts the same drafter with both and compares
the files, and tests/golden/dflash_gguf_layout.json holds that converter's key and tensor
list. In short:
- architecture `dflash`; the usual `dflash.*` hyperparameters of a Qwen3-style stack;
  `dflash.block_size`; `dflash.target_layers` = our target layer ids + 1 (llama.cpp
  captures the residual *entering* a target layer, we take the one leaving the layer
  before); `tokenizer.ggml.mask_token_id` next to the target's vocabulary, which
  llama.cpp needs to find the mask token.
- tensors: the Qwen3 names per layer (`blk.N.attn_q`, ... `ffn_down`), `fc.weight`,
  `enc.output_norm.weight` (our `hidden_norm`) and `output_norm.weight` (our `norm`); no
  embedding and no output head (llama.cpp borrows the target's). Norms are stored as
  they are (no +1 offsets), as F32 like llama.cpp stores every 1-D tensor; matrices keep
  their stored dtype (`auto`) or are widened to F32 (`--outtype f32`), both exact.

One key is ours: `pg_dflash.hf_config`, the drafter's config.json verbatim, so that a
round trip gives back the very same config (llama.cpp ignores keys it does not know).
A DFlash GGUF without it (made by llama.cpp's converter) is read from the standard keys;
it does not record the target's layer count, which then comes from `--target`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from dflash.engine.drafter_config import DrafterConfig
from dflash.engine.drafter import DFlashDrafter, check_state
from dflash.errors import DFlashError

ARCH = "dflash"
CONFIG_KEY = "pg_dflash.hf_config"
BLOCK_SIZE_KEY = f"{ARCH}.block_size"
TARGET_LAYERS_KEY = f"{ARCH}.target_layers"
MASK_KEY = gguf.Keys.Tokenizer.MASK_ID
# Tensors outside the Qwen3 stack, by their published names.
GLOBAL_TENSORS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ENC_OUTPUT_NORM]}.weight",
}
GGML = gguf.GGMLQuantizationType
FILE_TYPES = {GGML.F32: gguf.LlamaFileType.ALL_F32, GGML.BF16: gguf.LlamaFileType.MOSTLY_BF16,
              GGML.F16: gguf.LlamaFileType.MOSTLY_F16}
TORCH_OF_GGML = {GGML.F32: torch.float32, GGML.BF16: torch.bfloat16, GGML.F16: torch.float16}
GGML_OF_OUTTYPE = {"f32": GGML.F32, "bf16": GGML.BF16, "f16": GGML.F16}
GGML_OF_TORCH = {v: k for k, v in TORCH_OF_GGML.items()}


@dataclass
class Vocabulary:
    """What the draft file carries of its target: the tokenizer keys llama.cpp reads
    (key -> (value, type, array element type)); empty when there is no target."""

    fields: dict[str, tuple] = field(default_factory=dict)
    source: str = ""


def tensor_name_map(cfg: DrafterConfig) -> dict[str, str]:
    """Published tensor name -> GGUF tensor name, for every tensor this drafter stores."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg.num_hidden_layers)
    out = {}
    for name in stored_tensor_names(cfg):
        if name in GLOBAL_TENSORS:
            out[name] = GLOBAL_TENSORS[name]
            continue
        base, suffix = name.rsplit(".", 1)
        mapped = names.get_name("model." + base)
        if mapped is None:
            raise DFlashError("bad_drafter", f"tensor {name} has no place in llama.cpp's DFlash layout")
        out[name] = f"{mapped}.{suffix}"
    return out


def stored_tensor_names(cfg: DrafterConfig) -> list[str]:
    with torch.device("meta"):
        return [n for n, _ in DFlashDrafter(cfg).named_parameters()]


# --- writing -------------------------------------------------------------------------


def _gguf_tensor(t: torch.Tensor, outtype: str) -> tuple[np.ndarray, GGML]:
    """The array and GGML type to store `t` as; every choice here is exact (1-D tensors and
    f32 widen, or the stored dtype is kept), except an explicit narrower --outtype."""
    if t.dtype not in GGML_OF_TORCH:
        raise DFlashError("bad_drafter", f"tensor dtype {t.dtype} cannot be stored in GGUF")
    kind = GGML.F32 if t.ndim <= 1 else GGML_OF_OUTTYPE.get(outtype, GGML_OF_TORCH[t.dtype])
    t = t.detach().to("cpu", TORCH_OF_GGML[kind]).contiguous()
    if kind == GGML.BF16:
        return t.view(torch.int16).numpy().view(np.uint16), kind
    return t.numpy(), kind


def write_gguf_drafter(cfg: DrafterConfig, state: dict[str, torch.Tensor], out: Path, vocab: Vocabulary,
                       outtype: str = "auto", name: str = "") -> None:
    check_state(cfg, state)
    names = tensor_name_map(cfg)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, ARCH)
    try:
        w.add_type(gguf.GGUFType.MODEL)
        if name:
            w.add_name(name)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_uint32(BLOCK_SIZE_KEY, cfg.block_size)
        w.add_array(TARGET_LAYERS_KEY, [i + 1 for i in cfg.target_layer_ids])
        if any(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)):
            w.add_sliding_window(int(cfg.sliding_window))
            w.add_sliding_window_pattern([cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, (value, vtype, sub) in vocab.fields.items():
            w.add_key_value(key, value, vtype, sub_type=sub)
        w.add_mask_token_id(cfg.mask_token_id)
        w.add_string(CONFIG_KEY, json.dumps(cfg.raw, sort_keys=True))
        kinds = set()
        for hf_name, gguf_name in names.items():
            array, kind = _gguf_tensor(state[hf_name], outtype)
            kinds.add(kind)
            w.add_tensor(gguf_name, array, raw_dtype=kind)
        # general.file_type names the matrices' type, as llama.cpp's converter sets it.
        w.add_file_type(FILE_TYPES[max(kinds - {GGML.F32}, default=GGML.F32)])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)


# --- reading -------------------------------------------------------------------------


def open_gguf(path: Path, code: str = "bad_drafter") -> gguf.GGUFReader:
    """The file's reader; `code`: the error code of a file missing or unreadable (a drafter's
    by default; bad_target for a target)."""
    if not path.is_file():
        raise DFlashError(code, f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        raise DFlashError(code, f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from None


_SCALARS = {gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.UINT16: "<H",
            gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
            gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?", gguf.GGUFValueType.UINT64: "<Q",
            gguf.GGUFValueType.INT64: "<q", gguf.GGUFValueType.FLOAT64: "<d"}


def scalar_keys(path: Path, wanted: set[str], code: str = "bad_target") -> dict:
    """The numeric values of the `wanted` keys of a little-endian GGUF file, read from its
    header only, up to the last one found: GGUFReader parses every key first, a large
    vocabulary's arrays for seconds, at every start of a worker on the file. A file this scan
    cannot read (missing, cut short, big-endian) gets the reader's answer or clean error."""
    import struct

    found: dict = {}
    try:
        with open(path, "rb") as f:
            def take(fmt):
                size = struct.calcsize(fmt)
                raw = f.read(size)
                if len(raw) != size:
                    raise EOFError
                return struct.unpack(fmt, raw)[0]

            def skip_string():
                f.seek(take("<Q"), os.SEEK_CUR)

            if take("<I") != gguf.GGUF_MAGIC or take("<I") not in (2, 3):
                raise ValueError("not a little-endian GGUF file of version 2 or 3")
            take("<Q")  # tensors
            for _ in range(take("<Q")):
                key = f.read(take("<Q")).decode("utf-8", "replace")
                kind = gguf.GGUFValueType(take("<I"))
                if kind == gguf.GGUFValueType.STRING:
                    skip_string()
                elif kind == gguf.GGUFValueType.ARRAY:
                    item, count = gguf.GGUFValueType(take("<I")), take("<Q")
                    if item == gguf.GGUFValueType.STRING:
                        for _ in range(count):
                            skip_string()
                    elif item in _SCALARS:
                        f.seek(count * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
                    else:  # arrays of arrays: not in any file this reads; the whole reader copes
                        raise ValueError(f"an array of {item.name} in key {key}")
                else:
                    value = take(_SCALARS[kind])
                    if key in wanted:
                        found[key] = value
                        if len(found) == len(wanted):
                            break
    except (OSError, EOFError, ValueError, KeyError, struct.error):
        reader = open_gguf(Path(path), code)  # the clean error, or a file this scan does not read
        return {k: field_value(reader, k) for k in wanted if reader.fields.get(k) is not None}
    return found


def field_value(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def f32_value(x) -> float:
    """A float32 key as the decimal it was written from (1e-6, not 9.99999997e-07)."""
    return float(str(np.float32(x)))


# config.json's keys of a model's shape and the llama.cpp keys (after "ARCHITECTURE.") that
# hold the same numbers, with how each is read.
CONFIG_KEYS = {
    "hidden_size": ("embedding_length", int),
    "intermediate_size": ("feed_forward_length", int),
    "num_hidden_layers": ("block_count", int),
    "num_attention_heads": ("attention.head_count", int),
    "num_key_value_heads": ("attention.head_count_kv", int),
    "head_dim": ("attention.key_length", int),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", f32_value),
    "rope_theta": ("rope.freq_base", f32_value),
    "max_position_embeddings": ("context_length", int),
}


def _config_from_keys(reader: gguf.GGUFReader, path: Path, num_target_layers: int | None) -> dict:
    """config.json rebuilt from llama.cpp's keys, for a DFlash GGUF that lacks ours."""

    def need(key):
        value = field_value(reader, key)
        if value is None:
            raise DFlashError("bad_drafter", f"{path} has no '{key}'")
        return value

    if num_target_layers is None:
        raise DFlashError(
            "bad_drafter",
            f"{path} was not written by `dflash convert`, so it does not say how many layers its target has: "
            f"convert it with `dflash convert {path} --to hf OUT --target TARGET`",
        )
    tokens = field_value(reader, gguf.Keys.Tokenizer.LIST)
    if tokens is None:
        raise DFlashError("bad_drafter", f"{path} has no vocabulary (tokenizer.ggml.tokens), so no vocabulary size")
    unsupported = [k for k in ("rope.dimension_count", "attention.causal", "embedding_scale", "logit_scale",
                               "final_logit_softcapping", "attention.value_scale")
                   if f"{ARCH}.{k}" in reader.fields]
    if unsupported:
        raise DFlashError("bad_drafter", f"{path} uses DFlash features this engine does not run: {unsupported}")
    fc = next((t for t in reader.tensors if t.name == GLOBAL_TENSORS["fc.weight"]), None)
    if fc is None:
        raise DFlashError("bad_drafter", f"{path} has no fc.weight tensor")
    layers = int(need(f"{ARCH}.block_count"))
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **{name: read(need(f"{ARCH}.{key}")) for name, (key, read) in CONFIG_KEYS.items()},
        "hidden_act": "silu",
        "vocab_size": len(tokens),
        "block_size": int(field_value(reader, BLOCK_SIZE_KEY, 16)),
        "num_target_layers": int(num_target_layers),
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        "tie_word_embeddings": False,  # no head of its own: it borrows the target's
        # the matrices' dtype (norms are F32 in any DFlash GGUF)
        "torch_dtype": str(TORCH_OF_GGML.get(GGML(fc.tensor_type), torch.float32)).replace("torch.", ""),
        "dflash_config": {
            "mask_token_id": int(need(MASK_KEY)),
            "target_layer_ids": [int(i) - 1 for i in need(TARGET_LAYERS_KEY)],
        },
    }
    window = field_value(reader, f"{ARCH}.attention.sliding_window")
    if window:
        pattern = field_value(reader, f"{ARCH}.attention.sliding_window_pattern", [True] * layers)
        cfg.update(sliding_window=int(window), use_sliding_window=True,
                   layer_types=["sliding_attention" if s else "full_attention" for s in pattern])
    return cfg


def _check_keys_agree(cfg: DrafterConfig, reader: gguf.GGUFReader, path: Path) -> None:
    """Our config key must describe the same model as llama.cpp's keys (which llama.cpp runs)."""
    expect = {
        f"{ARCH}.block_count": cfg.num_hidden_layers,
        f"{ARCH}.embedding_length": cfg.hidden_size,
        f"{ARCH}.feed_forward_length": cfg.intermediate_size,
        f"{ARCH}.attention.head_count": cfg.num_attention_heads,
        f"{ARCH}.attention.head_count_kv": cfg.num_key_value_heads,
        BLOCK_SIZE_KEY: cfg.block_size,
        TARGET_LAYERS_KEY: [i + 1 for i in cfg.target_layer_ids],
        MASK_KEY: cfg.mask_token_id,
    }
    bad = [k for k, v in expect.items() if field_value(reader, k) != v]
    if bad:
        raise DFlashError("bad_drafter", f"{path}: keys {bad} disagree with its {CONFIG_KEY}")


def _torch_tensor(t, path: Path) -> torch.Tensor:
    kind = GGML(t.tensor_type)
    if kind not in TORCH_OF_GGML:
        raise DFlashError("bad_drafter", f"{path}: tensor {t.name} is {kind.name}; quantised drafters are not "
                          "supported (write F32, BF16 or F16)")
    if t.data.nbytes != t.n_bytes:
        raise DFlashError("bad_drafter", f"{path} is truncated: tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes")
    shape = [int(d) for d in reversed(t.shape)]
    raw = np.ascontiguousarray(t.data).reshape(-1)
    if kind == GGML.BF16:
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(raw.view(np.float32 if kind == GGML.F32 else np.float16).copy()).reshape(shape)


def read_gguf_drafter(path: Path, num_target_layers: int | None = None) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(config, tensors in their GGUF dtype under their published names)."""
    path = Path(path)
    reader = open_gguf(path)
    arch = field_value(reader, gguf.Keys.General.ARCHITECTURE)
    if arch != ARCH:
        raise DFlashError("bad_drafter", f"{path} is a '{arch}' GGUF, not a DFlash drafter (architecture '{ARCH}')")
    stored = field_value(reader, CONFIG_KEY)
    if stored is not None:
        try:
            raw = json.loads(stored)
        except ValueError as exc:
            raise DFlashError("bad_drafter", f"{path}: {CONFIG_KEY} is not valid JSON: {exc}") from None
        cfg = DrafterConfig.from_dict(raw)
        _check_keys_agree(cfg, reader, path)
    else:
        cfg = DrafterConfig.from_dict(_config_from_keys(reader, path, num_target_layers))
    names = tensor_name_map(cfg)
    by_gguf = {t.name: t for t in reader.tensors}
    missing = sorted(g for g in names.values() if g not in by_gguf)
    unexpected = sorted(set(by_gguf) - set(names.values()))
    if missing or unexpected:
        raise DFlashError("bad_drafter", f"{path}: tensors do not fit a DFlash drafter of its config: "
                          f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    state = {hf: _torch_tensor(by_gguf[g], path) for hf, g in names.items()}
    check_state(cfg, state)
    return cfg, state
