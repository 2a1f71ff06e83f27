"""The `dflash` command: argument parsing only; the work lives in the modules it calls."""

from __future__ import annotations

import argparse
import json
import sys

from dflash.bench.args import add_bench_args
from dflash.errors import DFlashError
from dflash.loading import RANDOM_DRAFTER_WARNING, add_backend_args, add_model_args, check_backend_args
from dflash.loading import backend_arg, engine_from_args, target_arg

EXIT_ERROR = 2  # bad input or a failed command: one line `dflash: error: ...`
EXIT_WORKER_ERROR = 3  # `client`: the worker answered with an error
EXIT_TRUNCATED = 4  # `generate`: a constrained answer cut short of its form (printed, not valid)


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"input ids must be comma-separated integers, got '{text}'") from None


def _json_schema(text: str) -> dict:
    """--json-schema: a file holding a JSON Schema object, or the object's JSON itself."""
    from pathlib import Path

    source = text
    if not text.lstrip().startswith("{"):
        try:
            source = Path(text).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"--json-schema takes a file or a JSON object: cannot read "
                                             f"'{text}' ({exc.strerror})") from None
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--json-schema '{text[:60]}' is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"--json-schema must be a JSON object, got {type(schema).__name__}")
    return schema


def add_generate_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--input-ids", type=_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    from dflash.options import GENERATION_OPTIONS

    for o in GENERATION_OPTIONS:  # every generation option, with its default and meaning (dflash.options)
        # null is how a request leaves an option out; on the command line, leaving the flag out is
        bounds = o.bounds.removesuffix(", or null").removesuffix(" or null") if o.nullable else o.bounds
        kw = {"help": f"{o.doc} ({bounds})"}
        if o.types == (bool,):
            kw.update(action=argparse.BooleanOptionalAction, default=o.default)
        elif o.types[0] is list:
            # A nullable list (choices) stays None when not given: given empty is another thing.
            kw.update(action="append", default=None if o.nullable else [], type=int if o.name == "stop_ids" else str,
                      dest=o.name)
            kw["help"] += "; repeatable"
        elif o.types[0] is dict:
            kw.update(type=_json_schema, default=o.default, dest=o.name, metavar="FILE|JSON")
        else:
            kw.update(type={int: int, float: float, str: str}[float if float in o.types else o.types[0]],
                      default=o.default, dest=o.name)
            if o.name == "verify":
                kw["choices"] = ["greedy", "strict", "probabilistic"]
        p.add_argument(o.flag, **kw)
    p.add_argument("--json", action="store_true", help="print one JSON object with ids, text and statistics")


def request_from_args(args):
    from dflash.engine.engine import GenerationRequest

    from dflash.options import GENERATION_OPTIONS

    return GenerationRequest(prompt=args.prompt, input_ids=args.input_ids,
                             **{o.name: getattr(args, o.name) for o in GENERATION_OPTIONS})


