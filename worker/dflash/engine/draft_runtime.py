"""The drafter's precision and runtime: named, or measured fastest on this device.

`draft_dtype` auto (or a precision with several runtimes) times each candidate's draft of a
short block with the target's forward after it, once per machine, threads, drafter and
runtime versions, and keeps the answer beside the cost curves (`cached_draft_choice`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.engine.dtypes import DRAFT_DTYPES
from dflash.engine.proposers.dflash import DFlashProposer
from dflash.engine.sampling import argmax_rows
from dflash.engine.target import Target
from dflash.engine.versions import model_digest
from dflash.errors import DFlashError


def resolve_draft_dtype(choice, target: Target) -> torch.dtype | None:
    """The precision the drafter computes in. None: the target's (drafts bit-identical to the
    reference implementation's at fp32). "auto": None here, and the engine measures (see
    fastest_draft). Or a name of DRAFT_DTYPES."""
    if choice is None:
        return target.dtype
    if isinstance(choice, torch.dtype):
        return choice
    if choice == "auto":
        return None
    if choice not in DRAFT_DTYPES:
        raise DFlashError("bad_dtype", f"draft dtype must be auto or one of {', '.join(DRAFT_DTYPES)}, got '{choice}'")
    if choice == "int8" and target.device.type != "cpu":
        raise DFlashError("bad_dtype", "draft dtype int8 runs on a CPU only")
    return DRAFT_DTYPES[choice]


def dtype_name(dtype: torch.dtype) -> str:
    """The name the options use (int8 for the int8-weight drafter)."""
    return next((k for k, v in DRAFT_DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))


def draft_candidates(target: Target) -> list[tuple[torch.dtype, str]]:
    """What `auto` tries, as (precision, runtime): on a GPU the target's dtype; on a CPU fp32,
    bf16 where the CPU has native bf16 matrix instructions (elsewhere it is ~100x slower),
    int8 weights in PyTorch, and the int8 drafter as one ONNX Runtime graph."""
    if target.device.type != "cpu":
        return [(target.dtype, "torch")]
    out = [(torch.float32, "torch")]
    if torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        out.append((torch.bfloat16, "torch"))
    out.append((torch.qint8, "torch"))
    try:
        import onnxruntime  # noqa: F401

        out.append((torch.qint8, "onnx"))
    except ImportError:
        pass
    return out


def cached_draft_choice(directory: Path | None, target: Target, drafter, vocab, only, sha256) -> tuple[torch.dtype, str]:
    """fastest_draft's answer, measured once per machine, threads, drafter and runtimes and
    kept beside the cost curves (a wrong choice costs speed, never output, so it is not
    spot-checked; a new drafter, vocabulary or runtime version measures again)."""
    import json

    from dflash.engine.costs import cpu_name, keyed_file, write_keyed
    from dflash.engine.target.fastest import runtime_versions

    names = {dtype_name(d): d for d, _ in draft_candidates(target)}
    key = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "device": str(target.device),
           "drafter": sha256 or "unversioned", "vocab": None if vocab is None else int(vocab.numel()),
           "only": None if only is None else dtype_name(only), "versions": runtime_versions(),
           "target": getattr(target, "backend", "hf"), "target_build": target.build,
           "timed": "draft and the verify after it"}  # what fastest_draft times (older choices timed the draft alone)
    path = None
    if directory is not None and sha256 is not None:
        path = keyed_file(directory, "draft-choice", key)
        try:
            got = json.loads(path.read_text())
            if got.get("key") == key and got.get("dtype") in names:
                return names[got["dtype"]], got["runtime"]
        except (OSError, ValueError):
            pass
    dtype, runtime = fastest_draft(target, drafter, vocab, only, sha256=sha256)
    if path is not None:
        write_keyed(path, {"key": key, "dtype": dtype_name(dtype), "runtime": runtime})
    return dtype, runtime


@torch.inference_mode()
def fastest_draft(target: Target, drafter, vocab: torch.Tensor | None, only: torch.dtype | None = None,
                  repeats: int = 5, sha256: str | None = None) -> tuple[torch.dtype, str]:
    """The drafter precision and runtime (of draft_candidates; of precision `only` if given)
    whose draft of a short block after a short context, with the target's forward that
    follows every draft, runs fastest here: a runtime whose threads spin on after the draft
    slows that forward (PyTorch's OpenMP kernels did: a drafted step of 4 on the ort target
    2.23 plain steps instead of 1.53), which the draft's own time does not show. Drafts are
    proposals: the choice changes how often they are kept, never the output. Measured at
    start, in a second or two."""
    import copy

    from dflash.engine.costs import probe_prompt, timed
    from dflash.engine.target import TargetRow

    candidates = [c for c in draft_candidates(target) if only is None or c[0] == only]
    if len(candidates) == 1 or not isinstance(drafter, torch.nn.Module):
        return candidates[0] if candidates else (only, "torch")
    cfg = drafter.config
    context = torch.randn(16, cfg.num_features * cfg.hidden_size, device=target.device)
    # The drafter's own digest names its built graph (a shared placeholder would hand one
    # drafter another's graph).
    sha256 = sha256 or model_digest(drafter)
    seq, prompt = target.new_sequence(), probe_prompt(target, context.shape[0])
    target.forward_batch([TargetRow(seq, prompt, 1)])
    # Rounds in which every candidate is timed once in turn, the fastest round of each kept
    # (as the cost curve is measured): a slow moment of a shared machine (a database starting
    # beside the worker) then costs every candidate one sample, not one candidate all of them,
    # which would otherwise crown a candidate several times slower.
    # A proposer in fp32 or int8 drafts from the drafter as it is (int8: from a quantized
    # copy); one in another precision converts the module in place, so it gets a copy.
    proposers = [DFlashProposer(target, drafter if dtype in (torch.float32, torch.qint8) else copy.deepcopy(drafter),
                                "probe", sha256, dtype, vocab, runtime) for dtype, runtime in candidates]
    best_s = [float("inf")] * len(candidates)
    try:
        for round_ in range(repeats):  # the first round warms every candidate up
            for i, proposer in enumerate(proposers):
                state = proposer.start(None)

                def drafted_step():
                    logits = proposer.draft_logits([(state, context, 0, context.shape[0], 4)])[0]
                    target.forward_batch([TargetRow(seq, [0] + argmax_rows(logits).tolist(), 4)])

                took = timed(drafted_step, target.device, 1, after=lambda: target.rollback(seq, len(prompt)))
                if round_:
                    best_s[i] = min(best_s[i], took)
    finally:
        target.free(seq)
    drafter.to(dtype=torch.float32)
    return candidates[min(range(len(candidates)), key=best_s.__getitem__)]
