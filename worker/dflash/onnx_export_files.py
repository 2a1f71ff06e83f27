"""The files of the ort backend's export: what dflash.convert.onnx_target writes and
dflash.engine.target.ort runs. In the core layer, below both, so the runtime need not import
the converter, and the worker image's model stage (docker/worker.Dockerfile) copies one small
file more rather than the engine."""

MODEL_FILE = "model.onnx"
BATCH_GRAPHS = (2, 4, 8)  # the sequences per call of the batch graphs (dflash.convert.onnx_target)


def batch_file(k: int) -> str:
    """The graph that runs k sequences in one call, beside MODEL_FILE."""
    return f"model-batch{k}.onnx"
