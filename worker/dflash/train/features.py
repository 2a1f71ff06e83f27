"""Target features at the drafter's layer ids (and, optionally, the target's top-k logits),
computed once per sequence.

Two stores with one interface (`sequences`, `features(seq)`, `soft_targets(seq)`):

- `FeatureCache` (disk, for CPU runs that continue across sessions): one flat bf16 file
  (`features.bin`, read back with numpy.memmap, so epochs never rerun the target and
  memory stays flat), `index.json` with the layer ids, row width and top-k, and
  `sequences.jsonl` with, per sequence, its token ids, row offset and where the response
  starts. Data files are append-only (a line is written only after its rows), so a
  stopped build resumes where it stopped.
- `DeviceFeatures` (for a GPU lease): the same rows kept in device memory, so a training
  step never copies features from the host.

Sequences run through the target in length-sorted batches, right-padded: padding sits
after every real token, so under the causal mask it changes no real token's features.
Soft targets: row t holds the target's top-k next-token logits at position t (its
distribution over token t+1), stored as int32 ids and fp16 values.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


def _usable(records: list[dict], done: set[str], min_response: int) -> list[dict]:
    return [r for r in records if r["prompt"] not in done and len(r["response_ids"]) >= min_response]


@torch.inference_mode()
def target_batches(target, records: list[dict], layer_ids: list[int], *, topk: int = 0, batch_tokens: int = 4096,
                   deadline: float | None = None, feature_dtype=torch.bfloat16,
                   desc: str = "target features") -> Iterator[tuple]:
    """Yields (records, token id lists, features [B, T, width], topk ids [B, T, k] | None,
    topk logits | None) per length-sorted batch, on the target's device."""
    records = sorted(records, key=lambda r: len(r["prompt_ids"]) + len(r["response_ids"]))  # little padding
    tokens = [(r["prompt_ids"] + r["response_ids"])[: target.context_length] for r in records]
    i = 0
    with tqdm(total=len(records), desc=desc, unit="seq") as bar:
        while i < len(records):
            if deadline is not None and time.monotonic() > deadline:
                break
            # Sorted by length, so the batch's last sequence is its longest.
            end = i + 1
            while end < len(records) and len(tokens[end]) * (end + 1 - i) <= batch_tokens:
                end += 1
            ids = tokens[i:end]
            input_ids = torch.zeros(len(ids), len(ids[-1]), dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, x in enumerate(ids):
                input_ids[row, : len(x)] = torch.tensor(x)
                mask[row, : len(x)] = 1
            out = target.model(input_ids=input_ids.to(target.device), attention_mask=mask.to(target.device),
                               output_hidden_states=True, logits_to_keep=0 if topk else 1, use_cache=False)
            feats = torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1).to(feature_dtype)
            top_ids = top_vals = None
            if topk:
                top = out.logits.float().topk(topk, dim=-1)
                top_ids, top_vals = top.indices.to(torch.int32), top.values.to(torch.float16)
            del out
            yield records[i:end], ids, feats, top_ids, top_vals
            bar.update(end - i)
            i = end


