"""The per-request step API: start / step / finish, generate_block as one step, incremental
stop strings, the preallocated drafter cache, and requests taking turns in the worker."""

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.engine.engine import GenerationRequest
from dflash.engine.stops import StopStrings
from dflash.serve.client import Client


@pytest.fixture
def worker_client(worker):
    with Client(str(worker.socket_path)) as c:
        yield c


@pytest.mark.parametrize("block_size", [1, 3, 8, None])
def test_generate_equals_start_then_steps(tiny_engine, block_size, monkeypatch):
    # auto learns across requests: priors pooled from recent generations, which a seeded
    # request does not use, and the suffix proposer's lookup price (a running mean of timed
    # lookups), not re-timed here. So both runs make the same choices, step for step (the
    # output is the same regardless).
    monkeypatch.setattr(tiny_engine.proposer("suffix").price, "add", lambda seconds: None)
    req = GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=30, block_size=block_size, seed=1)
    whole = tiny_engine.generate(req)
    state = tiny_engine.start(req)
    steps = []
    while not state.done:
        steps.append(tiny_engine.step([state])[0])
    parts = tiny_engine.finish(state)
    assert parts.output_ids == whole.output_ids
    assert [s.accepted for s in parts.stats.steps] == [s.accepted for s in whole.stats.steps]
    # Every step commits its accepted drafts plus the target's token (a stop may cut it).
    committed = [state.output_ids[0]] + [t for s in steps for t in s.committed]
    assert committed == parts.output_ids
    for s in steps:
        assert s.committed == (s.draft_ids[: s.accepted] + [s.next_token])[: len(s.committed)]
        assert s.verify_len == len(s.draft_ids) + 1
        if block_size is not None:
            assert s.verify_len <= block_size


def test_two_states_interleaved_equal_each_alone(tiny_engine):
    """States own their caches: stepping two in turn changes neither's output."""
    reqs = [GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=25, block_size=4),
            GenerationRequest(input_ids=[9, 3, 11, 2], max_new_tokens=25, block_size=None)]
    alone = [tiny_engine.generate(r).output_ids for r in reqs]
    states = [tiny_engine.start(r) for r in reqs]
    while not all(s.done for s in states):
        for s in states:
            if not s.done:
                tiny_engine.step([s])
    assert [tiny_engine.finish(s).output_ids for s in states] == alone


def test_generate_block_is_one_step(worker_client, tiny_text_engine):
    req = GenerationRequest(prompt="Say hi.", chat=True, max_new_tokens=9, block_size=8)
    state = tiny_text_engine.start(req)
    step = tiny_text_engine.step([state])[0]
    got = worker_client.call("generate_block", {"prompt": "Say hi.", "block_size": 8})
    assert got["anchor_id"] == state.output_ids[0]
    assert got["draft_ids"] == step.draft_ids and len(step.draft_ids) == 7
    assert got["accepted"] == step.accepted
    assert got["next_token_id"] == step.next_token


def test_generate_block_rejects_bad_block_sizes(worker_client):
    from dflash.serve.client import WorkerError

    for bad in (0, 9, "4", True):
        with pytest.raises(WorkerError) as err:
            worker_client.call("generate_block", {"prompt": "Hi", "block_size": bad})
        assert err.value.code in ("bad_block_size", "bad_params")


# --- stop strings, incrementally ------------------------------------------------------


