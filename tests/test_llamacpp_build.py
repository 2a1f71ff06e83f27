"""llama.cpp is built one way here: the flags have one definition (dflash.llamacpp_build),
which the binding's build (Makefile), the llama-server/llama-bench build (dflash.bench.llamacpp)
and the images read; none of them builds AMX code, which faults on the Xeons here."""

import re
import subprocess
import sys
from pathlib import Path

from dflash import llamacpp_build
from dflash.bench import llamacpp as peer

REPO = Path(__file__).resolve().parents[1]
# (spelled in parts here, so that the flags' spelling stands in one file of the repository)
NO_AMX = ("amx-tile", "amx-int8", "amx-bf16")


def test_every_build_leaves_amx_out():
    for name, flags in llamacpp_build.SETS.items():
        for var in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
            value = next(f.split("=", 1)[1] for f in flags if f.startswith(f"-D{var}="))
            assert {f"-mno-{x}" for x in NO_AMX} <= set(value.split()), (name, var)


def test_the_tools_build_is_the_shared_definition():
    assert peer.CMAKE_FLAGS is llamacpp_build.TOOLS


def test_the_makefile_builds_the_binding_from_the_shared_definition():
    """What `make setup` passes as CMAKE_ARGS is what the module prints (make -n shows it)."""
    out = subprocess.run(["make", "-n", "-B", "-C", str(REPO), ".venv/.installed", f"PYTHON={sys.executable}"],
                         capture_output=True, text=True, check=True).stdout
    args = re.search(r'CMAKE_ARGS="([^"]*)"', out).group(1)
    assert args == llamacpp_build.cmake_args("binding")
    assert "--no-cache-dir" in out  # a wheel cached from other flags is never reused


def test_the_binding_version_has_one_pin():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"llama-cpp-python=={peer.VERSION}"' in pyproject


def test_the_amx_flags_are_written_in_one_place():
    hits = subprocess.run(["git", "-C", str(REPO), "grep", "-l", "--untracked", "mno-" + "amx"], capture_output=True,
                          text=True).stdout
    assert hits.split() == ["worker/dflash/llamacpp_build.py"]


def test_the_build_comparison_keeps_one_line_per_cpu(tmp_path):
    doc = tmp_path / "cpus.md"
    doc.write_text("text\n<!-- compare-builds:start -->\n<!-- compare-builds:end -->\nmore\n")

    def result(cpu, decode):
        return {"cpu": cpu, "builds": {"native": {"prefill_4": 200.0, "decode": 100.0},
                                       "portable": {"prefill_4": 150.0, "decode": decode}},
                "portable_over_native": {"prefill_4": 0.75, "decode": decode / 100.0}}

    peer.write_comparison(doc, result("CPU A", 90.0))
    peer.write_comparison(doc, result("CPU B", 80.0))
    peer.write_comparison(doc, result("CPU A", 95.0))  # measured again: replaced, not added
    text = doc.read_text()
    assert text.startswith("text\n") and text.endswith("more\n")
    assert text.count("| CPU A |") == 1 and "| 95.0 (0.95×) |" in text and "| CPU B |" in text
    assert "90.0" not in text