class FeatureCache:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.index_file = self.path / "index.json"
        self.seq_file = self.path / "sequences.jsonl"
        self.bin_file = self.path / "features.bin"
        self.topk_ids_file = self.path / "topk_ids.bin"
        self.topk_logits_file = self.path / "topk_logits.bin"
        self.index = json.loads(self.index_file.read_text()) if self.index_file.is_file() else None
        self.sequences: list[dict] = []
        if self.seq_file.is_file():
            for s in self.seq_file.read_text().splitlines():
                try:
                    self.sequences.append(json.loads(s))
                except json.JSONDecodeError:  # a line cut by a killed build: its rows are rewritten
                    break
        self._mm: dict[str, np.memmap] = {}

    @property
    def rows(self) -> int:
        return self.sequences[-1]["offset"] + len(self.sequences[-1]["ids"]) if self.sequences else 0

    @property
    def topk(self) -> int:
        return int((self.index or {}).get("topk", 0))

    def build(self, target, records: list[dict], layer_ids: list[int], min_response: int = 2,
              batch_tokens: int = 4096, deadline: float | None = None, topk: int = 0) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        width = len(layer_ids) * target.hidden_size
        if self.index is None:
            self.index = {"layer_ids": list(layer_ids), "width": width, "topk": topk}
            self.index_file.write_text(json.dumps(self.index))
        if self.index["layer_ids"] != list(layer_ids):
            raise ValueError(f"{self.path} holds features of layers {self.index['layer_ids']}, not {layer_ids}")
        if self.topk != topk:
            raise ValueError(f"{self.path} holds top-{self.topk} soft targets, not top-{topk}")
        self.seq_file.write_text("".join(json.dumps(s) + "\n" for s in self.sequences))  # drops a cut line
        todo = _usable(records, {s["prompt"] for s in self.sequences}, min_response)
        files = [(self.bin_file, width * 2)] + ([(self.topk_ids_file, topk * 4), (self.topk_logits_file, topk * 2)]
                                                if topk else [])
        handles = [f.open("r+b" if f.exists() else "wb") for f, _ in files]
        try:
            for h, (_, row_bytes) in zip(handles, files):
                h.seek(self.rows * row_bytes)  # drop rows of a batch whose index lines were never written
                h.truncate()
            with self.seq_file.open("a") as idx:
                for batch, ids, feats, top_ids, top_vals in target_batches(
                        target, todo, layer_ids, topk=topk, batch_tokens=batch_tokens, deadline=deadline):
                    feats = feats.cpu()
                    for row, x in enumerate(ids):
                        handles[0].write(feats[row, : len(x)].view(torch.int16).numpy().tobytes())
                        if topk:
                            handles[1].write(top_ids[row, : len(x)].cpu().numpy().tobytes())
                            handles[2].write(top_vals[row, : len(x)].cpu().numpy().tobytes())
                    for h in handles:
                        h.flush()
                    rows = self.rows
                    for rec, x in zip(batch, ids):
                        seq = {"prompt": rec["prompt"], "ids": x, "offset": rows,
                               "response_start": len(rec["prompt_ids"])}
                        idx.write(json.dumps(seq) + "\n")
                        self.sequences.append(seq)
                        rows += len(x)
                    idx.flush()
        finally:
            for h in handles:
                h.close()
        self._mm = {}

    def _rows(self, name: str, file: Path, dtype, width: int, seq: dict) -> np.ndarray:
        mm = self._mm.get(name)
        if mm is None or mm.shape[0] < self.rows:
            mm = self._mm[name] = np.memmap(file, dtype=dtype, mode="r", shape=(self.rows, width))
        return np.array(mm[seq["offset"] : seq["offset"] + len(seq["ids"])])

    def features(self, seq: dict, dtype=torch.float32) -> torch.Tensor:
        """[T, width] features of one sequence (memory-mapped read; stored as bf16)."""
        rows = self._rows("features", self.bin_file, np.int16, self.index["width"], seq)
        return torch.from_numpy(rows).view(torch.bfloat16).to(dtype)

    def soft_targets(self, seq: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([T, k] int32 ids, [T, k] fp16 logits): the target's top-k at each position, or None."""
        if not self.topk:
            return None
        ids = self._rows("topk_ids", self.topk_ids_file, np.int32, self.topk, seq)
        vals = self._rows("topk_logits", self.topk_logits_file, np.float16, self.topk, seq)
        return torch.from_numpy(ids), torch.from_numpy(vals)


class DeviceFeatures:
    """Features (and top-k soft targets) of every sequence, kept on the target's device."""

    def __init__(self):
        self.sequences: list[dict] = []
        self._feats: list[torch.Tensor] = []
        self._soft: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.topk = 0

    def build(self, target, records: list[dict], layer_ids: list[int], min_response: int = 2,
              batch_tokens: int = 16384, deadline: float | None = None, topk: int = 0,
              feature_dtype=torch.bfloat16) -> "DeviceFeatures":
        self.topk = topk
        todo = _usable(records, {s["prompt"] for s in self.sequences}, min_response)
        for batch, ids, feats, top_ids, top_vals in target_batches(
                target, todo, layer_ids, topk=topk, batch_tokens=batch_tokens, deadline=deadline,
                feature_dtype=feature_dtype):
            for row, (rec, x) in enumerate(zip(batch, ids)):
                self.sequences.append({"prompt": rec["prompt"], "ids": x, "response_start": len(rec["prompt_ids"]),
                                       "index": len(self._feats)})
                self._feats.append(feats[row, : len(x)].clone())
                self._soft.append((top_ids[row, : len(x)].clone(), top_vals[row, : len(x)].clone()) if topk else None)
        return self

    @property
    def rows(self) -> int:
        return sum(len(s["ids"]) for s in self.sequences)

    def features(self, seq: dict, dtype=torch.float32) -> torch.Tensor:
        return self._feats[seq["index"]].to(dtype)

    def soft_targets(self, seq: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._soft[seq["index"]]