def _reference_cut(engine, ids, stops):
    """The definition: generation ends with the first token after which a stop string is in
    the text (a stream cannot wait for a longer stop that would start earlier but is not
    complete yet); the answer is the text before the earliest stop found there."""
    for n in range(1, len(ids) + 1):
        text = engine.decode(ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return ids[:n], text[: min(hits)]
    return ids, engine.decode(ids)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_incremental_stops_match_the_definition(tiny_text_engine, data):
    tok = tiny_text_engine.tokenizer
    text = data.draw(st.sampled_from([
        "Hello world, this is a test of stop strings across tokens.",
        "def f(x):\n    return x * 2  # doubled\n\nprint(f(3))",
        "Ünïcödé têxt with émojis 🎉🎉 and CJK 数据库 characters.",
        "aaaa bbbb aaaa bbbb STOP here and STOP there",
    ]))
    ids = tok(text).input_ids
    start = data.draw(st.integers(0, len(text) - 2))
    stop = text[start : start + data.draw(st.integers(1, 6))]
    extra = data.draw(st.sampled_from([[], ["zzzzqq"], ["\n\n"]]))
    stops = [stop] + extra
    checker = StopStrings(tiny_text_engine.decode, stops)
    cut = next((i + 1 for i, t in enumerate(ids) if checker.feed(t)), None)
    ref_ids, ref_text = _reference_cut(tiny_text_engine, ids, stops)
    if cut is None:
        assert ref_ids == ids and ref_text == tiny_text_engine.decode(ids)
    else:
        assert ids[:cut] == ref_ids
        assert checker.cut(tiny_text_engine.decode(ids[:cut])) == ref_text


def test_a_stop_that_completes_first_ends_the_text(tiny_text_engine):
    """Overlapping stops (found by the property test above): "\n\n" completes before the
    longer "led\n\np", which starts earlier; the stream ends at the first and cuts there."""
    text = "def f(x):\n    return x * 2  # doubled\n\nprint(f(3))"
    ids = tiny_text_engine.tokenizer(text).input_ids
    checker = StopStrings(tiny_text_engine.decode, ["led\n\np", "\n\n"])
    cut = next(i + 1 for i, t in enumerate(ids) if checker.feed(t))
    assert "\n\n" in tiny_text_engine.decode(ids[:cut]) and "\n\np" not in tiny_text_engine.decode(ids[:cut])
    assert checker.cut(tiny_text_engine.decode(ids[:cut])) == text[: text.index("\n\n")]


def test_stop_string_straddling_a_step_boundary(tiny_text_engine):
    free = tiny_text_engine.generate(GenerationRequest(prompt="Tell me a story.", chat=True, max_new_tokens=40,
                                                       block_size=4))
    text = free.text
    assert len(text) > 12
    # A stop string made of the end of one token and the start of the next.
    for i in range(2, len(free.output_ids) - 2):
        a, b = tiny_text_engine.decode(free.output_ids[:i]), tiny_text_engine.decode(free.output_ids[: i + 1])
        if len(a) >= 2 and len(b) > len(a) + 1 and a[-2:].strip() and b[len(a):len(a) + 2].strip():
            stop = a[-2:] + b[len(a): len(a) + 2]
            break
    else:
        pytest.skip("no token boundary with printable text on both sides")
    res = tiny_text_engine.generate(GenerationRequest(prompt="Tell me a story.", chat=True, max_new_tokens=40,
                                                      block_size=4, stop=[stop]))
    ref_ids, ref_text = _reference_cut(tiny_text_engine, free.output_ids, [stop])
    assert res.output_ids == ref_ids and res.text == ref_text and res.finish_reason == "stop"


# --- the drafter's cache ---------------------------------------------------------------


def test_growing_draft_cache_equals_one_forward_over_everything(tiny_engine):
    """Context appended over many calls into a small buffer that must double several times
    gives the same block hidden states as one cache-less forward over the whole context."""
    from dflash.engine.drafter import DraftCache

    drafter = tiny_engine.drafter
    cfg = drafter.config
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(40, cfg.num_features * cfg.hidden_size, generator=gen)
    block = torch.randn(1, 5, cfg.hidden_size, generator=gen)
    cache = DraftCache(cfg.num_hidden_layers, capacity=2)
    with torch.inference_mode():
        done = 0
        for n in (7, 1, 3, 9, 2, 11, 7):
            out = drafter(feats[None, done : done + n], block, torch.arange(done, done + n + 5), cache)
            done += n
        ref = drafter(feats[None, :done], block, torch.arange(0, done + 5), None)
    assert cache.length == done and cache.capacity >= done + 5
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


# --- the worker: requests take turns -------------------------------------------------


def test_a_short_request_is_not_stalled_by_a_long_one(make_worker, slow_engine):
    worker = make_worker(max_active=4)
    done = {}

    def call(name, n):
        with Client(str(worker.socket_path)) as c:
            c.call("generate", {"prompt": "Hi", "max_new_tokens": n, "block_size": 1})
        done[name] = time.monotonic()

    long = threading.Thread(target=call, args=("long", 150))
    long.start()
    time.sleep(0.3)  # the long one is decoding
    short = threading.Thread(target=call, args=("short", 3))
    short.start()
    short.join(30)
    long.join(60)
    assert done["short"] < done["long"], "the short request waited for the long one"