def check_before_loading(args, req) -> None:
    """Refuse a request that cannot succeed before any model loads: the engine's own checks
    (dflash.engine.engine.RequestChecks, the sampling options' bounds) over what the model
    folders' config files say (the target's context length and vocabulary, the drafter's
    block size), so a bad option costs a moment, not the models' load (and at a first start
    the backends' measurement). Only what the loaded engine would refuse too: a prompt text
    is at least one token, and no target backend's context is longer than the config's.
    What needs the tokenizer or the weights is left to the engine."""
    import json
    from dataclasses import replace
    from pathlib import Path
    from types import SimpleNamespace

    from dflash.engine.drafter_config import DrafterConfig
    from dflash.engine.engine import RequestChecks
    from dflash.model_files import resolve_models

    req.sampling()  # temperature, top_k, top_p, seed, verify
    if check_backend_args(args):  # the endpoint's model is not here to read
        return
    # a first use converts, and says so
    target_dir, drafter, _ = resolve_models(target_arg(args), args.drafter, backend=backend_arg(args))
    if drafter is not None and not Path(drafter).exists():
        raise DFlashError("bad_drafter", f"drafter not found: {drafter}")
    try:
        cfg = json.loads((Path(target_dir) / "config.json").read_text())
        # A limit the file does not state plainly (another key, a nested config) is not checked here.
        limits = SimpleNamespace(**{name: int(cfg[key]) if isinstance(cfg.get(key), int) else sys.maxsize
                                    for name, key in (("context_length", "max_position_embeddings"),
                                                      ("vocab_size", "vocab_size"))})
    except (OSError, ValueError, TypeError, AttributeError):
        return  # not a folder these checks can read: the loader says what is wrong with it
    if drafter is not None and (Path(drafter) / "config.json").is_file() and all(
            isinstance(cfg.get(k), int) for k in ("hidden_size", "vocab_size", "num_hidden_layers")):
        # a drafter made for another target is refused now, not after the target's load
        from dflash.engine.drafters import check_compatible

        shape = SimpleNamespace(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                                num_layers=cfg["num_hidden_layers"], name=Path(target_dir).name)
        check_compatible(shape, DrafterConfig.from_file(Path(drafter) / "config.json"), str(drafter))
    checks = RequestChecks()
    checks.target = limits
    checks.tokenizer = "not loaded"  # stop strings are checked as strings here; the tokenizer's part is the engine's
    checks.block_size = (DrafterConfig.from_file(Path(drafter) / "config.json").block_size
                         if drafter is not None and Path(drafter).is_dir() else None)
    if checks.block_size is None:  # a .gguf or .onnx drafter, or none: the block size is checked when it loads
        req = replace(req, block_size=None)
    if req.input_ids is not None or req.prompt is None or not str(req.prompt).strip():
        n_prompt = len(checks.prompt_ids(req))  # the ids, or the refusal of no prompt or an empty one
    else:
        n_prompt = 1  # at least (it is tokenised once the target's tokenizer is loaded)
        if isinstance(req.max_new_tokens, int) and req.max_new_tokens >= limits.context_length:
            raise DFlashError("context_exceeded", f"max_new_tokens ({req.max_new_tokens}) leaves no room for the "
                              f"prompt in the context length {limits.context_length}")
    checks.validate(req, n_prompt)


def cmd_generate(args) -> int:
    req = request_from_args(args)
    check_before_loading(args, req)
    engine = engine_from_args(args)
    result = engine.generate(req)
    if args.json:
        out = result.to_dict()
        out.update(target=engine.target.name, target_backend=engine.target.backend, drafter=engine.drafter_name,
                   random_drafter=engine.random_drafter)
        print(json.dumps(out))
    else:
        print(result.text)
        s = result.stats
        tps = f"{s.tokens_per_s:.1f}" if s.tokens_per_s else "-"
        tau = f"{s.tau:.2f}" if s.tau else "-"
        print(
            f"[{s.new_tokens} tokens, {s.num_steps} steps, tau {tau}, {tps} tok/s, "
            f"block {'auto' if s.policy == 'auto' else s.block_size}]",
            file=sys.stderr,
        )
        if s.truncated:
            print(f"[truncated: max_new_tokens ({args.max_new_tokens}) cut the answer short of its form; it does not "
                  "parse or validate]", file=sys.stderr)
    # A script reading the answer must not take a cut one for valid: printed, but not a success.
    return EXIT_TRUNCATED if result.stats.truncated else 0


