"""A drafter's draft vocabulary: the target tokens it may propose (FR-Spec, EAGLE-3's d2t).

A file `draft_vocab.json` beside the drafter's weights (made by dflash.train.draft_vocab
from the training corpus: the K most frequent tokens of the target's own answers, K chosen
by measured coverage) lists them as target token ids, most frequent first. The drafter then
scores only those K rows of the LM head it borrows. Drafts are proposals the target checks,
so the output is unchanged; a target token outside the list is simply never proposed.
Drafters without the file (the published ones) draft over the whole vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import DFlashError

FILE = "draft_vocab.json"
FORMAT = "dflash-draft-vocab/1"


def read(path: str | Path) -> list[int]:
    """The token ids of a draft_vocab.json (a file, or a drafter folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    try:
        data = json.loads(path.read_text())
    except OSError:
        raise DFlashError("bad_drafter", f"no draft vocabulary at {path}") from None
    except ValueError as exc:
        raise DFlashError("bad_drafter", f"{path} is not valid JSON: {exc}") from None
    ids = data.get("token_ids") if isinstance(data, dict) else None
    if data.get("format") != FORMAT or not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise DFlashError("bad_drafter", f"{path} is not a draft vocabulary ({FORMAT}: token_ids, a list of ids)")
    return ids


def write(folder: str | Path, token_ids: list[int], info: dict) -> Path:
    path = Path(folder) / FILE
    path.write_text(json.dumps({"format": FORMAT, "k": len(token_ids), **info, "token_ids": token_ids}) + "\n")
    return path


def for_drafter(folder: str | Path | None, choice: str | None = "auto") -> list[int] | None:
    """The draft vocabulary to use: `auto` (the drafter folder's file if it has one, else
    the whole vocabulary), `full`, or a path to a draft_vocab.json."""
    if choice in (None, "full"):
        return None
    if choice == "auto":
        if folder is None or not (Path(folder).is_dir() and (Path(folder) / FILE).is_file()):
            return None
        return read(folder)
    return read(choice)
