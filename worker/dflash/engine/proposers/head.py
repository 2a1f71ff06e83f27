"""The next-token head: a one-token guess for free where nothing else proposes.

After every verify the engine knows the target's last residual stream h at the row whose
logits chose the token just committed (x). A small head, trained on the target's own greedy
answers (dflash.train.next_head), reads [final_norm(h); embedding(x)] and guesses the token
after x: one linear layer to the hidden size, an RMS norm, then the target's own output
embeddings of its K most frequent tokens. No cache, no context of its own: its price is two
small products (0.66 M + K x 576 multiply-adds), against a plain step's 134 M.

Why it pays: on the ort backend a plain step already runs two rows (a lone row goes through
the weights alone but attention twice, dflash.convert.onnx_target), so verifying one guessed
token costs ~1.03 plain steps, and a guess kept a quarter of the time pays four times over.
Measured on the bench suites' outputs (ort, Zen 4), at the steps where the suffix proposer
had no chain (a token new to the request and its workload), the head's guess was right 45 %
of the time on code, 27 % on chat, 33 % on agent and 26 % on `repetitive`; on held-out
corpus answers 50 %, with calibrated confidences (its softmax peak: at >= 0.8, right 85 %).

Where the suffix proposer has a chain but the match's earlier occurrences went more than
one way at its first position, the same call gives the head's distribution for that state,
and the suffix proposer picks the first token with it (dflash.engine.proposers.suffix,
`head_choice`): the head said which continuation, not whether one.

A guess is a point mass (`probs` None): the strict rule verifies it when sampling, so the
target's law is kept. The head reads the residual after the target's last layer *before*
the final norm, which is what the ort backend's last feature output is; a head says which
backends it was trained on and the engine loads it only for those.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash.engine.proposers.protocol import BaseProposer, Draft, RunningPrice
from dflash.errors import DFlashError

NAME = "head"
FORMAT = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EPS = 1e-5
_NO_TOKENS = torch.empty(0, dtype=torch.long)  # no guess (shared, never written)


def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


class NextHead(torch.nn.Module):
    """The trainable part: [final_norm(h); embedding(x)] -> hidden size, then an RMS norm's
    gain; the logits are its output times the frozen output embeddings of `vocab`."""

    def __init__(self, hidden: int, final_norm: torch.Tensor):
        super().__init__()
        self.proj = torch.nn.Linear(2 * hidden, hidden)
        self.gain = torch.nn.Parameter(final_norm.clone().float())
        self.register_buffer("final_norm", final_norm.clone().float())

    def forward(self, residual: torch.Tensor, next_embedding: torch.Tensor, out_embeddings: torch.Tensor):
        h = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + EPS) * self.final_norm
        u = self.proj(torch.cat([h, next_embedding], -1))
        z = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + EPS) * self.gain
        return z @ out_embeddings.T


def save(folder: Path, head: NextHead, vocab: list[int], info: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"proj.weight": head.proj.weight.detach().contiguous(), "proj.bias": head.proj.bias.detach(),
               "gain": head.gain.detach(), "final_norm": head.final_norm, "vocab": torch.tensor(vocab)}
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / WEIGHTS_FILE).chmod(0o644)
    (folder / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, **info}, indent=1) + "\n")


@dataclass
class HeadWeights:
    proj: np.ndarray  # [H, 2H]
    bias: np.ndarray  # [H]
    gain: np.ndarray  # [H]
    final_norm: np.ndarray  # [H]
    vocab: np.ndarray  # [K] target ids, most frequent first
    config: dict


def load(folder: str | Path) -> HeadWeights:
    """A head folder (config.json + model.safetensors); DFlashError bad_head naming the file."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
        t = load_file(str(folder / WEIGHTS_FILE))
        w = HeadWeights(t["proj.weight"].astype(np.float32), t["proj.bias"].astype(np.float32),
                        t["gain"].astype(np.float32), t["final_norm"].astype(np.float32),
                        t["vocab"].astype(np.int64), config)
    except Exception as exc:  # safetensors raises its own error types
        raise DFlashError("bad_head", f"cannot read the next-token head in {folder}: {exc}") from None
    H = w.bias.shape[0]
    shapes_ok = w.proj.shape == (H, 2 * H) and w.gain.shape == (H,) and w.final_norm.shape == (H,)
    if config.get("format") != FORMAT or not shapes_ok:
        raise DFlashError("bad_head", f"{folder / WEIGHTS_FILE} is not a next-token head of format {FORMAT}")
    return w


def fits(w: HeadWeights, target) -> bool:
    """Whether the head was made for this target and reads what its backend gives."""
    return (w.config.get("target") == target.name and target.backend in w.config.get("backends", ())
            and w.bias.shape[0] == target.hidden_size and w.config.get("layer") == target.num_layers - 1
            and int(w.vocab.max()) < target.vocab_size)


@dataclass
class HeadState:
    residual: np.ndarray | None  # the last layer's residual at the row that chose the last committed token


