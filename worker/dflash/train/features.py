"""The feature cache: target features at the drafter's layer ids, computed once per sequence.

Stored as one flat bf16 file (`features.bin`, read back with numpy.memmap, so epochs
never rerun the target and memory stays flat), `index.json` with the layer ids and row
width, and `sequences.jsonl` with, per sequence, its token ids, row offset and where the
response starts. Both data files are append-only (a line is written only after its rows),
so a stopped build resumes where it stopped and the index never has to be rewritten.
Sequences run through the target in length-sorted batches, right-padded: padding sits
after every real token, so under the causal mask it changes no real token's features.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


class FeatureCache:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.index_file = self.path / "index.json"
        self.seq_file = self.path / "sequences.jsonl"
        self.bin_file = self.path / "features.bin"
        self.index = json.loads(self.index_file.read_text()) if self.index_file.is_file() else None
        self.sequences: list[dict] = []
        if self.seq_file.is_file():
            self.sequences = [json.loads(s) for s in self.seq_file.read_text().splitlines() if s.strip()]
        self._mm = None

    @property
    def rows(self) -> int:
        return self.sequences[-1]["offset"] + len(self.sequences[-1]["ids"]) if self.sequences else 0

    @torch.inference_mode()
    def build(self, target, records: list[dict], layer_ids: list[int], min_response: int = 2,
              batch_tokens: int = 4096, deadline: float | None = None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        width = len(layer_ids) * target.hidden_size
        if self.index is None:
            self.index = {"layer_ids": list(layer_ids), "width": width}
            self.index_file.write_text(json.dumps(self.index))
        if self.index["layer_ids"] != list(layer_ids):
            raise ValueError(f"{self.path} holds features of layers {self.index['layer_ids']}, not {layer_ids}")
        done = {s["prompt"] for s in self.sequences}
        todo = [r for r in records if r["prompt"] not in done and len(r["response_ids"]) >= min_response]
        todo.sort(key=lambda r: len(r["prompt_ids"]) + len(r["response_ids"]))  # little padding per batch
        tokens = [(r["prompt_ids"] + r["response_ids"])[: target.context_length] for r in todo]
        with self.bin_file.open("r+b" if self.bin_file.exists() else "wb") as f, self.seq_file.open("a") as idx, \
                tqdm(total=len(todo), desc="target features", unit="seq") as bar:
            f.seek(self.rows * width * 2)  # drop rows of a batch whose index lines were never written
            f.truncate()
            i = 0
            while i < len(todo):
                if deadline is not None and time.monotonic() > deadline:
                    break
                # Sorted by length, so the batch's last sequence is its longest.
                end = i + 1
                while end < len(todo) and len(tokens[end]) * (end + 1 - i) <= batch_tokens:
                    end += 1
                batch, ids = todo[i:end], tokens[i:end]
                input_ids = torch.zeros(len(batch), len(ids[-1]), dtype=torch.long)
                mask = torch.zeros_like(input_ids)
                for row, x in enumerate(ids):
                    input_ids[row, : len(x)] = torch.tensor(x)
                    mask[row, : len(x)] = 1
                out = target.model(input_ids=input_ids.to(target.device), attention_mask=mask.to(target.device),
                                   output_hidden_states=True, logits_to_keep=1, use_cache=False)
                feats = torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1).to(torch.bfloat16).cpu()
                for row, x in enumerate(ids):
                    f.write(feats[row, : len(x)].view(torch.int16).numpy().tobytes())
                f.flush()
                rows = self.rows
                for rec, x in zip(batch, ids):
                    seq = {"prompt": rec["prompt"], "ids": x, "offset": rows, "response_start": len(rec["prompt_ids"])}
                    idx.write(json.dumps(seq) + "\n")
                    self.sequences.append(seq)
                    rows += len(x)
                idx.flush()
                i = end
                bar.update(len(batch))
        self._mm = None

    def features(self, seq: dict, dtype=torch.float32) -> torch.Tensor:
        """[T, width] features of one sequence (memory-mapped read; stored as bf16)."""
        width = self.index["width"]
        if self._mm is None or self._mm.shape[0] < self.rows:
            self._mm = np.memmap(self.bin_file, dtype=np.int16, mode="r", shape=(self.rows, width))
        rows = np.array(self._mm[seq["offset"] : seq["offset"] + len(seq["ids"])])
        return torch.from_numpy(rows).view(torch.bfloat16).to(dtype)
