"""The llama.cpp peer's bookkeeping, without llama.cpp (`make peers` runs the real thing):
method names, the server log lines it counts, the draft model llama.cpp's own speculation
takes, the methods a target without a drafter can run, and the checks it draws from a bench
run. Then `dflash bench --target FILE.gguf` with llama.cpp's plain and speculative decoding
of that file, on a real llama-server (SmolLM2; slow: Qwen2.5-Coder-1.5B)."""

import json
import os
from pathlib import Path

import pytest

from dflash.bench import llamacpp
from dflash.bench.peers import check_runs
from dflash.bench.run import Runner, check_drafter, needs_drafter
from dflash.errors import DFlashError


def test_method_names():
    assert llamacpp.parse_method("llamacpp-ar") == ("llamacpp-ar", "f32")
    assert llamacpp.parse_method("llamacpp-dflash-q4_1") == ("llamacpp-dflash", "q4_1")
    assert llamacpp.parse_method("llamacpp-ar-gguf") == ("llamacpp-ar", "gguf")
    assert llamacpp.parse_method("llamacpp-spec-gguf") == ("llamacpp-spec", "gguf")
    assert llamacpp.parse_method("llamacpp-dflash-q3") is None
    assert llamacpp.parse_method("llamacpp-spec-gguf2") is None
    assert llamacpp.parse_method("dflash-16") is None
    assert llamacpp.is_speculative_peer("llamacpp-dflash-f16") and not llamacpp.is_speculative_peer("llamacpp-ar")
    assert llamacpp.is_speculative_peer("llamacpp-spec-gguf") and not llamacpp.is_speculative_peer("llamacpp-ar-gguf")
    assert llamacpp.is_dflash_peer("llamacpp-dflash-q4_1") and not llamacpp.is_dflash_peer("llamacpp-spec-gguf")
    assert llamacpp.plain_of("llamacpp-spec-gguf") == "llamacpp-ar-gguf"
    assert llamacpp.plain_of("llamacpp-dflash-q4_1") == "llamacpp-ar-q4_1"
    assert llamacpp.plain_of("llamacpp-dflash") == "llamacpp-ar"


def test_which_methods_need_a_drafter():
    """Without a drafter (a target none is given for) only the methods that draft with one
    are refused, before any model loads."""
    need = ["dflash-4", "dflash-16", "llamacpp-dflash", "llamacpp-dflash-q4_1"]
    free = ["ar", "ar-hf", "ar-reference", "dflash-auto", "suffix", "prompt-lookup", "assisted-ar",
            "llamacpp-ar-gguf", "llamacpp-spec-gguf", "llamacpp-ar-q4_1", "draft-model", "draft-model-4"]
    assert all(map(needs_drafter, need)) and not any(map(needs_drafter, free))
    check_drafter(free, has_drafter=False)
    check_drafter(need + free, has_drafter=True)
    with pytest.raises(SystemExit, match="dflash-16, llamacpp-dflash-q4_1 draft with a DFlash drafter"):
        check_drafter(["ar", "dflash-16", "llamacpp-dflash-q4_1"], has_drafter=False)


def test_bench_refuses_drafter_methods_for_a_target_without_one(tmp_path):
    """`dflash bench --target DIR` (not the default, no --drafter) with a method that drafts:
    refused at once, naming it."""
    from dflash.cli import main
    from tests.tiny_qwen import make_tiny_qwen2

    target = make_tiny_qwen2(tmp_path / "tiny-qwen2")
    with pytest.raises(SystemExit, match="dflash-16 draft with a DFlash drafter"):
        main(["bench", "--target", str(target), "--methods", "ar,dflash-16", "--out", str(tmp_path / "out")])


def test_steps_without_a_draft_count_as_steps_that_kept_none():
    # 10 tokens: the first with the prompt, then steps that kept 3 and 1 drafts: 9 = 4 + 2 + 3 plain steps
    assert llamacpp.every_step([3, 1], 10) == [3, 1, 0, 0, 0]
    assert llamacpp.every_step([15], 16) == [15]  # a DFlash block that finished the request
    assert llamacpp.every_step([15], 10) == [15]  # cut short by the token budget
    assert llamacpp.every_step([], 1) == []


def _gguf(path: Path, tokens: list[str], rows: int, file_type=None) -> Path:
    from tests.test_model_files import _tiny_gguf

    return _tiny_gguf(path, tokens=tuple(tokens), rows=rows, file_type=file_type, merges=("a b",))