def cmd_models(args) -> int:
    from pathlib import Path

    from dflash.model_files import ensure_default_drafter, ensure_default_target, ensure_target, model_listing
    from dflash.model_files import model_gguf, named_model

    from dflash.convert.onnx_target import builder_version, ensure_export
    from dflash.model_files import onnx_export_dir

    if args.list:
        listing = model_listing()
        print(json.dumps(listing) if args.json else "\n".join(
            f"{m['name']}: {m['title']}; GGUF {'installed' if m['installed'] else 'not installed'}, "
            f"folder {'ready' if m['converted'] else 'not made'}" for m in listing))
        return 0
    for name in args.names:
        named_model(name)  # an unknown name is refused before anything is downloaded
    target = ensure_default_target()
    drafter, is_random = ensure_default_drafter(target)
    info = {"target": str(target), "drafter": str(drafter), "random_drafter": is_random}
    if args.names:
        info["models"] = {name: {"folder": str(ensure_target(name)), "gguf": str(model_gguf(name))}
                          for name in dict.fromkeys(args.names)}
    if builder_version() is not None:  # the ort backend's exports, made now rather than at the first start
        from dflash.convert import onnx_gguf, onnx_q41

        info["target_onnx"] = str(ensure_export(target, onnx_export_dir(target), quiet=False))
        info["target_onnx_q4_1"] = str(onnx_q41.ensure_export(target, onnx_export_dir(target, onnx_q41.PRECISION),
                                                              onnx_export_dir(target), quiet=False))
        for model in info.get("models", {}).values():  # so that auto can choose ort for them too
            model["onnx"] = str(ensure_export(model["folder"], onnx_export_dir(model["folder"]), quiet=False))
            if onnx_gguf.file_type(model["gguf"]) is not None:  # and the build with the file's blocks exactly
                model["onnx_q4_k_m"] = str(onnx_gguf.ensure_export(
                    model["folder"], onnx_export_dir(model["folder"], onnx_gguf.PRECISION),
                    onnx_export_dir(model["folder"]), model["gguf"], quiet=False))
    # Each target backend probed here now (once per CPU and build), not at the first start.
    from dflash.loading import doctor_report
    from dflash.model_files import resolve_target

    info["backends"] = doctor_report(target, resolve_target(None).gguf)["backends"]
    for model in info.get("models", {}).values():
        model["backends"] = doctor_report(model["folder"], Path(model["gguf"]))["backends"]
    print(json.dumps(info) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))
    if is_random:
        print(RANDOM_DRAFTER_WARNING, file=sys.stderr)
    return 0


def cmd_doctor(args) -> int:
    from pathlib import Path

    from dflash.loading import doctor_report, target_arg
    from dflash.model_files import resolve_target

    files = resolve_target(target_arg(args), backend="auto")  # what can run here, weights or not
    gguf = Path(args.target_gguf) if args.target_gguf else files.gguf
    report = doctor_report(files.folder, gguf, reprobe=args.reprobe)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"CPU: {report['cpu']}")
    print(f"flags: {' '.join(report['flags'])}")
    print(f"llama.cpp: {report['llama_cpp'] or 'not installed'}")
    print(f"llama.cpp build flags: {report['llama_cpp_build_flags']}")
    print(f"target: {report['target']}")
    if args.reprobe:
        print(f"forgot {report['forgotten']} verdicts of this CPU; probed again")
    for name, verdict in report["backends"].items():
        print(f"  {name:9} {verdict}")
    print(f"(verdicts kept in {report['verdicts']}; dflash doctor --reprobe probes again)")
    return 0


