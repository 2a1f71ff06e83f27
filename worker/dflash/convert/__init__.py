"""Drafters in the formats other runtimes load: llama.cpp's DFlash GGUF and ONNX.

`convert_drafter` is what `dflash convert` runs. Every path reads the drafter as stored
(config + tensors in their stored dtype) and writes the output whole or not at all (a
temporary file renamed into place), so a bad input leaves nothing half-written.

- HF folder -> GGUF (`gguf_file.py`): llama.cpp's layout, tensors copied bit for bit
  (`--outtype f32` widens them, which is exact).
- GGUF -> HF folder (`hf_folder.py`): the published layout back; HF -> GGUF -> HF gives
  the same tensors bit for bit and the same config.json.
- HF folder or GGUF -> ONNX (`onnx_file.py`): one drafter step as a graph with the draft
  cache as explicit inputs/outputs, run by `dflash.engine.onnx_drafter`.
"""

from __future__ import annotations

from pathlib import Path

from dflash.errors import DFlashError

FORMATS = ("gguf", "onnx", "hf")
OUTTYPES = ("auto", "f32", "bf16", "f16")


def read_stored_drafter(path: Path):
    """(DrafterConfig, tensors as stored) from a published folder or a `.gguf` file."""
    from dflash.engine.drafter import read_drafter_folder

    if path.suffix == ".onnx":
        raise DFlashError("bad_drafter", f"{path} is an ONNX graph; convert from the folder or GGUF it was made from")
    if path.suffix == ".gguf":
        from dflash.convert.gguf_file import read_gguf_drafter

        return read_gguf_drafter(path)
    return read_drafter_folder(path)


def convert_drafter(src: str | Path, to: str, out: str | Path, target: str | Path | None = None,
                    outtype: str = "auto") -> Path:
    """`target` (its GGUF file or Hugging Face folder) is checked against the drafter; for
    GGUF it also supplies the vocabulary (required: `dflash convert` gives the embedded
    target's by default), and for a GGUF that llama.cpp's converter wrote, the target's
    layer count."""
    from dflash.convert.vocab import check_fits, target_vocabulary

    src, out = Path(src), Path(out)
    if to not in FORMATS:
        raise DFlashError("bad_format", f"--to must be one of {', '.join(FORMATS)}, got '{to}'")
    if outtype not in OUTTYPES:
        raise DFlashError("bad_format", f"--outtype must be one of {', '.join(OUTTYPES)}, got '{outtype}'")
    if out.resolve() == src.resolve():
        raise DFlashError("bad_format", "the output must not overwrite the input")
    if to == "hf":
        from dflash.convert.gguf_file import read_gguf_drafter
        from dflash.convert.hf_folder import write_hf_drafter

        if src.suffix != ".gguf":
            raise DFlashError("bad_format", f"--to hf converts a .gguf file back to a folder; {src} is not one")
        shape, _ = target_vocabulary(target, with_vocab=False) if target else (None, None)
        cfg, state = read_gguf_drafter(src, num_target_layers=shape.num_layers if shape else None)
        if shape:
            check_fits(shape, cfg)
        write_hf_drafter(cfg, state, out)
        return out
    cfg, state = read_stored_drafter(src)
    if to == "gguf":
        from dflash.convert.gguf_file import write_gguf_drafter

        shape, vocab = target_vocabulary(target)
        check_fits(shape, cfg)
        write_gguf_drafter(cfg, state, out, vocab, outtype=outtype, name=src.stem if src.is_file() else src.name)
        return out
    if target:
        check_fits(target_vocabulary(target, with_vocab=False)[0], cfg)
    from dflash.convert.onnx_file import export_onnx

    export_onnx(cfg, state, out)
    return out
