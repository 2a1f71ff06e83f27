"""`python -m dflash.bench.load` against a worker on the tiny engine: levels, the plain
twin of every level (--against-plain), and the report."""

import json

import pytest

from dflash.bench import load


def test_against_plain_runs_every_level_twice_in_one_worker(worker, tmp_path, capsys):
    seen = []
    call = load.SocketCaller.__call__

    def spy(self, params):
        seen.append(params.get("block_size"))
        return call(self, params)

    load.SocketCaller.__call__ = spy
    try:
        assert load.main(["--socket", str(worker.socket_path), "--concurrency", "1,2", "--requests", "3",
                          "--max-new-tokens", "6", "--rounds", "2", "--against-plain", "--out", str(tmp_path)]) == 0
    finally:
        load.SocketCaller.__call__ = call
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["against_plain"] is True and [r["concurrency"] for r in report["runs"]] == [1, 2]
    for r in report["runs"]:
        # Plain decoding gives the same answers as auto (lossless), and its throughput is beside it.
        assert r["plain_mismatches_vs_solo"] == 0 and r["mismatches_vs_solo"] == 0
        assert r["vs_plain"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])
        assert len(r["rounds"]) == len(r["plain_rounds"]) == 2
    # Warm-up, then 2 rounds x 2 levels x (auto + plain) x 3 requests.
    assert seen.count(1) == 2 * 2 * 3 and seen.count(None) == 1 + 2 * 2 * 3
    assert "× plain" in capsys.readouterr().out


def test_against_plain_with_a_block_size_is_refused(capsys):
    with pytest.raises(SystemExit):
        load.main(["--socket", "/nonexistent", "--against-plain", "--block-size", "4"])
    assert "leave out --block-size" in capsys.readouterr().err


def test_against_llama_server_sends_the_workers_token_ids_to_it(worker, tmp_path, monkeypatch, capsys):
    """llama-server gets the same requests as the worker, as the token ids the worker's chat
    template made, with as many slots as the highest level; its throughput sits beside each
    level's and it is stopped at the end (a fake server here: tests/test_peers.py
    starts the real one)."""
    from dflash.bench.llamacpp import Completion

    class FakeServer:
        prompts, closed, slots = [], False, None

        def complete(self, prompt_ids, max_new):
            self.prompts.append(list(prompt_ids))
            return Completion([7] * max_new, 0.01, [], 0, {})

        def close(self):
            self.closed = True

    fake = FakeServer()

    def start(args, tmp, slots):
        fake.slots = slots
        return fake

    monkeypatch.setattr(load, "start_llama_server", start)
    assert load.main(["--socket", str(worker.socket_path), "--concurrency", "1,3", "--requests", "3",
                      "--max-new-tokens", "5", "--against-llama-server", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "load.json").read_text())
    assert fake.slots == 3 and fake.closed
    from dflash.serve.client import call
    from dflash.suites import load_suite

    assert len(fake.prompts) == 2 * 3 and len({tuple(p) for p in fake.prompts}) == 3
    first = call("generate", {"prompt": load_suite("chat")[0], "max_new_tokens": 1, "chat": True},
                 path=str(worker.socket_path))
    assert first["prompt_ids"] in fake.prompts
    for r in report["runs"]:
        assert r["llama_server_tokens_per_s"] > 0 and r["llama_server_errors"] == 0
        assert r["vs_llama_server"] == pytest.approx(r["tokens_per_s"] / r["llama_server_tokens_per_s"])
        assert r["llama_server_mismatches_vs_solo"] == 3  # its fixed answer is not the worker's
    assert "× llama-server" in capsys.readouterr().out