def cmd_bench(args) -> int:
    from pathlib import Path

    from dflash.bench.run import check_drafter, markdown, reference_engine, run_bench, write_report
    from dflash.model_files import resolve_models

    from dflash.train.assistant import assistant_dir

    from dflash.bench.llamacpp import peer_for

    methods = args.methods.split(",")
    # Only the embedded default has a drafter unless one is given (before any model loads).
    check_drafter(methods, resolve_models(target_arg(args), args.drafter, backend=backend_arg(args))[1] is not None)
    engine = engine_from_args(args)
    peer = peer_for(target_arg(args), args.drafter, methods, engine.block_size, args.target_gguf)
    assistant = assistant_dir(args.assistant, reference_engine(engine).target.model, args.target is None) if (
        "assisted-ar" in methods) else None
    suites = [s for s in args.suites.split(",") if s and s != "none"]
    report = run_bench(engine, suites, methods, args.limit, args.max_new_tokens,
                       str(assistant) if assistant else None, Path(args.out) / "samples.jsonl", args.resume, peer,
                       prompt_files=args.prompts)
    report["command"] = "dflash " + " ".join(sys.argv[1:])
    write_report(report, Path(args.out))
    print(markdown(report))
    print(f"results: {Path(args.out) / 'results.json'}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    import logging
    import signal
    import threading

    from dflash.serve.server import Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from dflash.model_files import resolve_models

    remote = check_backend_args(args)
    if remote and args.learn:
        raise DFlashError("bad_params", "--learn trains the worker's own drafter; with --backend openai the endpoint "
                          "serves its drafter")
    engine = engine_from_args(args, serving=args.max_active > 1)
    # The drafter folder reload_drafter reads again (the native engine's; the endpoint has its own).
    target_dir, drafter_dir, _ = (None, None, None) if remote else resolve_models(target_arg(args), args.drafter,
                                                                                  backend=backend_arg(args),
                                                                                  quiet=True)
    embedder = None
    if not args.no_embedder:
        from dflash.embed import Embedder

        embedder = Embedder(args.embedder, device=args.device)
    worker = Worker(
        engine,
        embedder,
        socket_path=args.socket,
        max_queue=args.max_queue,
        max_active=args.max_active,
        max_frame=args.max_frame,
        socket_group=args.socket_group,
        allow_uids=args.allow_uid,
        allow_gids=args.allow_gid,
        drafter_dir=drafter_dir,
        drafter_roots=args.drafter_root,
        step_tokens=args.step_tokens,
    )
    learner = None
    if args.learn:  # off by default: a drafter trained on a workload memorises some of it
        from dflash.serve.learn import learner_from_args

        learner = learner_from_args(worker, args, target_dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker.start()
    consumer = None
    if args.database:
        from dflash.serve.queue import QueueConsumer

        consumer = QueueConsumer(worker, args.database, poll_s=args.poll_s, batch=args.queue_batch or args.max_active)
        consumer.start()
    if learner is not None:
        learner.start()
    stop.wait()
    if learner is not None:
        learner.shutdown()
    if consumer is not None:
        consumer.shutdown()
    worker.shutdown()
    return 0


def cmd_client(args) -> int:
    from dflash.serve.client import Client, WorkerError

    op = args.op.replace("-", "_")
    if op in ("generate", "generate_block"):
        if args.prompt is None and args.input_ids is None:
            raise DFlashError("bad_prompt", f"{args.op} needs --prompt or --input-ids")
        req = request_from_args(args)
        params = {k: v for k, v in vars(req).items() if v not in (None, [])}
        if op == "generate_block":
            params = {k: v for k, v in params.items() if k in ("prompt", "input_ids", "chat", "block_size")}
    elif op == "embed":
        if not args.text:
            raise DFlashError("bad_params", "embed needs at least one --text")
        params = {"texts": args.text}
    elif op == "cancel":
        params = {"request_id": args.request_id}
    elif op == "reload_drafter":
        params = {"path": args.path} if args.path else {}
    else:
        params = {}
    try:
        with Client(args.socket) as client:
            result = client.call(op, params, timeout_ms=args.timeout_ms)
    except WorkerError as exc:
        print(f"dflash: error: [{exc.code}] {exc.message}", file=sys.stderr)
        return EXIT_WORKER_ERROR
    if args.json or op not in ("generate",):
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


def cmd_convert(args) -> int:
    from dflash.convert import convert_drafter

    target = args.target
    if target is None and args.to == "gguf":  # its vocabulary: the embedded default target's
        from dflash.model_files import default_target_gguf

        target = default_target_gguf()
    out = convert_drafter(args.drafter, args.to, args.out, target=target, outtype=args.outtype)
    print(out)
    return 0


def cmd_demo(args) -> int:
    from dflash.demo import run_demo

    return run_demo(args.prompt, args.max_new_tokens, args.target)


def cmd_train(args) -> int:
    if args.from_database:
        from dflash.train.db_args import check_from_database_arguments
        from dflash.train.from_database import run_from_args

        check_from_database_arguments(args)
        return run_from_args(args)
    from dflash.train.pipeline import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text with the speculative engine")
    add_model_args(p)
    add_backend_args(p)
    add_generate_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="every method on the same prompts: speed, tau, greedy agreement")
    add_model_args(p)
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    from dflash.engine.knobs import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_STEP_TOKENS
    from dflash.serve.protocol import DEFAULT_MAX_FRAME, DEFAULT_SOCKET

    p = sub.add_parser("serve", help="run the worker: load the models once, serve requests on a Unix socket")
    add_model_args(p)
    add_backend_args(p)
    p.add_argument("--socket", default=DEFAULT_SOCKET, help=f"socket path (default {DEFAULT_SOCKET})")
    p.add_argument("--embedder", help="sentence-embedding model folder (default: all-MiniLM-L6-v2 from PyPI)")
    p.add_argument("--no-embedder", action="store_true", help="serve without an embedding model")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, help="queued requests before answering 'busy'")
    p.add_argument("--max-active", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"generations served by each engine step, in one batched forward (default {DEFAULT_MAX_BATCH})")
    p.add_argument("--step-tokens", type=int, default=DEFAULT_STEP_TOKENS,
                   help="tokens one step may take while others decode: prompts are prefilled in chunks of what is "
                        f"left, so a long prompt delays the others by one chunk (default {DEFAULT_STEP_TOKENS})")
    p.add_argument("--queue-batch", type=int, default=None,
                   help="queued rows (generate on insert) claimed and generated together (default: --max-active)")
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME, help="largest accepted request, bytes")
    p.add_argument("--socket-group", help="group (name or gid) owning the socket (mode 0660)")
    p.add_argument("--allow-uid", type=int, action="append", help="only these peer uids (SO_PEERCRED; repeatable)")
    p.add_argument("--allow-gid", type=int, action="append", help="only these peer gids (repeatable)")
    p.add_argument("--database", help="libpq DSN (as role dflash_worker): consume dflash.queue for triggers")
    p.add_argument("--poll-s", type=float, default=1.0, help="queue poll interval besides LISTEN/NOTIFY")
    p.add_argument("--drafter-root", action="append", default=[],
                   help="reload_drafter may load drafter folders under this directory (repeatable)")
    from dflash.serve.learn import add_learn_arguments

    add_learn_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("client", help="send one request to a running worker and print the answer")
    p.add_argument("op", choices=["generate", "generate-block", "embed", "status", "cancel", "reload-drafter"])
    p.add_argument("--socket", default=DEFAULT_SOCKET)
    p.add_argument("--timeout-ms", type=int, help="deadline for the request")
    p.add_argument("--text", action="append", default=[], help="text to embed (repeatable)")
    p.add_argument("--request-id", help="for cancel: the request to stop")
    p.add_argument("--path", help="for reload-drafter: a drafter folder under the worker's --drafter-root "
                   "(default: the current drafter's folder, read again)")
    add_generate_args(p, required=False)
    p.set_defaults(func=cmd_client)

    p = sub.add_parser("demo", help="end to end on a throwaway PostgreSQL: worker, extension, dflash_generate")
    p.add_argument("--prompt", default="Write a haiku about databases")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--target", help="the worker's target: an installed model's name (dflash models NAME installs "
                   "one), a folder or a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("train", help="train a DFlash drafter for a target (resumable, in stages)")
    from dflash.train.args import add_train_arguments

    add_train_arguments(p)
    from dflash.train.db_args import add_from_database_arguments

    add_from_database_arguments(p)
    p.set_defaults(func=cmd_train)

    from dflash.convert import FORMATS, OUTTYPES

    p = sub.add_parser("convert", help="a drafter to llama.cpp's GGUF, to ONNX, or from GGUF back to a folder")
    p.add_argument("drafter", help="drafter folder (published layout) or .gguf file")
    p.add_argument("--to", required=True, choices=FORMATS, help="gguf, onnx, or hf (a .gguf back to a folder)")
    p.add_argument("out", help="output file (.gguf, .onnx) or folder (hf)")
    p.add_argument("--target", help="the target's GGUF file or Hugging Face folder: checked against the drafter; "
                   "gives the GGUF its vocabulary (default: the embedded SmolLM2's) and, for a GGUF written by "
                   "llama.cpp's converter, the target's layer count")
    p.add_argument("--outtype", default="auto", choices=OUTTYPES,
                   help="GGUF matrix type: auto keeps the stored dtype (exact), f32 widens (exact)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("doctor", help="this machine's CPU, llama.cpp's build and each target backend's verdict "
                       "(probed in a child process the first time)")
    p.add_argument("--target", help="a target folder, GGUF file or model name (default: the embedded SmolLM2)")
    p.add_argument("--target-gguf", help="the target's GGUF, for the llamacpp backend")
    p.add_argument("--reprobe", action="store_true", help="forget this CPU's verdicts and probe every backend again")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    from dflash.model_files import MODELS

    p = sub.add_parser("models", help="prepare the embedded default models in the cache, and install named ones")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"also install these models (from PyPI, pinned and checked) and convert them: {', '.join(MODELS)}")
    p.add_argument("--list", action="store_true", help="list the models --target NAME knows and whether they are here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DFlashError as exc:
        print(f"dflash: error: {exc.message}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
