"""The feature cache: target features at the drafter's layer ids, computed once per sequence.

Stored as one flat bf16 file (`features.bin`, read back with numpy.memmap, so epochs
never rerun the target and memory stays flat) plus `index.json` with, per sequence,
its token ids, the row offset, and where the response starts. Resumable: sequences
already in the index are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


class FeatureCache:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.index_file = self.path / "index.json"
        self.bin_file = self.path / "features.bin"
        self.index = json.loads(self.index_file.read_text()) if self.index_file.is_file() else None

    @property
    def sequences(self) -> list[dict]:
        return self.index["sequences"] if self.index else []

    def build(self, target, records: list[dict], layer_ids: list[int], min_response: int = 2) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        width = len(layer_ids) * target.hidden_size
        if self.index is None:
            self.index = {"layer_ids": list(layer_ids), "width": width, "rows": 0, "sequences": []}
        if self.index["layer_ids"] != list(layer_ids):
            raise ValueError(f"{self.path} holds features of layers {self.index['layer_ids']}, not {layer_ids}")
        done = {s["prompt"] for s in self.sequences}
        todo = [r for r in records if r["prompt"] not in done and len(r["response_ids"]) >= min_response]
        target.reset(layer_ids)
        with self.bin_file.open("ab") as f:
            for rec in tqdm(todo, desc="target features", unit="seq"):
                ids = rec["prompt_ids"] + rec["response_ids"]
                ids = ids[: target.context_length]
                target.reset(layer_ids)
                _, feats = target.forward(torch.tensor(ids, device=target.device))
                f.write(feats.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
                self.sequences.append(
                    {"prompt": rec["prompt"], "ids": ids, "offset": self.index["rows"],
                     "response_start": len(rec["prompt_ids"])}
                )
                self.index["rows"] += len(ids)
                f.flush()
                self.index_file.write_text(json.dumps(self.index))

    def features(self, seq: dict) -> torch.Tensor:
        """[T, width] float32 features of one sequence (memory-mapped read)."""
        width = self.index["width"]
        mm = np.memmap(self.bin_file, dtype=np.int16, mode="r", shape=(self.index["rows"], width))
        rows = np.array(mm[seq["offset"] : seq["offset"] + len(seq["ids"])])
        return torch.from_numpy(rows).view(torch.bfloat16).float()