class HeadProposer(BaseProposer):
    """The head's part of a composed proposer (suffix_head.py): its guesses are ready offers,
    point masses priced by the call that made them."""

    name = NAME

    def __init__(self, target, weights: HeadWeights, bits: int | None = 8):
        self.w = weights
        self.layer_ids = (target.num_layers - 1,)
        from dflash.engine.drafter_graph import next_head_graph
        from dflash.engine.onnx_drafter import _session

        out = target.head_weight().detach().float()[torch.as_tensor(weights.vocab)].numpy()  # [K, H]
        self.embed = target.embed  # ids -> input embeddings (the token just committed)
        # Its two products in ONNX Runtime, 8-bit: after the target's forward has streamed its
        # weights through the caches, the head's come from memory, so its cost is the bytes read:
        # 8 bits read a quarter of fp32's. Not numpy: its OpenBLAS threads spin on after a
        # product, into the target's next forward; ONNX Runtime's stop when a call ends.
        self.session = _session(next_head_graph(weights.proj, weights.bias, weights.gain, out, EPS, bits=bits)
                                .SerializeToString(), torch.device("cpu"))
        self.price = RunningPrice(1e-4)  # one guess's
        self.index = np.full(int(weights.vocab.max()) + 1, -1, dtype=np.int64)  # target id -> place in vocab
        self.index[weights.vocab] = np.arange(len(weights.vocab))

    def start(self, state) -> HeadState:
        return HeadState(None)

    def layers_of(self, state) -> tuple[int, ...]:
        return self.layer_ids if NAME in state.proposals else ()

    def status(self) -> dict | None:
        """Its training record (held-out accuracy and the like)."""
        return self.w.config.get("heldout")

    @staticmethod
    def observe(state, features: torch.Tensor | None) -> None:
        """Rows entered the cache for good; the last of them chose the next token."""
        if features is not None and features.shape[0]:
            state.proposals[NAME].residual = features[-1].numpy()

    def propose(self, items: list[tuple[object, int]]) -> list[Draft]:
        """One guessed token (D = 2) per state, with its softmax peak as the confidence; an
        empty draft where the state has no residual yet."""
        return [self.guess(p) for p in self.distributions([state for state, _ in items])]

    def distributions(self, states: list) -> list[np.ndarray | None]:
        """Each state's distribution over the head's vocabulary (`w.vocab`) for the token
        after its last committed one; None where it has no residual yet. All states in one
        call: a call of 8 rows costs little more than one of 1 (0.35 against 0.27 ms right
        after a target forward, Zen 4); with 8 callers on chat that took 0.56 ms a step off."""
        t = time.perf_counter()
        ready = [i for i, state in enumerate(states) if state.proposals[NAME].residual is not None]
        out: list[np.ndarray | None] = [None] * len(states)
        if not ready:
            return out
        w = self.w
        e = self.embed(torch.tensor([states[i].output_ids[-1] for i in ready])).detach().float().numpy()
        r = np.stack([states[i].proposals[NAME].residual for i in ready])
        logits = self.session.run(None, {"x": np.concatenate([rms_norm(r, w.final_norm), e], axis=-1)})[0]
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        for n, i in enumerate(ready):
            out[i] = p[n]
        self.price.add((time.perf_counter() - t) / len(ready))
        return out

    def guess(self, probs: np.ndarray | None) -> Draft:
        """The most probable token of a distribution (`distributions`) as a draft, its
        probability as the confidence; an empty draft for None."""
        if probs is None:
            return Draft(_NO_TOKENS, None, [])
        j = int(probs.argmax())
        return Draft(torch.tensor([int(self.w.vocab[j])]), None, [float(probs[j])])

    def probability_of(self, probs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The probabilities of target ids `tokens` in a distribution (`distributions`);
        0 for a token outside the head's vocabulary."""
        tokens = np.asarray(tokens, dtype=np.int64)
        at = np.full(len(tokens), -1, dtype=np.int64)
        inside = tokens < len(self.index)
        at[inside] = self.index[tokens[inside]]
        return np.where(at >= 0, probs[np.maximum(at, 0)], 0.0)


def made_for(folder: str | Path) -> str | None:
    """The target a head folder says it was made for (None: no head there, or unreadable),
    read from its config alone (cheap: --head auto weighs every head it knows)."""
    try:
        return json.loads((Path(folder) / CONFIG_FILE).read_text()).get("target")
    except (OSError, ValueError, AttributeError):
        return None


def for_target(target, folders, bits: int | None = 8) -> HeadProposer | None:
    """The first head in `folders` (a folder, or a list of them in order of preference) made for
    this target and the backend it runs in, as a proposer (its products in `bits`-bit weights,
    None: fp32); None where none fits. A head made for another target is never loaded."""
    if folders is None:
        return None
    for folder in [folders] if isinstance(folders, (str, Path)) else folders:
        if made_for(folder) != target.name:
            continue
        w = load(folder)
        if fits(w, target):
            return HeadProposer(target, w, bits)
    return None
