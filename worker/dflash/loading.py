"""Loading models from disk into an engine: drafters in every format (a published folder, a
llama.cpp `.gguf`, an `.onnx` graph), their versions, the target, and the CLI's model options.

Above the engine and the formats (dflash.convert), below what serves, trains and benches:
they all load through here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash.engine.knobs import BUSY_CALLERS, DRAFT_DTYPE_NAMES, DTYPE_NAMES
from dflash.errors import DFlashError

RANDOM_DRAFTER_WARNING = (
    "warning: no trained default drafter ships yet; using a random-weight drafter. "
    "Output is exactly the target's, but drafts are rarely accepted (tau ~ 1). For tests only."
)


def load_drafter(path: str | Path, device="cpu", dtype=None):
    """A drafter from the published folder, a `.gguf` file (llama.cpp's DFlash layout) or an
    `.onnx` file (run by ONNX Runtime); see dflash.convert."""
    import torch

    from dflash.engine.drafter import drafter_from_state, read_drafter_folder

    dtype = dtype or torch.float32
    path = Path(path)
    if path.suffix == ".onnx":
        from dflash.engine.onnx_drafter import OnnxDrafter

        return OnnxDrafter.load(path).to(device=device, dtype=dtype).eval()
    if path.suffix == ".gguf":
        from dflash.convert.gguf_file import read_gguf_drafter

        cfg, state = read_gguf_drafter(path)
    else:
        cfg, state = read_drafter_folder(path)
    return drafter_from_state(cfg, state).to(device=device, dtype=dtype).eval()


def load_versioned(path: str | Path, device="cpu", dtype=None) -> tuple[object, str | None]:
    """A drafter and its digest (dflash.engine.versions), reading the weights once. Folders
    are digested as stored; other formats (.gguf, .onnx) as loaded."""
    import torch

    from dflash.engine.drafter import drafter_from_state, read_drafter_folder
    from dflash.engine.versions import digest, model_digest
    from dflash.errors import DFlashError

    dtype = dtype or torch.float32
    path = Path(path)
    if path.is_dir():
        cfg, state = read_drafter_folder(path)
        sha = digest(cfg, state)
        return drafter_from_state(cfg, state).to(device=device, dtype=dtype).eval(), sha
    if not path.exists():
        raise DFlashError("bad_drafter", f"drafter not found: {path}")
    model = load_drafter(path, device=device, dtype=dtype)
    return model, model_digest(model)


TARGET_BACKENDS = ("auto", "hf", "llamacpp", "ort", "ort-q4_1", "ort-q4_k_m", "ort-int4")


def load_engine(target_dir, drafter_dir, device: str = "cpu", dtype: str = "float32", random_drafter=False,
                cost_dir: Path | None = None, draft_dtype: str | None = None, target_backend: str = "auto",
                target_gguf: Path | None = None, draft_vocab: str | None = "auto", head: str | None = "auto",
                draft_model: str | None = None, serving: bool = False):
    """An Engine over the target folder and the drafter (any format; None: no DFlash drafter,
    the free proposers only), on `device` in `dtype`.
    The target runs in `target_backend` (dflash.engine.target: hf, the reference; llamacpp,
    the GGUF `target_gguf` in llama.cpp; ort, an int8 ONNX export in ONNX Runtime; the last
    two on a CPU); auto takes the one this machine runs fastest (see `fastest_engine`).
    `draft_vocab`: the drafter's draft vocabulary (dflash.engine.draft_vocab: auto, full or
    a file). `head`: the next-token head (dflash.engine.proposers.head): auto (one made for
    the target and backend, shipped or made here), none, or a folder. `draft_model`: a smaller
    model with the target's tokenizer that drafts token by token (a name, a GGUF file or a
    folder; see load_draft_model), or None."""
    import torch

    from dflash.engine import draft_vocab as vocab_file
    from dflash.engine.dtypes import DTYPES
    from dflash.engine.engine import Engine
    from dflash.errors import DFlashError
    from dflash.model_files import probe_dir

    if dtype not in DTYPES:
        raise DFlashError("bad_dtype", f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("bad_device", "device 'cuda' was asked for but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise DFlashError("bad_device", f"device must be 'cpu' or 'cuda[:N]', got '{device}'")
    if target_backend not in TARGET_BACKENDS:
        raise DFlashError("bad_params",
                          f"--target-backend must be one of {', '.join(TARGET_BACKENDS)}, got '{target_backend}'")
    drafter, sha, vocab = None, None, None
    if drafter_dir is not None:
        drafter, sha = load_versioned(drafter_dir, device=device, dtype=DTYPES[dtype])
        vocab = vocab_file.for_drafter(drafter_dir if Path(drafter_dir).is_dir() else None, draft_vocab)
    builders = target_builders(target_dir, device, dtype, target_gguf)
    head_dir = head_folder(head, Path(target_dir).name)
    small = load_draft_model(draft_model, device, dtype) if draft_model else None

    def engine_over(target, draft_dtype=draft_dtype):
        return Engine(target, drafter, drafter_name=Path(drafter_dir).name if drafter_dir is not None else None,
                      random_drafter=random_drafter, cost_dir=cost_dir, drafter_sha256=sha, draft_dtype=draft_dtype,
                      draft_vocab=vocab, head_dir=head_dir, draft_model=small)

    probes = probe_dir()
    if target_backend != "auto":
        checked = builders[target_backend].require(probes, features=drafter is not None)
        target = builders[target_backend]()
        target.selection = {"backend": target.backend, "how": "asked for (--target-backend)",
                            "backends": {target_backend: checked}}
        return engine_over(target)
    ready = [name for name, build in builders.items() if build.why_not is None and build.ready and build.auto]
    # A native backend runs in this process only once a child has run it here (probe.py).
    verdicts = {name: builders[name].verdict(probes) for name in ready}
    runnable = [name for name in ready if verdicts[name].usable and (verdicts[name].features or drafter is None)]
    backends = {name: v.line() for name, v in verdicts.items()}
    if runnable == ["hf"]:
        target = builders["hf"]()
        target.selection = {"backend": "hf", "how": "the only backend ready for this device, dtype and target",
                            "not_candidates": {k: b.why_not or backends.get(k) or b.left_out() for k, b in
                                               builders.items() if k != "hf"},
                            "backends": backends}
        return engine_over(target)
    engine = fastest_engine({k: builders[k] for k in runnable}, engine_over, target_dir, cost_dir, serving)
    engine.target.selection["backends"] = backends
    return engine


class _Builder:
    """Makes one backend's target. `why_not`: why it cannot run here (None: it can);
    `ready`: whether it can start without preparing its model first (auto takes only those:
    llama.cpp needs a GGUF, ort an export that `dflash models` or a first
    `--target-backend ort` makes). `probe`: how a child process builds it, for the probe of a
    native backend (dflash.engine.target.probe; None: the reference, not probed), with
    `build`, what else makes its code (an export's build) and `reference`, how a child builds
    the reference path it is compared with. `auto`: whether auto may choose it (not a
    build whose answers part from the target's shipped weights sooner: it is asked for)."""

    def __init__(self, make, why_not: str | None, ready: bool = True, name: str = "", target_dir=None,
                 probe=None, reference=None, build: dict | None = None, auto: bool = True):
        self.make, self.why_not, self.ready, self.auto = make, why_not, ready, auto
        self.name, self.target_dir, self.probe, self.reference, self.build = name, target_dir, probe, reference, build

    def left_out(self) -> str:
        """Why auto leaves it out before probing it, where it can run here: its model is not
        prepared, or it is asked for by name only (else: it is a candidate)."""
        if not self.ready:
            return (f"not prepared (dflash models, or --target-backend {self.name} once)" if self.auto
                    else f"not prepared (--target-backend {self.name} once; never chosen by auto)")
        return "a candidate of auto" if self.auto else f"chosen by name only (--target-backend {self.name})"

    def __call__(self):
        if self.why_not is not None:
            raise DFlashError("bad_target", f"this target backend cannot run here: {self.why_not}")
        return self.make()

    def verdict(self, directory: Path):
        """Whether it runs here (probed in a child the first time; the reference always does)."""
        from dflash.engine.target import probe

        if self.probe is None or self.why_not is not None:
            return probe.Verdict(self.name, True, None, "", "", 0.0, {}, None, features=True)
        return probe.verdict(self.name, self.target_dir, self.probe, self.reference, directory, self.build)

    def require(self, directory: Path, features: bool) -> str:
        """The verdict's line, or a clean error where it failed its probe here, or cannot give
        the layer features a DFlash drafter reads (`features`: the engine has one)."""
        from dflash.engine.target import probe

        if self.probe is None or self.why_not is not None:
            return "usable" if self.why_not is None else self.why_not
        v = probe.require(self.name, self.target_dir, self.probe, self.reference, directory, self.build)
        if features and not v.features:
            raise DFlashError("incompatible_drafter", f"the {self.name} target backend gives no layer features for "
                                                      f"{Path(self.target_dir).name} ({v.features_reason}): a DFlash "
                                                      "drafter cannot run on it; choose another --target-backend")
        return v.line()


def build_backend(backend: str, target_dir: str, device: str = "cpu", dtype: str = "float32",
                  gguf: str | None = None):
    """One backend's target, as a probe's child builds it (dflash.engine.target.probe.Spec)."""
    return target_builders(target_dir, device, dtype, Path(gguf) if gguf else None)[backend]()


def target_builders(target_dir, device: str = "cpu", dtype: str = "float32", gguf: Path | None = None) -> dict:
    """Every target backend's builder for this target, device and dtype (see _Builder)."""
    import torch

    from dflash.convert import onnx_gguf, onnx_q41
    from dflash.convert.onnx_target import BUILD as onnx_target_build
    from dflash.convert.onnx_target import INT4_BUILD, ensure_export, is_current
    from dflash.convert.target_gguf import has_weights, unknown_architecture
    from dflash.engine.dtypes import DTYPES
    from dflash.engine.target import llamacpp, ort, probe
    from dflash.model_files import onnx_export_dir

    cpu32 = None if device == "cpu" and dtype == "float32" else f"it runs float32 on a CPU (asked: {dtype} on {device})"
    # A GGUF target converted for llama.cpp alone (dflash.model_files.resolve_target) has no
    # weights for the others to read or export.
    unknown = unknown_architecture(target_dir)
    no_weights = None if has_weights(target_dir) else (
        f"{target_dir} holds the tokenizer and config of {Path(gguf).name if gguf else 'a GGUF file'} only "
        "(llama.cpp runs the file as it is; " + (f"transformers does not know its architecture '{unknown}'"
                                                 if unknown else "another backend asked for converts its weights once")
        + ")")
    export, export_q41 = onnx_export_dir(target_dir), onnx_export_dir(target_dir, onnx_q41.PRECISION)
    exported = is_current(Path(target_dir), export)
    exported_q41 = onnx_q41.is_current(Path(target_dir), export_q41)
    export_gguf = onnx_export_dir(target_dir, onnx_gguf.PRECISION)
    exported_gguf = onnx_gguf.is_current(Path(target_dir), export_gguf, gguf)
    export_int4 = onnx_export_dir(target_dir, INT4_BUILD["precision"])
    exported_int4 = is_current(Path(target_dir), export_int4, INT4_BUILD)

    def hf():
        from dflash.engine.target.hf import HFTarget  # transformers' model code: seconds to import, when built

        return HFTarget.from_pretrained(target_dir, device=device, dtype=DTYPES[dtype])

    def gguf_target():
        try:
            return llamacpp.LlamaCppTarget(gguf, target_dir, threads=torch.get_num_threads())
        except DFlashError as exc:
            if exc.code != "bad_target" or not Path(gguf).is_file():
                raise
            from dflash.convert.target_gguf import read_header

            # The file's header says what is wrong where it can: cut short, not GGUF, or which
            # architecture llama.cpp was given.
            arch = read_header(Path(gguf)).architecture
            raise DFlashError("bad_target", f"{exc.message} (architecture '{arch}')") from None

    def onnx_target():
        return ort.OrtTarget(ensure_export(target_dir, export, quiet=False), target_dir, threads=torch.get_num_threads())

    def onnx_int4_target():
        return ort.OrtTarget(ensure_export(target_dir, export_int4, quiet=False, build=INT4_BUILD), target_dir,
                             threads=torch.get_num_threads())

    def onnx_q41_target():
        return ort.OrtTarget(onnx_q41.ensure_export(target_dir, export_q41, export, quiet=False), target_dir,
                             threads=torch.get_num_threads())

    def onnx_gguf_target():
        return ort.OrtTarget(onnx_gguf.ensure_export(target_dir, export_gguf, export, gguf, quiet=False), target_dir,
                             threads=torch.get_num_threads())

    ort_missing = no_weights or cpu32 or (None if ort.available() else "onnxruntime is not installed")
    where = {"target_dir": str(target_dir), "device": device, "dtype": dtype, "gguf": str(gguf) if gguf else None}

    def native(backend: str, build: dict | None = None) -> dict:
        return {"name": backend, "target_dir": target_dir, "build": build,
                "probe": probe.Spec(f"{__name__}:build_backend", {"backend": backend, **where}),
                # without weights no reference runs: the probe judges crashes alone
                "reference": probe.Spec(f"{__name__}:build_backend", {"backend": "hf", **where})
                if no_weights is None else None}

    return {
        "hf": _Builder(hf, no_weights, name="hf", target_dir=target_dir),
        "llamacpp": _Builder(gguf_target, cpu32 or (
            None if llamacpp.available() else "llama-cpp-python is not installed (make setup installs it)") or (
            None if gguf is not None else "no GGUF of the target (--target-gguf FILE; the embedded default has one)"),
            **native("llamacpp", {"gguf": probe.file_stamp(gguf)})),
        "ort": _Builder(onnx_target, ort_missing or _exporter_why_not(exported), ready=exported,
                        **native("ort", onnx_target_build)),
        "ort-q4_1": _Builder(onnx_q41_target, ort_missing or _exporter_why_not(exported or exported_q41),
                             ready=exported_q41, **native("ort-q4_1", onnx_q41.BUILD)),
        "ort-q4_k_m": _Builder(onnx_gguf_target, ort_missing or _gguf_why_not(gguf, exported or exported_gguf),
                               ready=exported_gguf,
                               **native("ort-q4_k_m", {**onnx_gguf.BUILD, "gguf": probe.file_stamp(gguf)})),
        "ort-int4": _Builder(onnx_int4_target, ort_missing or _exporter_why_not(exported_int4), ready=exported_int4,
                             auto=False, **native("ort-int4", INT4_BUILD)),
    }


def _exporter_why_not(exported: bool) -> str | None:
    """Why an ort build cannot run (None: it can): its export is not there and cannot be made."""
    from dflash.convert.onnx_target import builder_version

    return None if builder_version() or exported else \
        "onnxruntime-genai (the exporter) is not installed (make setup installs it)"


def _gguf_why_not(gguf: Path | None, exported: bool) -> str | None:
    """Why the ort backend's q4_k_m build cannot run a target (None: it can): it takes the
    blocks of a Q4_K_M (or Q4_K_S) GGUF, and its export needs the builder."""
    from dflash.convert import onnx_gguf

    if gguf is None or not Path(gguf).is_file():
        return "the target has no GGUF file (the q4_k_m build holds a Q4_K_M file's blocks)"
    try:
        kind = onnx_gguf.file_type(gguf)
    except DFlashError as exc:
        return exc.message
    if kind is None:
        return f"{Path(gguf).name} is not a Q4_K_M or Q4_K_S file"
    return _exporter_why_not(exported)


def doctor_report(target_dir, gguf: Path | None = None, reprobe: bool = False) -> dict:
    """What a user's report should carry: the CPU, the instruction sets that decide which
    kernels run, how llama.cpp was built, and each target backend's verdict here (probing the
    ones not probed yet; `reprobe`: this CPU's verdicts forgotten first)."""
    from dflash import llamacpp_build
    from dflash.engine.costs import cpu_name
    from dflash.engine.target import llamacpp, probe
    from dflash.model_files import probe_dir

    directory = probe_dir()
    cpu = cpu_name()
    forgotten = probe.forget(directory, cpu) if reprobe else 0
    flags = set()
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    backends = {}
    for name, builder in target_builders(target_dir, gguf=gguf).items():
        if builder.why_not is not None:
            backends[name] = f"not a candidate: {builder.why_not}"
        elif not builder.ready:
            backends[name] = builder.left_out()
        else:
            backends[name] = builder.verdict(directory).line()
    return {
        "cpu": cpu,
        "flags": sorted(f for f in flags if f.startswith(DOCTOR_FLAG_PREFIXES)),
        "llama_cpp": llamacpp.system_info() if llamacpp.available() else None,
        "llama_cpp_build_flags": llamacpp_build.cmake_args("binding"),
        "target": str(target_dir),
        "verdicts": str(directory),
        "forgotten": forgotten,
        "backends": backends,
    }


# The CPU flags a report shows: the vector and matrix extensions the runtimes choose kernels by.
DOCTOR_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


def load_target(target_dir, backend: str, device: str = "cpu", dtype: str = "float32", gguf: Path | None = None):
    """The target in the backend named (not auto: choosing needs the drafter, see load_engine)."""
    if backend not in TARGET_BACKENDS or backend == "auto":
        raise DFlashError("bad_params", f"load_target takes one of {', '.join(TARGET_BACKENDS[1:])}, got '{backend}'")
    from dflash.model_files import probe_dir

    builder = target_builders(target_dir, device, dtype, gguf)[backend]
    checked = builder.require(probe_dir(), features=False)
    target = builder()
    target.selection = {"backend": target.backend, "how": "asked for (--target-backend)", "backends": {backend: checked}}
    return target


def load_draft_model(spec: str, device: str = "cpu", dtype: str = "float32"):
    """--draft-model: a smaller model with the target's tokenizer (a model name, a GGUF file or a
    Hugging Face folder, resolved as --target is), as a target of its own: in llama.cpp where it
    has a GGUF that this machine's llama.cpp runs (it needs no layer features), else in
    transformers. The engine checks its tokenizer against the target's."""
    from dflash.model_files import probe_dir, resolve_target

    files = resolve_target(spec)
    native = target_builders(files.folder, device, dtype, files.gguf)["llamacpp"]
    backend = "llamacpp" if native.why_not is None and native.verdict(probe_dir()).usable else "hf"
    return load_target(files.folder, backend, device, dtype, files.gguf)


def fastest_engine(builders: dict, engine_over, target_dir, cost_dir: Path | None, serving: bool = False):
    """The engine over the target backend that decodes fastest here with block length auto:
    per backend a plain step, verify blocks of 2 and 4 (with the drafter's features) and the
    drafter's price for such blocks; the backend of the least worst ratio to the best over a
    worker's workloads (no drafts, paid drafts, free drafts at the policy's default acceptance
    prior: dflash.engine.target.fastest.choose), for a `serving` worker with a step of several
    callers as well (fastest.choice_seconds); a candidate whose plain step alone rules it
    out is passed over (fastest.ruled_out_above). Measured once per machine, thread count
    and versions, cached beside the cost curves; at a later start the chosen backend's plain
    step is timed again, and a choice whose step got STALE times slower is measured afresh."""
    import torch

    from dflash import __version__
    from dflash.convert import onnx_gguf, onnx_q41, onnx_target
    from dflash.engine.costs import TYPICAL_CONTEXT, cpu_name, spot_prices
    from dflash.engine.target import fastest

    key = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "target": Path(target_dir).name,
           "context": TYPICAL_CONTEXT, "chosen_by": fastest.WEIGHED,
           "candidates": sorted(builders), "versions": fastest.runtime_versions(), "dflash": __version__,
           "ort_build": onnx_target.BUILD, "ort_q4_1_build": onnx_q41.BUILD,
           # (only where it is a candidate: the choices cached for other targets stay valid)
           **({"ort_q4_k_m_build": onnx_gguf.BUILD} if "ort-q4_k_m" in builders else {}),
           **({"objective": f"serving ({BUSY_CALLERS} callers)"} if serving else {})}
    record = fastest.cached_choice(cost_dir, key)
    if record is not None:
        engine = engine_over(builders[record["choice"]]())
        if not fastest.is_stale(record, fastest.step_seconds(engine.target, engine.layer_ids, repeats=5)):
            engine.target.selection = {"backend": engine.target.backend, "how": "measured earlier (cached), "
                                       "spot-checked", **fastest.summary(record)}
            return engine
        del engine
    measured, same, failed, passed_over = {}, {}, {}, {}
    kept = {}  # the chosen engine so far, by name: kept, so the winner is usually not built a second time
    acceptance = fastest.default_acceptance()
    # The reference last: on a CPU the likeliest to lose, so the one a plain step may rule out.
    for name in sorted(builders, key=lambda n: n == "hf"):
        try:
            target = builders[name]()
            if measured:
                plain = fastest.step_seconds(target, (), repeats=3)
                if plain > fastest.ruled_out_above(measured, acceptance, serving):
                    passed_over[name] = plain
                    del target
                    continue
            engine = engine_over(target, **same)
        except DFlashError as exc:  # a candidate that cannot load is not chosen (asked for, it is an error)
            failed[name] = exc
            continue
        same = {"draft_dtype": engine.draft_dtype}  # as the first backend measured it
        measured[name] = spot_prices(engine)
        if fastest.choose(measured, acceptance, serving) == name:
            kept = {name: engine}  # as fastest.remember will choose
        del engine, target
    if not measured:  # none can run it (a drafter that fits no backend's target): the first one's reason
        raise next(iter(failed.values()))
    failed = {name: exc.message for name, exc in failed.items()}
    record = fastest.remember(cost_dir, key, measured, passed_over, serving)
    record["failed"] = failed
    # A later candidate can change which earlier one has the least worst ratio (it sets a
    # workload's best): then the chosen engine is built again.
    engine = kept.pop(record["choice"]) if record["choice"] in kept else \
        engine_over(builders[record["choice"]](), **same)
    engine.target.selection = {"backend": engine.target.backend, "how": "measured at start", **fastest.summary(record)}
    return engine


def head_folder(choice: str | None, target_name: str | None = None) -> Path | list[Path] | None:
    """--head's folders: auto (every head made for `target_name`, shipped or made here, in
    order of preference: dflash.model_files.head_candidates), none, or a folder holding one."""
    from dflash.engine.proposers.head import CONFIG_FILE
    from dflash.errors import DFlashError
    from dflash.model_files import head_candidates

    if choice in (None, "none"):
        return None
    if choice == "auto":
        return head_candidates(target_name) if target_name is not None else None
    if not (Path(choice) / CONFIG_FILE).is_file():
        raise DFlashError("bad_head", f"--head {choice}: no next-token head there (no config.json)")
    return Path(choice)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="the target: a Hugging Face model folder, a GGUF file (converted once into the cache) "
                   "or an installed model's name (dflash models --list) (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="DFlash drafter: folder in the published layout, .gguf (llama.cpp's layout) or "
                   ".onnx (run by ONNX Runtime) (default: the project's drafter)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--threads", type=int, help="CPU threads (torch's and llama.cpp's; default: torch's choice)")
    p.add_argument("--target-backend", default="auto", choices=TARGET_BACKENDS,
                   help="what runs the target: hf (transformers, the reference), llamacpp (its GGUF in llama.cpp, "
                        "CPU), ort (an int8 ONNX export in ONNX Runtime, CPU), ort-q4_1 / ort-q4_k_m (the same graph "
                        "with a Q4_1 / Q4_K_M target's weights exactly, CPU), ort-int4 (a 4-bit export, asked for by "
                        "name only: docs/models.md), auto (default: the one that decodes "
                        f"fastest here, measured once and cached; for `serve`, a lone request and one among "
                        f"{BUSY_CALLERS} callers weighed alike)")
    p.add_argument("--target-gguf", help="the target as GGUF for --target-backend llamacpp (default: --target's own GGUF "
                   "where it is one, a named model or the embedded default); alone, it is the target")
    p.add_argument("--draft-dtype", default="auto", choices=["auto", *DRAFT_DTYPE_NAMES],
                   help="precision the drafter computes in (drafts are proposals: output is unchanged); int8: int8 "
                        "weights (CPU); auto: the fastest here, measured at start")
    p.add_argument("--draft-vocab", default="auto", metavar="auto|full|FILE",
                   help="tokens the drafter may propose: auto (its folder's draft_vocab.json if it has one, else "
                        "all), full, or a draft_vocab.json (dflash.train.draft_vocab makes one)")
    p.add_argument("--draft-model", metavar="NAME|GGUF|DIR",
                   help="a smaller model with the target's tokenizer that drafts token by token (classic speculative "
                        "decoding), e.g. qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct: a model name, "
                        "a GGUF file or a Hugging Face folder; run in llama.cpp where it has a GGUF, else in "
                        "transformers; block length auto drafts with it where it pays (default: none)")
    p.add_argument("--head", default="auto", metavar="auto|none|DIR",
                   help="the next-token head that guesses one token where nothing else proposes (block length "
                        "auto): auto (one made for the target and the backend it runs in: shipped, or made here into "
                        "CACHE/heads/TARGET/), none, or a folder (python -m dflash.train.next_head makes one)")


BACKENDS = ("native", "openai")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """Where generation runs: here (native), or on an inference server (dflash.remote)."""
    p.add_argument("--backend", choices=BACKENDS, default="native",
                   help="native: run the target and drafter here; openai: send each request to the OpenAI-compatible "
                        "inference server at --endpoint (vLLM, SGLang, llama-server), which batches and drafts")
    p.add_argument("--endpoint", help="the inference server's URL (--backend openai), e.g. http://127.0.0.1:8080 or "
                   "http://vllm:8000/v1")
    p.add_argument("--api-key-file", help="a file holding the endpoint's API key (sent as a Bearer token)")
    p.add_argument("--model", help="the served model's name (default: the first the endpoint lists); its tokenizer "
                   "and chat template come from --target (a folder, the GGUF file the server runs, or a model name; "
                   "default: the embedded SmolLM2's), checked at start against the server's /tokenize")


def check_backend_args(args) -> bool:
    """Whether the options ask for the remote backend (DFlashError when they do not add up)."""
    remote = getattr(args, "backend", "native") == "openai"
    if remote and not args.endpoint:
        raise DFlashError("bad_params", "--backend openai needs --endpoint URL")
    if remote and getattr(args, "draft_model", None):
        raise DFlashError("bad_params", "--draft-model drafts here, for a target run here: with --backend openai the "
                          "endpoint drafts")
    if not remote and (getattr(args, "endpoint", None) or getattr(args, "api_key_file", None)
                       or getattr(args, "model", None)):
        raise DFlashError("bad_params", "--endpoint, --api-key-file and --model go with --backend openai")
    return remote


def target_arg(args) -> str | None:
    """The target the options name: --target, else --target-gguf alone (the GGUF is the
    target then), else None (the embedded default)."""
    return args.target or getattr(args, "target_gguf", None)


def backend_arg(args) -> str | None:
    """The target backend the options ask for; None for a command that takes no
    --target-backend (it reads the target's weights: a GGUF target is converted whole)."""
    return getattr(args, "target_backend", None)


def engine_from_args(args, serving: bool = False):
    """The engine the options ask for: the native one over `add_model_args`'s models (the
    embedded defaults unless named), or with `--backend openai` the remote one, which loads
    only the target's tokenizer. `serving`: for a worker that batches several callers (its
    target backend chosen for them too: fastest_engine)."""
    import torch

    from dflash.model_files import cost_dir, resolve_models, resolve_target, resolve_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    if check_backend_args(args):
        from dflash.remote.engine import remote_engine

        return remote_engine(args.endpoint, resolve_tokenizer(target_arg(args)), args.model, args.api_key_file)
    # The target's folder and its GGUF, where it has one (an image may hold only the embedded
    # default's converted folder: then the llamacpp backend is simply not a candidate).
    files = resolve_target(target_arg(args), backend=backend_arg(args))
    target, drafter, is_random = resolve_models(target_arg(args), args.drafter, backend=backend_arg(args))
    if is_random:
        print(RANDOM_DRAFTER_WARNING, file=sys.stderr)
    gguf = getattr(args, "target_gguf", None) or files.gguf
    return load_engine(target, drafter, device=args.device, dtype=args.dtype, random_drafter=is_random,
                       cost_dir=cost_dir(), draft_dtype=args.draft_dtype, draft_vocab=getattr(args, "draft_vocab", "auto"),
                       target_backend=getattr(args, "target_backend", "auto"), target_gguf=gguf,
                       head=getattr(args, "head", "auto"), draft_model=getattr(args, "draft_model", None),
                       serving=serving)
