"""The bench over every usable backend: one table per CPU kind, put between that kind's markers."""

from dflash.bench import every_backend


def _report(backend_mismatches=0):
    return {"results": [
        {"suite": "code", "method": "ar", "tokens_per_s": 100.0, "speedup_vs_ar": 1.0, "tau": None,
         "greedy_mismatches": 0},
        {"suite": "code", "method": "dflash-auto", "tokens_per_s": 160.0, "speedup_vs_ar": 1.6, "tau": 2.31,
         "greedy_mismatches": backend_mismatches}]}


def test_cpu_kind_names_family_and_model():
    assert every_backend.cpu_kind("AMD EPYC (family 25 model 17: avx2 avx512f)") == "amd-epyc-25-17"
    assert every_backend.cpu_kind("Intel(R) Xeon(R) Processor (family 6 model 143: amx_tile)") == \
        "intel-r-xeon-r-processor-6-143"


def test_the_table_has_a_row_per_run_and_says_what_did_not_run():
    body = every_backend.table("CPU X", {"ort": "usable", "llamacpp": "UNUSABLE: killed by SIGSEGV"},
                               {"ort": _report()}, "dflash bench --limit 1")
    assert "| ort | code | dflash-auto | 160.0 | 1.60 | 2.31 | 0 |" in body
    assert "| ort | code | ar | 100.0 | 1.00 |  | 0 |" in body
    assert "`llamacpp`: UNUSABLE: killed by SIGSEGV" in body


def test_main_runs_each_usable_backend_and_writes_the_cpu_section(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    ran = []
    monkeypatch.setattr(every_backend, "usable_backends",
                        lambda: ("AMD EPYC (family 25 model 17: avx2)", {"hf": "usable (the reference: not probed)",
                                                                        "ort": "usable", "llamacpp": "UNUSABLE: x"}))

    class Done:
        returncode = 0

    def fake_run(cmd):
        backend, out = cmd[cmd.index("--target-backend") + 1], cmd[cmd.index("--out") + 1]
        ran.append(backend)
        Path(out).mkdir(parents=True)
        (Path(out) / "results.json").write_text(json.dumps(_report(1 if backend == "ort" else 0)))
        return Done()

    monkeypatch.setattr(every_backend.subprocess, "run", fake_run)
    doc = tmp_path / "cpus.md"
    doc.write_text("# CPUs\n")
    rc = every_backend.main(["--out", str(tmp_path / "out"), "--doc", str(doc), "--", "--limit", "1"])
    assert ran == ["hf", "ort"] and rc == 1  # a mismatch fails the run
    text = doc.read_text()
    assert "<!-- cpu-amd-epyc-25-17:start -->" in text and "| ort | code | dflash-auto |" in text
    # a second run replaces the section, it does not add another
    every_backend.main(["--out", str(tmp_path / "out2"), "--doc", str(doc), "--backends", "hf", "--", "--limit", "1"])
    assert doc.read_text().count("cpu-amd-epyc-25-17:start") == 1
