"""The images copy parts of the worker package into cached build stages (so that other code
changes keep those layers). A part copied must carry every dflash module that importing its
entry modules loads: a new import otherwise breaks `make images`, and only CI builds them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def instructions(dockerfile: Path):
    """(stage, words, line) for each instruction of a Dockerfile, continuation lines joined."""
    stage = "?"
    for line in re.sub(r"\\\n", " ", dockerfile.read_text()).splitlines():
        words = line.split()
        if not words:
            continue
        if words[0].upper() == "FROM":
            stage = words[-1] if len(words) >= 4 and words[-2].upper() == "AS" else words[1]
        yield stage, words, line


def module_name(path: Path) -> str:
    """worker/dflash/a/b.py -> dflash.a.b (a package's __init__ is the package)."""
    rel = path.relative_to("worker").with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def stage_copies(dockerfile: Path) -> dict[str, set[str]]:
    """The worker/dflash paths each build stage copies from the context, keyed by stage."""
    stages: dict[str, set[str]] = {}
    for stage, words, _ in instructions(dockerfile):
        if words[0].upper() == "COPY" and not any(w.startswith("--from") for w in words):
            sources = [w for w in words[1:-1] if not w.startswith("--")]
            ours = {s for s in sources if s.startswith("worker")}
            if ours:
                stages.setdefault(stage, set()).update(ours)
    return stages


def copied_modules(sources: set[str]) -> dict[str, Path]:
    modules = {}
    for source in sources:
        path = ROOT / source
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            modules[module_name(file.relative_to(ROOT))] = file
    return modules


def dflash_imports(file: Path, module: str) -> set[str]:
    """The dflash modules `file` imports, at module level or inside a function (a lazy import
    runs in the build as surely as any other)."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
            found.add(base)
            # `from dflash.convert import onnx_q41` imports a module, not a name
            found.update(f"{base}.{a.name}" for a in node.names)
    return {name for name in found if name == "dflash" or name.startswith("dflash.")}


def closure(entries: set[str], files: dict[str, Path]) -> set[str]:
    """Every dflash module importing `entries` loads, with their parent packages."""
    seen, todo = set(), list(entries)
    while todo:
        name = todo.pop()
        if name in seen or name not in files:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parents run first
        todo.extend(dflash_imports(files[name], name))
    return seen & set(files)


def run_entries(dockerfile: Path, stage: str) -> set[str]:
    """The dflash modules a stage's RUN lines import (`python -c "from dflash.x import ..."`),
    and, for the extension's build, the worker client files its Makefile installs."""
    entries = set()
    for current, words, line in instructions(dockerfile):
        if words[0].upper() == "RUN" and current == stage:
            entries.update(re.findall(r"\b(?:from|import)\s+(dflash(?:\.\w+)*)", line))
            if "extension" in line:
                make = (ROOT / "extension" / "Makefile").read_text()
                entries.update(module_name(Path(p)) for p in re.findall(r"\.\./(worker/dflash/\S+\.py)", make))
    return entries


FILES = copied_modules({"worker/dflash"})
CASES = [(f, stage, sources) for f in DOCKERFILES for stage, sources in stage_copies(f).items()
         if not sources & {"worker", "worker/dflash"}]  # a stage copying the whole tree has nothing to miss


def test_the_images_copy_parts_of_the_package():
    assert CASES, "the Dockerfiles no longer copy parts of worker/dflash: drop this test"
    for dockerfile, stage, _ in CASES:
        assert run_entries(dockerfile, stage), f"{dockerfile.name}:{stage}: no dflash entry found"


@pytest.mark.parametrize(("dockerfile", "stage", "sources"), CASES,
                         ids=[f"{d.name}:{s}" for d, s, _ in CASES])
def test_a_copied_part_carries_what_it_imports(dockerfile, stage, sources):
    have = copied_modules(sources)
    missing = closure(run_entries(dockerfile, stage), FILES) - set(have)
    assert not missing, f"docker/{dockerfile.name}, stage {stage}: copy these too: {sorted(missing)}"


def test_the_check_sees_a_missing_module():
    # model_files imports convert.target_gguf at the top and convert.gguf_file inside a function
    needed = closure({"dflash.model_files"}, FILES)
    assert {"dflash.convert.target_gguf", "dflash.convert.gguf_file"} <= needed
