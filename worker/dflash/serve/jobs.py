"""Jobs: one request of a client (or of the worker itself), and what the scheduler runs for it.

A job is answered exactly once: `answer(reply)` sets its reply and wakes whoever waits.
Generation operations become scheduler tickets (`ticket_for`): `generate` one request,
`generate_many` several prompts as one batched request, `generate_block` one request that
ends after its first decode step; their results are built here, on the engine thread, from
the finished states. `embed` and `reload_drafter` run between two steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from dflash.engine.engine import GenerationRequest, constraint_of
from dflash.engine.scheduler import Stopped, Ticket
from dflash.errors import DFlashError
from dflash.options import BY_NAME, type_error
from dflash.serve.protocol import PROTOCOL_VERSION

# Besides the generation options (dflash.options): what to generate from, and the workload's prior.
REQUEST_PARAMS = {"prompt": (str, type(None)), "input_ids": (list, type(None)), "prior": (dict, type(None)),
                  "workload": (str, type(None)), "history": (list, type(None))}
MAX_PROMPTS = 1024  # prompts in one generate_many


@dataclass
class Job:
    id: str
    op: str
    params: dict
    deadline: float | None  # time.monotonic() seconds
    queued_at: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict | None = None
    owner: int | None = None  # the client process (peer pid) that may cancel it; None: internal
    on_answer: object = None  # called with the job once answered (the worker's bookkeeping)

    @property
    def key(self) -> tuple[int | None, str]:
        return (self.owner, self.id)

    def check(self) -> None:
        if self.cancel.is_set():
            raise Stopped("cancelled", f"request {self.id} was cancelled")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise Stopped("deadline", f"request {self.id} passed its deadline")

    def answer(self, reply: dict) -> None:
        self.reply = reply
        if self.on_answer is not None:
            self.on_answer(self)
        self.done.set()

    def ok(self, result: dict) -> None:
        self.answer({"v": PROTOCOL_VERSION, "id": self.id, "ok": True, "result": result})

    def error(self, code: str, message: str) -> None:
        self.answer(error_reply(self.id, code, message))

    def fail(self, exc: Exception) -> None:
        if isinstance(exc, (Stopped, DFlashError)):
            self.error(exc.code, exc.message)
        else:
            self.error("internal", f"{type(exc).__name__}: {exc}")


def error_reply(rid, code: str, message: str) -> dict:
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": False, "error": {"code": code, "message": message}}


def generation_request(params: dict) -> GenerationRequest:
    unknown = sorted(set(params) - set(REQUEST_PARAMS) - set(BY_NAME))
    if unknown:
        raise DFlashError("bad_params", f"unknown generate parameters: {', '.join(unknown)}")
    for key, value in params.items():
        if key in REQUEST_PARAMS:
            types = REQUEST_PARAMS[key]
            if not isinstance(value, types):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
                raise DFlashError("bad_params", f"parameter '{key}' must be {names}, got {type(value).__name__}")
        elif (why := type_error(key, value)) is not None:
            raise DFlashError("bad_params", why)
    return GenerationRequest(**params)


def check_options(engine, params: dict) -> dict:
    """A generate-on-insert table's options, checked when generation is enabled (op
    check_options): their types, the sampling numbers and their constraint, which the grammar
    library compiles (22023 codes naming the problem); nothing is generated."""
    if "prompt" in params or "input_ids" in params:
        raise DFlashError("bad_params", "check_options takes generation options, not a prompt")
    req = generation_request(dict(params, prompt="-"))
    req.sampling()
    constraint = constraint_of(req)
    if constraint is not None and engine.endpoint is not None:
        raise DFlashError("unsupported_option", f"{constraint.kind} is applied by dflash's own decoding step, which "
                          "does not run with --backend openai")
    return {"constraint": None if constraint is None else constraint.kind}


def memory_text(prompt: str, output: str) -> str:
    """What a remembered generation is embedded as: the question with its answer."""
    return f"{prompt}\n\n{output}"


class Answers:
    """Builds the answers of finished generations (on the engine thread)."""

    def __init__(self, worker):
        self.worker = worker

    @property
    def engine(self):
        return self.worker.engine

    def ticket_for(self, job: Job) -> Ticket:
        """The scheduler's work for a generation job; raises DFlashError on bad params."""
        params = dict(job.params)
        one_step = False
        if job.op in ("generate", "generate_many"):
            remember = params.pop("remember", False)
            if not isinstance(remember, bool):
                raise DFlashError("bad_params", f"parameter 'remember' must be bool, got {type(remember).__name__}")
            # Refused before decoding; the extension asks to remember while its 'remember' setting is on.
            embedder = self.worker.require_embedder("remember generations ('remember' is on)") if remember else None
            if job.op == "generate_many":
                prompts = params.pop("prompts", None)
                if (not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS
                        or not all(isinstance(p, str) for p in prompts)):
                    raise DFlashError("bad_params", f"'prompts' must be a list of 1 to {MAX_PROMPTS} strings")
                requests = [generation_request({**params, "prompt": p}) for p in prompts]
            else:
                requests = [generation_request(params)]
        elif job.op == "generate_block":
            embedder, one_step = None, True
            block = params.get("block_size")
            if self.engine.block_size is None:
                raise DFlashError("unsupported_option", "generate_block shows one block of this worker's drafter; with "
                                  "--backend openai the inference endpoint drafts, by its own blocks")
            params["block_size"] = self.engine.block_size if block is None else block
            if isinstance(params["block_size"], int) and not isinstance(params["block_size"], bool):
                params["max_new_tokens"] = params["block_size"] + 1  # the first token, then one block
            requests = [generation_request(params)]
        else:
            raise DFlashError("unknown_op", f"operation {job.op} is not run by the engine")
        queue_ms = (time.monotonic() - job.queued_at) * 1000.0

        def done(states, last):
            ids = self.worker.model_ids(states[0])  # the drafter they started with
            results = [self.engine.finish(s) for s in states]
            for res in results:
                self.worker.account(res)
            if job.op == "generate_block":
                job.ok({**self.block_result(results[0], last[0], queue_ms), **ids})
                return
            outs = self.results(results, requests, embedder, ids, queue_ms)
            job.ok(outs[0] if job.op == "generate" else {"results": outs, **ids, "queue_ms": queue_ms})

        return Ticket(requests, job.check, done, job.fail, one_step=one_step)

    def results(self, results, requests, embedder, ids: dict, queue_ms: float) -> list[dict]:
        outs = []
        for res in results:
            out = res.to_dict()
            out.update(ids, queue_ms=queue_ms)
            outs.append(out)
        if embedder is not None:  # one embedding call for every answer worth remembering
            keep = [i for i, o in enumerate(outs) if o["text"].strip()]
            texts = [memory_text(requests[i].prompt or "", outs[i]["text"]) for i in keep]
            for i, vec in zip(keep, embedder.embed(texts) if texts else []):
                outs[i]["memory"] = {"embedder": embedder.name, "embedding": vec}
        return outs

    def block_result(self, res, step, queue_ms: float) -> dict:
        """generate_block's answer: what the drafter proposed after the target's first token
        and what the target kept of it."""
        decode = self.engine.decode
        drafts = step.draft_ids if step else []
        a = step.accepted if step else 0
        nxt = step.next_token if step and len(step.committed) > a else None  # None: a stop came first
        return {
            "block_size": res.stats.block_size,
            "anchor_id": res.output_ids[0],
            "anchor_text": decode(res.output_ids[:1]),
            "draft_ids": drafts,
            "draft_text": decode(drafts),
            "accepted": a,
            "accepted_ids": drafts[:a],
            "accepted_text": decode(drafts[:a]),
            "next_token_id": nxt,
            "next_token_text": decode([nxt]) if nxt is not None else None,
            "prompt_ids": res.prompt_ids,
            "queue_ms": queue_ms,
        }
