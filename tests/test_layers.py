"""The package's import graph points one way and has no circle.

Every `import` in worker/dflash counts, the ones inside functions too (a lazy import is still
an arrow). Layers, lowest first: the core (errors, error codes, options, prompt suites, the
ort export's file names), the engine, the embedder and the local cluster, conversion, the model files, the remote engine
(an inference server behind the engine's interface), loading models into an engine, training, serving, the bench and the demo, the CLI. A module may import its
own layer or a lower one, never a higher one; and no set of modules imports itself in a
circle (checked on modules, with a package's __init__ as its own node).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "worker"
LAYERS = [
    ("dflash", "dflash.errors", "dflash.error_codes", "dflash.options", "dflash.suites", "dflash.onnx_export_files",
     "dflash.processes"),
    ("dflash.engine",),
    ("dflash.embed", "dflash.localpg"),
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
