"""The worker over its Unix socket: operations, equality with in-process generation,
deadlines, cancel, disconnects, concurrency, bad frames, socket permissions, peer check."""

import json
import os
import socket
import stat
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.engine.engine import GenerationRequest
from dflash.serve.client import Client, WorkerError
from dflash.serve.protocol import HEADER, encode
from dflash.serve.server import Worker
from tests.conftest import wait_until


def call(w, op, params=None, **kw):
    with Client(str(w.socket_path)) as c:
        return c.call(op, params, **kw)




# --- operations -------------------------------------------------------------------------


def test_status_and_hello(worker):
    s = call(worker, "status")
    assert s["protocol"] == 1 and s["ready"] and s["in_flight"] == 0
    assert s["target"] == "tiny" and s["embedding_dim"] == 384
    assert s["workload_memory"]["cap_bytes"] > 0 and s["workload_memory"]["bytes"] >= 0
    assert s["prefix_cache"] is None  # the tiny target is a transformers one: it prefills every prompt
    assert call(worker, "hello")["protocol"] == 1


def test_embed_round_trip(worker):
    r = call(worker, "embed", {"texts": ["a cat sat on the mat", "a kitten sits on a rug", "SQL index types"]})
    v = r["embeddings"]
    assert r["dim"] == 384 and len(v) == 3 and all(len(x) == 384 for x in v)
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    assert dot(v[0], v[0]) == pytest.approx(1.0, abs=1e-5)
    assert dot(v[0], v[1]) > dot(v[0], v[2])


def test_generate_over_socket_equals_in_process(worker, tiny_text_engine):
    params = {"prompt": "Tell me about databases.", "chat": True, "max_new_tokens": 24, "block_size": 8}
    remote = call(worker, "generate", params)
    local = tiny_text_engine.generate(GenerationRequest(**params))
    assert remote["output_ids"] == local.output_ids and remote["text"] == local.text
    assert [s["draft_ids"] for s in remote["steps"]] == [s.draft_ids for s in local.stats.steps]
    for key in ("tau", "new_tokens", "decode_s", "tokens_per_s", "steps", "queue_ms", "target", "drafter"):
        assert key in remote


def test_generate_remember_embeds_prompt_and_answer(worker, embedder):
    """`remember` returns the memory embedding of prompt + answer in the same call, as the
    embed op would compute it; without it there is no `memory`."""
    params = {"prompt": "Name a colour.", "chat": True, "max_new_tokens": 12}
    plain = call(worker, "generate", params)
    assert "memory" not in plain
    r = call(worker, "generate", dict(params, remember=True))
    assert r["text"] == plain["text"] and r["memory"]["embedder"] == embedder.name
    expected = call(worker, "embed", {"texts": [f"Name a colour.\n\n{r['text']}"]})["embeddings"][0]
    assert r["memory"]["embedding"] == pytest.approx(expected, abs=1e-6)


def test_remember_without_an_embedder_is_refused_before_decoding(tmp_path, tiny_text_engine):
    w = Worker(tiny_text_engine, None, socket_path=str(tmp_path / "plain.sock"))
    w.start()
    try:
        with pytest.raises(WorkerError) as err:
            call(w, "generate", {"prompt": "x", "max_new_tokens": 8, "remember": True})
        assert err.value.code == "no_embedder"
        assert call(w, "status")["tokens_generated"] == 0  # nothing was decoded
        assert "memory" not in call(w, "generate", {"prompt": "x", "max_new_tokens": 4, "remember": False})
    finally:
        w.shutdown(timeout=10)


def test_generate_block_agrees_with_first_step(worker):
    prompt = {"prompt": "Write a haiku about databases", "chat": True}
    block = call(worker, "generate_block", {**prompt, "block_size": 8})
    full = call(worker, "generate", {**prompt, "block_size": 8, "max_new_tokens": 20})
    first = full["steps"][0]
    assert block["draft_ids"] == first["draft_ids"] and block["accepted"] == first["accepted"]
    assert block["anchor_id"] == full["output_ids"][0]
    assert block["next_token_id"] == full["output_ids"][1 + first["accepted"]]
    assert len(block["draft_ids"]) == 7 and isinstance(block["draft_text"], str)


def test_cancel_unknown_request(worker):
    assert call(worker, "cancel", {"request_id": "nope"}) == {"cancelled": False}


# --- stopping work ---------------------------------------------------------------------


LONG = {"input_ids": [5, 6, 7], "max_new_tokens": 400, "block_size": 1}


def test_deadline_stops_decoding(worker, slow_engine):
    t = time.monotonic()
    with pytest.raises(WorkerError) as err:
        call(worker, "generate", LONG, timeout_ms=150)
    assert err.value.code == "deadline"
    assert time.monotonic() - t < 1.5  # 400 slow steps would take > 2 s
    assert wait_until(lambda: worker.in_flight == 0)


