"""The research tools (tools/) stay runnable, and the package is what serving needs.

tools/ is outside the package: no test runs a whole measurement, so every name a tool
takes from dflash (at the top or inside a function) must still exist, and tools/README.md
must say what each tool measures. matplotlib is the `bench` extra: charts are drawn where it
is installed and skipped, with a note, where it is not (the worker image).
"""

import ast
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = sorted(p for p in (REPO / "tools").glob("*.py") if p.name != "__init__.py")


def _from_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every absolute `from dflash... / tools... import name` in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in ("dflash", "tools"):
            out += [(node.module, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.stem)
def test_every_name_a_tool_imports_exists(tool):
    missing = []
    for module, name in _from_imports(tool):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{tool.name} imports names that no longer exist: {missing}"


def test_the_import_check_sees_a_missing_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def main():\n    from dflash.errors import NoSuchThing\n")
    assert _from_imports(bad) == [("dflash.errors", "NoSuchThing")]
    assert not hasattr(importlib.import_module("dflash.errors"), "NoSuchThing")


def test_the_tools_readme_names_every_tool():
    text = (REPO / "tools" / "README.md").read_text()
    absent = [p.stem for p in TOOLS if f"`tools.{p.stem}`" not in text and f"python -m tools.{p.stem}`" not in text]
    assert not absent, f"tools/README.md says nothing of {absent}"


def test_no_chart_and_a_note_without_matplotlib(tmp_path, monkeypatch, capsys):
    from dflash.train.trainer import plot_losses

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    plot_losses([(1, 0.5, 2.0), (2, 1.0, 1.5)], tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_a_chart_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra is not installed")
    from dflash.train.trainer import plot_losses

    plot_losses([(1, 0.5, 2.0), (2, 1.0, 1.5)], tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serving_installs_neither_matplotlib_nor_the_assistant():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    deps = " ".join(project["project"]["dependencies"])
    assert "matplotlib" not in deps
    assert any(d.startswith("matplotlib==") for d in project["project"]["optional-dependencies"]["bench"])
    assert "bench" in next(x for x in (REPO / "Makefile").read_text().splitlines() if "pip install" in x and "-e '." in x)
    assert not [g for g in project["tool"]["setuptools"]["package-data"]["dflash"] if "assistants" in g]
    assert "worker/dflash/assets/assistants" in (REPO / ".dockerignore").read_text().splitlines()
