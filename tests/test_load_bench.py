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