def test_cancel_by_request_id(worker, slow_engine):
    errors = []

    def run():
        try:
            call(worker, "generate", LONG, request_id="job-1")
        except WorkerError as exc:
            errors.append(exc.code)

    t = threading.Thread(target=run)
    t.start()
    assert wait_until(lambda: worker.in_flight == 1)
    assert call(worker, "cancel", {"request_id": "job-1"}) == {"cancelled": True}
    t.join(timeout=5)
    assert errors == ["cancelled"]
    assert wait_until(lambda: worker.in_flight == 0)


def test_client_disconnect_stops_generation(worker, slow_engine):
    tokens_before = call(worker, "status")["tokens_generated"]
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(worker.socket_path))
    s.sendall(encode({"v": 1, "id": "gone", "op": "generate", "params": LONG}))
    assert wait_until(lambda: worker.in_flight == 1)
    t = time.monotonic()
    s.close()
    assert wait_until(lambda: worker.in_flight == 0, timeout=2)
    assert time.monotonic() - t < 1.0
    assert call(worker, "status")["tokens_generated"] == tokens_before  # never finished


def test_check_callback_interrupts_the_wait(worker, slow_engine):
    """The PL/Python path: check() raises between wait slices; the client hangs up."""
    calls = []

    def check():
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt("cancel")

    with pytest.raises(KeyboardInterrupt):
        with Client(str(worker.socket_path), slice_s=0.02) as c:
            c.call("generate", LONG, check=check)
    assert wait_until(lambda: worker.in_flight == 0, timeout=2)


def test_eight_concurrent_clients_get_their_own_answers(worker, tiny_text_engine):
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(8)]
    expected = {p: tiny_text_engine.generate(GenerationRequest(prompt=p, max_new_tokens=12)).output_ids for p in prompts}
    answers = {}

    def run(p):
        answers[p] = call(worker, "generate", {"prompt": p, "max_new_tokens": 12})["output_ids"]

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert answers == expected
    assert len({tuple(v) for v in answers.values()}) > 1


def test_full_queue_answers_busy(make_worker, slow_engine):
    w = make_worker(max_queue=1)
    codes = []

    def run():
        try:
            call(w, "generate", {**LONG, "max_new_tokens": 30})
            codes.append("ok")
        except WorkerError as exc:
            codes.append(exc.code)

    threads = [threading.Thread(target=run) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert "busy" in codes and "ok" in codes
    assert call(w, "status")["ready"]


# --- errors never kill the worker -------------------------------------------------------


@pytest.mark.parametrize(
    "op, params, code",
    [
        ("explode", {}, "unknown_op"),
        ("generate", {"prompt": "x", "max_new_tokens": "ten"}, "bad_params"),
        ("generate", {"prompt": "x", "colour": "red"}, "bad_params"),
        ("generate", {"prompt": "x", "chat": 1}, "bad_params"),
        ("generate", {"prompt": "x", "remember": "yes"}, "bad_params"),
        ("generate", {"prompt": "x", "block_size": 0}, "bad_block_size"),
        ("generate", {"prompt": ""}, "empty_prompt"),
        ("generate", {"input_ids": [10**9]}, "bad_input_ids"),
        ("generate", {"prompt": "x", "temperature": -1}, "bad_temperature"),
        ("generate_block", {"prompt": "x", "block_size": 1000}, "bad_block_size"),
        ("embed", {"texts": []}, "bad_params"),
        ("embed", {"texts": ["ok", "  "]}, "empty_text"),
        ("embed", {"texts": "not a list"}, "bad_params"),
    ],
)
def test_structured_errors(worker, op, params, code):
    with pytest.raises(WorkerError) as err:
        call(worker, op, params)
    assert err.value.code == code and err.value.message
    assert call(worker, "status")["ready"]


def raw_exchange(w, payload: bytes) -> dict | None:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(str(w.socket_path))
    s.sendall(payload)
    try:
        head = s.recv(4)
        if len(head) < 4:
            return None
        (n,) = HEADER.unpack(head)
        body = b""
        while len(body) < n:
            body += s.recv(n - len(body))
        return json.loads(body)
    finally:
        s.close()


def test_non_json_and_non_object_frames(worker):
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b'"text"'):
        reply = raw_exchange(worker, HEADER.pack(len(body)) + body)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_frame"
    reply = raw_exchange(worker, encode({"op": "status", "params": [1]}))
    assert reply["error"]["code"] == "bad_params"


