"""No import cycle inside ``kamera_engine``: no module imports, at its top or lazily inside a function, a module
that imports it back (directly or through others). Read from the source with the standard library only.

A package's own ``__init__`` running before its submodules is not counted as an edge (every package would be a
cycle); an explicit ``import kamera_engine`` / ``from kamera_engine import X`` is. Imports under
``if TYPE_CHECKING:`` never run, so they are not edges (annotations may name a class of a module that imports
this one).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGE = "kamera_engine"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (its directory ``root``), by dotted name."""
    modules: dict[str, Path] = {}
    for file in sorted(root.rglob("*.py")):
        parts = [package, *file.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = file
    return modules


def imported(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that module ``name`` imports anywhere in its body (functions included)."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = package_modules(root, package)
    return {name: imported(name, file, modules) for name, file in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def _package_root() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def test_kamera_engine_has_no_import_cycle() -> None:
    graph = import_graph(_package_root(), PACKAGE)
    assert f"{PACKAGE}.engine" in graph and f"{PACKAGE}.vision.engine" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_engine_does_not_import_vision() -> None:
    graph = import_graph(_package_root(), PACKAGE)
    reach, todo = set(), [f"{PACKAGE}.engine"]
    while todo:
        for nxt in graph[todo.pop()] - reach:
            reach.add(nxt)
            todo.append(nxt)
    assert not {m for m in reach if m.startswith(f"{PACKAGE}.vision")}


def test_a_lazy_import_back_is_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .sub import b\n\nclass A:\n    pass\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def late():\n    from ..a import A\n    return A\n")
    (pkg / "c.py").write_text("import pkg.sub.b\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.sub.b"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (pkg / "sub" / "b.py").write_text("def late():\n    return None\n")
    assert find_cycle(import_graph(pkg, "pkg")) is None