def test_llamacpp_spec_drafts_with_a_smaller_model_of_the_same_tokenizer(tmp_path, monkeypatch):
    """llama.cpp's own speculation takes the smallest installed named model with the target's
    tokenizer and fewer parameters as its draft model (-md), else its n-gram drafting; the
    setting says which."""
    from dflash import model_files
    from dflash.model_files import NamedModel, PartWheels

    monkeypatch.setenv("PG_DFLASH_CACHE", str(tmp_path / "cache"))
    parts = PartWheels("x-part{}", "1", 1, "x/{0}.bin")
    names = {"big": (["a", "b", "c"], 40), "small": (["a", "b", "c"], 8), "tiny-other": (["a", "b", "d"], 4),
             "smaller-still": (["a", "b", "c"], 6)}
    monkeypatch.setattr(model_files, "MODELS", {n: NamedModel(n, n, f"{n}.gguf", parts) for n in names})
    for n, (tokens, rows) in names.items():
        if n != "smaller-still":
            _gguf(model_files.model_gguf(n), tokens, rows)
    big = model_files.model_gguf("big")
    spec, ngram = llamacpp.spec_settings(big, threads=2)  # both: the run's first prompt chooses
    assert spec.draft == model_files.model_gguf("small")
    assert spec.args[:2] == ("-md", str(spec.draft)) and "draft-simple" in spec.args
    assert "small.gguf" in spec.setting and "--spec-draft-threads" in spec.args
    assert ngram.draft is None and ngram.args == llamacpp.NGRAM_ARGS and "n-gram" in ngram.setting
    _gguf(model_files.model_gguf("smaller-still"), *names["smaller-still"])
    assert llamacpp.spec_settings(big, threads=2)[0].draft == model_files.model_gguf("smaller-still")
    # the smallest has no smaller model with its tokenizer: n-gram drafting only
    (spec,) = llamacpp.spec_settings(model_files.model_gguf("tiny-other"), threads=2)
    assert spec.draft is None and spec.args == llamacpp.NGRAM_ARGS and "n-gram" in spec.setting


def test_llamacpp_spec_keeps_the_faster_setting_on_the_first_prompt(monkeypatch):
    """Each setting's server runs the first prompt; the faster is kept, the other closed, its
    completion is the answer, and the setting is named with both times."""
    closed = []

    class Server:
        def __init__(self, target, threads, spec, log=None):
            self.spec, self.runs = spec, 0

        def complete(self, prompt_ids, max_new, constraint=None):
            self.runs += 1
            return llamacpp.Completion([1, 2], 2.0 if self.spec.draft else 1.0, [], 0, {})

        def close(self):
            closed.append(self.spec.setting)

    draft = Path("/m/small.gguf")
    settings = [llamacpp.Speculation(("-md", str(draft)), "draft model small.gguf", draft),
                llamacpp.Speculation(llamacpp.NGRAM_ARGS, "n-gram drafting")]
    monkeypatch.setattr(llamacpp, "LlamaServer", Server)
    monkeypatch.setattr(llamacpp, "spec_settings", lambda target, threads: settings)
    monkeypatch.setattr(llamacpp, "target_gguf", lambda folder, fmt, gguf: Path("/m/big.gguf"))
    monkeypatch.setattr(llamacpp, "read_gguf_header", lambda path: type("H", (), {"weights": "Q4_K_M"})())
    peer = llamacpp.LlamaCppPeer(Path("/m/big"), None, 2, 16, Path("/m/big.gguf"))
    first = peer.run("llamacpp-spec-gguf", [5, 6], 8)
    assert first.wall_s == 1.0 and closed == ["draft model small.gguf"]
    said = peer.describe("llamacpp-spec-gguf")["speculative"]
    assert said.startswith("n-gram drafting (the faster on the first prompt run, the warm-up in a bench: 1.00 s; "
                           "draft model small.gguf: 2.00 s")
    peer.run("llamacpp-spec-gguf", [7], 8)
    assert peer.servers["llamacpp-spec-gguf"].runs == 2 and peer.servers["llamacpp-spec-gguf"].spec is settings[1]


def test_the_gguf_header_as_the_gguf_library_reads_it(tmp_path):
    import gguf

    path = _gguf(tmp_path / "m.gguf", ["a", "b", "c"], 5, gguf.LlamaFileType.MOSTLY_Q4_K_M)
    header = llamacpp.read_gguf_header(path)
    assert header.parameters == sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors) == 5 * 8 + 8
    assert header.weights == "Q4_K_M"
    assert header.tokenizer == llamacpp.read_gguf_header(_gguf(tmp_path / "n.gguf", ["a", "b", "c"], 9)).tokenizer
    assert header.tokenizer != llamacpp.read_gguf_header(_gguf(tmp_path / "o.gguf", ["a", "b", "x"], 5)).tokenizer
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:60])
    with pytest.raises(DFlashError) as e:
        llamacpp.read_gguf_header(cut)
    assert e.value.code == "bad_target" and str(cut) in e.value.message


def test_the_gguf_as_given_needs_a_gguf(tmp_path):
    with pytest.raises(DFlashError) as e:
        llamacpp.target_gguf(tmp_path, "gguf", None)
    assert e.value.code == "bad_method" and str(tmp_path) in e.value.message
    assert llamacpp.target_gguf(tmp_path, "gguf", tmp_path / "x.gguf") == tmp_path / "x.gguf"


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


