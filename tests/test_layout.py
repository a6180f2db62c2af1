"""The package's import graph: no circles, and the runtime stands on nothing above it.

Every import statement counts, also those inside functions and under TYPE_CHECKING: a lazy import still ties the
two modules together, it only hides the circle until the code path runs.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specdec"
# The runtime is what a user's process loads (numpy + onnxruntime + tokenizers); these sit above it.
ABOVE_RUNTIME = ("specdec.export", "specdec.quant", "specdec.cli", "specdec.server")


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module and package of specdec."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The specdec module that `name` (a module, or an attribute of one) lives in; None outside specdec."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the specdec modules it imports (by any import statement anywhere in it)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from a import b`: b is a submodule of a, or a name defined in a
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            deps.update(o for t in targets if (o := _owner(t, known)) is not None and o != name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_package():
    graph = import_graph()
    assert "specdec.runtime.engine" in graph and "specdec.runtime.speculative" in graph["specdec.runtime.engine"]
    assert "specdec.cli" in graph


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_inside_specdec():
    graph = import_graph()
    found = circles(graph)
    detail = ["; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(detail)


def test_the_runtime_imports_nothing_above_it():
    wrong = {m: sorted(d for d in deps if any(d == a or d.startswith(a + ".") for a in ABOVE_RUNTIME))
             for m, deps in import_graph().items() if m == "specdec.runtime" or m.startswith("specdec.runtime.")}
    assert not {m: d for m, d in wrong.items() if d}
