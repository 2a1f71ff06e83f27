"""The files of the ort backend's export: what dflash.convert.onnx_target writes and
dflash.engine.target.ort runs. In the core layer, below both, so the runtime need not import
the converter, and the worker image's model stage (docker/worker.Dockerfile) copies one small
file more rather than the engine."""

import json
from pathlib import Path

MODEL_FILE = "model.onnx"
MANIFEST = "dflash-onnx-target.json"  # what made the export: {"key": {**BUILD, "source": ...}, "builder": ...}
BATCH_GRAPHS = (2, 4, 8)  # the sequences per call of the batch graphs (dflash.convert.onnx_target)


def batch_file(k: int) -> str:
    """The graph that runs k sequences in one call, beside MODEL_FILE."""
    return f"model-batch{k}.onnx"


def read_build(folder: str | Path) -> dict | None:
    """What the export in `folder` was made as (dflash.convert.onnx_target.BUILD: format,
    precision, block size), from its manifest; None where there is none (a graph from
    elsewhere)."""
    try:
        key = json.loads((Path(folder) / MANIFEST).read_text())["key"]
        return {k: v for k, v in key.items() if k != "source"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