# --- a real llama-server: llama.cpp's plain and speculative decoding of the GGUF as given -----


def _need(*missing: tuple[str, bool]) -> None:
    why = "; ".join(w for w, ok in missing if not ok)
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


def _bench(tmp_path, target: str, methods: str, *extra: str, tokens: int = 8) -> dict:
    from dflash.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--target", target, "--threads", "2", "--suites", "chat", "--limit", "1",
                 "--max-new-tokens", str(tokens), "--methods", methods, "--out", str(out), *extra]) == 0
    report = json.loads((out / "results.json").read_text())
    lines = (out / "samples.jsonl").read_text().splitlines()[1:]
    report["outputs"] = {json.loads(line)["method"]: json.loads(line)["output_ids"] for line in lines}
    report["markdown"] = (out / "report.md").read_text()
    return report


def _check_gguf_methods(report: dict, gguf: Path, weights: str) -> dict:
    rows = {r["method"]: r for r in report["results"]}
    for m in ("llamacpp-ar-gguf", "llamacpp-spec-gguf"):
        assert rows[m]["new_tokens"] > 0 and isinstance(rows[m]["greedy_mismatches"], int)
        peer = report["peers"][m]
        assert peer["target"] == gguf.name and peer["target_weights"] == weights
        assert f"`{m}`" in report["markdown"]
    assert rows["llamacpp-ar-gguf"]["tau"] is None and report["peers"]["llamacpp-ar-gguf"]["speculative"] is None
    spec = rows["llamacpp-spec-gguf"]
    steps = sum(spec["acceptance_length_histogram"].values())
    # every decoding step counted, drafted or not: the tokens after the first, less the kept drafts
    assert steps == spec["new_tokens"] - spec["prompts"] - sum(spec["accepted_per_position"])
    assert spec["tau"] >= 1.0 and report["peers"]["llamacpp-spec-gguf"]["speculative"] in report["markdown"]
    return report["peers"]["llamacpp-spec-gguf"]


def test_llamacpp_gguf_methods_on_the_default_targets_gguf(tmp_path):
    """`dflash bench --target SmolLM2's GGUF`: llama.cpp's plain decoding of that very file and
    its own speculation (n-gram: no smaller model has SmolLM2's tokenizer), greedy agreement
    with `ar` reported, llama.cpp's speculative output equal to its plain output."""
    from dflash.model_files import default_target_gguf

    _need(("llama-server is not built (make peers)", llamacpp.binary("llama-server").is_file()))
    gguf = default_target_gguf()
    report = _bench(tmp_path, str(gguf), "ar,llamacpp-ar-gguf,llamacpp-spec-gguf", "--target-backend", "hf")
    spec = _check_gguf_methods(report, gguf, "Q4_1")
    assert "n-gram" in spec["speculative"] and spec["drafter"] is None
    assert report["outputs"]["llamacpp-spec-gguf"] == report["outputs"]["llamacpp-ar-gguf"]


@pytest.mark.slow
def test_llamacpp_gguf_methods_on_qwen_coder(tmp_path):
    """The same on Qwen2.5-Coder-1.5B's GGUF: llama.cpp's speculation drafts with the installed
    Qwen2.5-Coder-0.5B (same tokenizer, smaller). The drafter given is random: these methods
    do not use it (the engine needs one until it serves without). `ar` runs on hf: the
    llamacpp backend cannot give a qwen2 target's layer features to a drafter."""
    import torch

    from dflash.engine.drafter import init_random_drafter, save_drafter
    from dflash.engine.drafter_config import DrafterConfig
    from dflash.model_files import (QWEN_CODER_05B, QWEN_CODER_15B, installed, model_gguf, random_drafter_config,
                                    resolve_target)

    _need(("llama-server is not built (make peers)", llamacpp.binary("llama-server").is_file()),
          *((f"{n} is not installed (dflash models {n})", installed(n)) for n in (QWEN_CODER_15B, QWEN_CODER_05B)))
    torch.set_num_threads(2)
    gguf = model_gguf(QWEN_CODER_15B)
    drafter = tmp_path / "random-drafter"
    cfg = random_drafter_config(resolve_target(str(gguf), quiet=True).folder)
    save_drafter(init_random_drafter(DrafterConfig.from_dict({**cfg, "num_hidden_layers": 1}), seed=0), drafter)
    report = _bench(tmp_path, str(gguf), "ar,llamacpp-ar-gguf,llamacpp-spec-gguf", "--drafter", str(drafter),
                    "--target-backend", "hf", tokens=16)
    spec = _check_gguf_methods(report, gguf, "Q4_K_M")
    assert model_gguf(QWEN_CODER_05B).name in spec["speculative"] and "draft model" in spec["speculative"]
