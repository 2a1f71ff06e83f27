"""The `dflash` command: argument parsing only; the work lives in the engine and models modules."""

from __future__ import annotations

import argparse
import json
import sys

from dflash.errors import DFlashError

RANDOM_DRAFTER_WARNING = (
    "warning: no trained default drafter ships yet; using a random-weight drafter. "
    "Output is exactly the target's, but drafts are rarely accepted (tau ~ 1). For tests only."
)


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"input ids must be comma-separated integers, got '{text}'") from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="Hugging Face model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="DFlash drafter folder, published layout (default: the project's drafter)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def add_generate_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--input-ids", type=_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, help="1 = plain decoding; default: the drafter's block size")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--verify", choices=["greedy", "strict", "probabilistic"])
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-id", action="append", type=int, default=[], help="extra stop token id (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object with ids, text and statistics")


def request_from_args(args):
    from dflash.engine.engine import GenerationRequest

    return GenerationRequest(
        prompt=args.prompt,
        input_ids=args.input_ids,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        verify=args.verify,
        stop=args.stop,
        stop_ids=args.stop_id,
    )


def load_engine(args):
    import torch

    from dflash.engine.engine import Engine
    from dflash.models import resolve_models

    if args.threads:
        torch.set_num_threads(args.threads)
    target, drafter, is_random = resolve_models(args.target, args.drafter)
    if is_random:
        print(RANDOM_DRAFTER_WARNING, file=sys.stderr)
    return Engine.load(target, drafter, device=args.device, dtype=args.dtype, random_drafter=is_random)


def cmd_generate(args) -> int:
    engine = load_engine(args)
    result = engine.generate(request_from_args(args))
    if args.json:
        out = result.to_dict()
        out.update(target=engine.target.name, drafter=engine.drafter_name, random_drafter=engine.random_drafter)
        print(json.dumps(out))
    else:
        print(result.text)
        s = result.stats
        tps = f"{s.tokens_per_s:.1f}" if s.tokens_per_s else "-"
        tau = f"{s.tau:.2f}" if s.tau else "-"
        print(
            f"[{s.new_tokens} tokens, {s.num_steps} steps, tau {tau}, {tps} tok/s, block {s.block_size}]",
            file=sys.stderr,
        )
    return 0


def cmd_models(args) -> int:
    from dflash.models import ensure_default_drafter, ensure_default_target

    target = ensure_default_target()
    drafter, is_random = ensure_default_drafter(target)
    info = {"target": str(target), "drafter": str(drafter), "random_drafter": is_random}
    print(json.dumps(info) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))
    if is_random:
        print(RANDOM_DRAFTER_WARNING, file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from pathlib import Path

    from dflash.bench.run import markdown, run_bench, write_report

    from dflash.models import assistant_dir

    engine = load_engine(args)
    methods = args.methods.split(",")
    assistant = assistant_dir(args.assistant, engine.target.model, args.target is None) if (
        "assisted-ar" in methods) else None
    report = run_bench(engine, args.suites.split(","), methods, args.limit, args.max_new_tokens,
                       str(assistant) if assistant else None, Path(args.out) / "samples.jsonl", args.resume)
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
    engine = load_engine(args)
    embedder = None
    if not args.no_embedder:
        from dflash.embed import Embedder

        embedder = Embedder(args.embedder, device=args.device)
    worker = Worker(
        engine,
        embedder,
        socket_path=args.socket,
        max_queue=args.max_queue,
        max_frame=args.max_frame,
        socket_group=args.socket_group,
        allow_uids=args.allow_uid,
        allow_gids=args.allow_gid,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker.start()
    consumer = None
    if args.database:
        from dflash.serve.queue import QueueConsumer

        consumer = QueueConsumer(worker, args.database, poll_s=args.poll_s, max_attempts=args.max_attempts)
        consumer.start()
    stop.wait()
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
    else:
        params = {}
    try:
        with Client(args.socket) as client:
            result = client.call(op, params, timeout_ms=args.timeout_ms)
    except WorkerError as exc:
        print(f"dflash: error: [{exc.code}] {exc.message}", file=sys.stderr)
        return 3
    if args.json or op not in ("generate",):
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


def cmd_demo(args) -> int:
    from dflash.demo import run_demo

    return run_demo(args.prompt, args.max_new_tokens)


def cmd_train(args) -> int:
    from pathlib import Path

    import torch

    from dflash.models import ensure_default_target
    from dflash.train.pipeline import run
    from dflash.train.trainer import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        epochs=args.epochs, lr=args.lr, num_anchors=args.num_anchors, seqs_per_step=args.seqs_per_step,
        time_budget_s=args.time_budget_min * 60 if args.time_budget_min else None,
        checkpoint_minutes=args.checkpoint_minutes, reduced_vocab=not args.full_vocab_loss, seed=args.seed,
        pack=args.pack,
    )
    drafter = run(
        Path(args.target) if args.target else ensure_default_target(), Path(args.out), prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch, layers=args.layers,
        block_size=args.block_size, layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id,
        init=args.init, cfg=cfg, device=args.device, prompt_file=Path(args.prompt_file) if args.prompt_file else None,
    )
    print(f"drafter written to {drafter}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text with the speculative engine")
    add_model_args(p)
    add_generate_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="every method on the same prompts: speed, tau, greedy agreement")
    add_model_args(p)
    p.add_argument("--suites", default="code,chat,agent")
    p.add_argument("--methods", default="ar-hf,ar,dflash-4,dflash-8,dflash-16,prompt-lookup,assisted-ar")
    p.add_argument("--assistant", help="AR draft model for assisted-ar: a transformers folder or a stored "
                   "assistant (default: the shipped one, for the default target)")
    p.add_argument("--limit", type=int, help="prompts per suite (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--resume", action="store_true",
                   help="reuse the generations journaled in OUT/samples.jsonl by an interrupted run with the same settings")
    p.set_defaults(func=cmd_bench)

    from dflash.serve.protocol import DEFAULT_MAX_FRAME, DEFAULT_SOCKET

    p = sub.add_parser("serve", help="run the worker: load the models once, serve requests on a Unix socket")
    add_model_args(p)
    p.add_argument("--socket", default=DEFAULT_SOCKET, help=f"socket path (default {DEFAULT_SOCKET})")
    p.add_argument("--embedder", help="sentence-embedding model folder (default: all-MiniLM-L6-v2 from PyPI)")
    p.add_argument("--no-embedder", action="store_true", help="serve without an embedding model")
    p.add_argument("--max-queue", type=int, default=64, help="queued requests before answering 'busy'")
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME, help="largest accepted request, bytes")
    p.add_argument("--socket-group", help="group (name or gid) owning the socket (mode 0660)")
    p.add_argument("--allow-uid", type=int, action="append", help="only these peer uids (SO_PEERCRED; repeatable)")
    p.add_argument("--allow-gid", type=int, action="append", help="only these peer gids (repeatable)")
    p.add_argument("--database", help="libpq DSN (as role dflash_worker): consume dflash.queue for triggers")
    p.add_argument("--poll-s", type=float, default=1.0, help="queue poll interval besides LISTEN/NOTIFY")
    p.add_argument("--max-attempts", type=int, default=5, help="tries per queue item before dflash.queue_failed")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("client", help="send one request to a running worker and print the answer")
    p.add_argument("op", choices=["generate", "generate-block", "embed", "status", "cancel"])
    p.add_argument("--socket", default=DEFAULT_SOCKET)
    p.add_argument("--timeout-ms", type=int, help="deadline for the request")
    p.add_argument("--text", action="append", default=[], help="text to embed (repeatable)")
    p.add_argument("--request-id", help="for cancel: the request to stop")
    add_generate_args(p, required=False)
    p.set_defaults(func=cmd_client)

    p = sub.add_parser("demo", help="end to end on a throwaway PostgreSQL: worker, extension, dflash_generate")
    p.add_argument("--prompt", default="Write a haiku about databases")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("train", help="train a DFlash drafter for a target (resumable, in stages)")
    p.add_argument("--target", help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="run directory: data, feature cache, checkpoints, drafter")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int)
    p.add_argument("--prompts", type=int, help="how many offline prompts to use (default: all)")
    p.add_argument("--prompt-file", help="JSONL of prompts to use instead of collecting them here")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length when regenerating")
    p.add_argument("--gen-batch", type=int, default=8, help="prompts per batched regeneration")
    p.add_argument("--layers", type=int, default=2, help="draft layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layer-ids", type=_ids, help="comma-separated target layer ids (default: spread)")
    p.add_argument("--mask-token-id", type=int, default=16)
    p.add_argument("--init", choices=["random", "target"], default="random")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--num-anchors", type=int, default=32, help="blocks per sequence per step")
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--pack", type=int, default=1, help="sequences per forward (1 on CPU; 8+ on a GPU)")
    p.add_argument("--time-budget-min", type=float, help="stop training after this many minutes (resumable)")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--full-vocab-loss", action="store_true", help="softmax over the whole vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("models", help="prepare the embedded default models in the cache")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DFlashError as exc:
        print(f"dflash: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