def test_oversize_frame(make_worker):
    w = make_worker(max_frame=1024)
    reply = raw_exchange(w, HEADER.pack(10_000) + b"x" * 100)
    assert reply["error"]["code"] == "frame_too_large"
    with pytest.raises(WorkerError) as err:
        call(w, "embed", {"texts": ["x" * 5000]})
    assert err.value.code in ("frame_too_large", "unavailable")
    assert call(w, "status")["ready"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(max_size=300))
def test_random_bytes_leave_the_worker_serving(worker, garbage):
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(worker.socket_path))
    s.sendall(garbage)
    s.close()
    assert call(worker, "status")["ready"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    msg=st.dictionaries(
        st.sampled_from(["v", "id", "op", "params", "timeout_ms", "junk"]),
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20),
                  st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)),
    )
)
def test_random_messages_get_answers(worker, msg):
    if msg.get("op") in ("generate", "generate_block", "embed"):
        msg["op"] = "status"  # keep the property test about framing and validation, not decoding
    body = json.dumps(msg).encode()
    reply = raw_exchange(worker, HEADER.pack(len(body)) + body)
    assert reply is not None and "ok" in reply
    assert call(worker, "status")["ready"]


# --- the socket file --------------------------------------------------------------------


def test_socket_mode_and_stale_socket(make_worker, tmp_path):
    path = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # leaves a socket file nobody listens on
    w = make_worker(socket_path=str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    assert call(w, "status")["ready"]


def test_refuses_a_live_socket_or_a_regular_file(make_worker, tmp_path, tiny_text_engine):
    from dflash.errors import DFlashError

    live = make_worker()
    with pytest.raises(DFlashError, match="already listening"):
        Worker(tiny_text_engine, socket_path=str(live.socket_path)).start()
    regular = tmp_path / "file.sock"
    regular.write_text("precious")
    with pytest.raises(DFlashError, match="not a socket"):
        Worker(tiny_text_engine, socket_path=str(regular)).start()
    assert regular.read_text() == "precious"


def test_peer_credentials(make_worker):
    me = os.getuid()
    allowed = make_worker(allow_uids=[me])
    assert call(allowed, "status")["ready"]
    denied = make_worker(allow_uids=[me + 12345], allow_gids=[os.getgid() + 12345])
    with pytest.raises(WorkerError) as err:
        call(denied, "status")
    assert err.value.code == "forbidden"


# --- several requests in one batch --------------------------------------------------------


def _solo(engine, params):
    return engine.generate(GenerationRequest(**params)).output_ids


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_one_request_of_a_batch_stops_and_the_others_go_on(worker, slow_engine, how):
    others = [{"input_ids": [5 + i, 6, 7], "max_new_tokens": 60, "block_size": b} for i, b in enumerate((1, 4))]
    expected = [_solo(slow_engine, p) for p in others]
    got, errors = {}, []

    def run(i, params, **kw):
        try:
            got[i] = call(worker, "generate", params, **kw)["output_ids"]
        except WorkerError as exc:
            errors.append(exc.code)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(others)]
    victim = {"request_id": "victim"} if how == "cancel" else {"timeout_ms": 300}
    threads.append(threading.Thread(target=run, args=("victim", LONG), kwargs=victim))
    for t in threads:
        t.start()
    assert wait_until(lambda: worker.status()["batch_last_step"] == 3)  # all three in one step
    if how == "cancel":
        assert call(worker, "cancel", {"request_id": "victim"}) == {"cancelled": True}
    for t in threads:
        t.join(timeout=30)
    assert errors == ["cancelled" if how == "cancel" else "deadline"]
    assert [got[0], got[1]] == expected
    assert wait_until(lambda: worker.in_flight == 0)


def test_generate_many_is_one_batched_request(worker, tiny_text_engine):
    prompts = [f"Tell me about the number {i}." for i in range(5)]
    params = {"max_new_tokens": 10, "chat": True}
    expected = [_solo(tiny_text_engine, dict(params, prompt=p)) for p in prompts]
    before = call(worker, "status")
    got = call(worker, "generate_many", dict(params, prompts=prompts))
    after = call(worker, "status")
    assert [r["output_ids"] for r in got["results"]] == expected
    assert all(r["new_tokens"] == len(r["output_ids"]) for r in got["results"])
    # Served together: about as many engine steps as the longest one, not one per token of all.
    assert after["engine_steps"] - before["engine_steps"] <= max(len(e) for e in expected) + 2
    assert after["requests_served"]["generate_many"] == before["requests_served"]["generate_many"] + 1


@pytest.mark.parametrize("prompts", [[], ["ok", 3], "not a list", ["x"] * 1025])
def test_generate_many_refuses_bad_prompts(worker, prompts):
    with pytest.raises(WorkerError) as err:
        call(worker, "generate_many", {"prompts": prompts, "max_new_tokens": 2})
    assert err.value.code == "bad_params"
