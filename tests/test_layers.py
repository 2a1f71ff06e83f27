"""The package's import graph points one way and has no circle.

Every `import` in worker/dflash counts, the ones inside functions too (a lazy import is still
an arrow). Layers, lowest first: the core (errors, error codes, options, the
ort export's file names), the engine, the prompt suites (a constrained prompt's grammar is
checked by the engine's), the embedder and the local cluster, conversion, the model files, the remote engine
(an inference server behind the engine's interface), loading models into an engine, training, serving, the bench and the demo, the CLI. A module may import its
own layer or a lower one, never a higher one; and no set of modules imports itself in a
circle (checked on modules, with a package's __init__ as its own node).

The package is what is served: the research tools (tools/) import dflash, never the other
way; serving reaches no bench module and not the AR assistant; matplotlib (the `bench`
extra) is imported in one place, dflash.plots, and only when a chart is drawn.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "worker"
TOOLS = ROOT.parent / "tools"
LAYERS = [
    ("dflash", "dflash.errors", "dflash.error_codes", "dflash.options", "dflash.onnx_export_files",
     "dflash.processes", "dflash.plots"),
    ("dflash.engine",),
    ("dflash.suites", "dflash.embed", "dflash.localpg"),
    ("dflash.convert",),
    ("dflash.model_files",),
    ("dflash.remote",),
    ("dflash.loading",),
    ("dflash.train",),
    ("dflash.serve",),
    ("dflash.bench", "dflash.demo"),
    ("dflash.cli",),
]


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in (ROOT / "dflash").rglob("*.py")}


def _absolute_imports(path: Path) -> set[str]:
    """Every module name an absolute `import` or `from ... import` in `path` names, lazy ones too."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The dflash modules `name` imports (resolved to the longest known module name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t.startswith("dflash") and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _imports(n, p, set(mods)) for n, p in mods.items()}


def _layer(name: str) -> int:
    best, rank = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{name} is in no layer: add it to tests/test_layers.py"
    return rank


def test_every_module_is_in_a_layer_and_imports_only_downwards():
    graph = _graph()
    assert len(graph) > 60 and "dflash.engine.engine" in graph["dflash.loading"]
    up = sorted((a, b) for a, deps in graph.items() for b in deps
                if _layer(b) > _layer(a) and b != "dflash")
    assert not up, "upward imports: " + ", ".join(f"{a} -> {b}" for a, b in up)


def test_no_module_imports_itself_in_a_circle():
    graph = _graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import circles: {cycles}"


def test_the_check_sees_an_upward_import():
    """The graph builder resolves relative and lazy imports (else the checks above prove nothing)."""
    src = ROOT / "dflash" / "engine" / "engine.py"
    found = _imports("dflash.engine.engine", src, set(_modules()))
    assert "dflash.engine.policy" in found and "dflash.errors" in found


def _reach(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def _names(imports: set[str], top: str) -> set[str]:
    return {m for m in imports if m == top or m.startswith(top + ".")}


def test_the_package_never_imports_the_research_tools():
    tools = sorted(TOOLS.glob("*.py"))
    assert len(tools) > 5 and any(_names(_absolute_imports(p), "dflash") for p in tools)
    up = sorted(n for n, p in _modules().items() if _names(_absolute_imports(p), "tools"))
    assert not up, f"dflash modules importing tools/: {up}"


def test_serving_reaches_no_bench_module_and_not_the_assistant():
    graph = _graph()
    served = _reach(graph, [m for m in graph if m.startswith("dflash.serve")])
    assert "dflash.engine.engine" in served and "dflash.train.trainer" in served  # serve --learn trains
    research = sorted(m for m in served if m.startswith("dflash.bench") or m == "dflash.train.assistant")
    assert not research, f"serving imports research code: {research}"


def test_matplotlib_is_imported_only_by_the_plots_module():
    files = {**_modules(), **{f"tools.{p.stem}": p for p in TOOLS.glob("*.py")}}
    users = sorted(n for n, p in files.items() if _names(_absolute_imports(p), "matplotlib"))
    assert users == ["dflash.plots"], users
