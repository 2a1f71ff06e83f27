"""The llama.cpp peer's bookkeeping, without llama.cpp (`make peers` runs the real thing):
method names, the server log lines it counts, and the checks it draws from a bench run."""

import json

import pytest

from dflash.bench import llamacpp
from dflash.bench.peers import check_runs
from dflash.bench.run import Runner


def test_method_names():
    assert llamacpp.parse_method("llamacpp-ar") == ("llamacpp-ar", "f32")
    assert llamacpp.parse_method("llamacpp-dflash-q4_1") == ("llamacpp-dflash", "q4_1")
    assert llamacpp.parse_method("llamacpp-dflash-q3") is None
    assert llamacpp.parse_method("dflash-16") is None
    assert llamacpp.is_speculative_peer("llamacpp-dflash-f16") and not llamacpp.is_speculative_peer("llamacpp-ar")


def test_server_log_lines_are_counted():
    log = ("0.49.690.071 I slot   operator(): id  0 | task 0 | accepted  0/15 draft tokens\n"
           "0.49.896.301 I slot   operator(): id  0 | task 0 | accepted 12/15 draft tokens\n"
           "0.55.838.808 I slot print_timing: id  0 | task 0 | draft acceptance = 0.4 (12 accepted / 30 generated)\n")
    assert llamacpp.ACCEPTED_LINE.findall(log) == [("0", "15"), ("12", "15")]


def test_peer_methods_need_the_peer(tiny_engine):
    with pytest.raises(SystemExit, match="runs only from `dflash bench`"):
        Runner(tiny_engine, 4).check("llamacpp-ar")


def test_checks_from_a_run(tmp_path):
    def row(method, tau, mismatches=0):
        return {"suite": "chat", "method": method, "tau": tau, "greedy_mismatches": mismatches}

    (tmp_path / "results.json").write_text(json.dumps({"results": [
        row("dflash-16", 1.20), row("llamacpp-ar", None), row("llamacpp-dflash", 1.26),
        row("llamacpp-ar-q4_1", None, 2), row("llamacpp-dflash-q4_1", 1.1, 2)]}))
    outputs = {"llamacpp-ar": [[1, 2], [3]], "llamacpp-dflash": [[1, 2], [3]],
               "llamacpp-ar-q4_1": [[1], [4]], "llamacpp-dflash-q4_1": [[1], [5]]}
    lines = [{"settings": {}}] + [{"suite": "chat", "method": m, "index": i, "output_ids": ids}
                                  for m, outs in outputs.items() for i, ids in enumerate(outs)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = check_runs(tmp_path)["chat"]
    assert c["prompts"] == 2
    assert c["dflash_vs_ar_mismatches"] == {"llamacpp-dflash": [], "llamacpp-dflash-q4_1": [1]}
    assert c["tau_relative_difference"] == pytest.approx(0.05)
    assert c["tau_within_10_percent"]
