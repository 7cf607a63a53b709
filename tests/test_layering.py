"""The import graph: packages one way (server -> kv -> engine), no module circle at all.

Every import counts, including the lazy ones inside functions and those under TYPE_CHECKING: a
cycle between engine, kv and server is how a contract ends up owned by its implementation, and a
circle between two modules held by a lazy import is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

import disagg

_ROOT = Path(disagg.__file__).parent
_LAYERED = ("engine", "kv", "server")


def _package_imports() -> dict[str, set[str]]:
    """package -> the disagg packages its modules import (top-level modules count as packages)."""
    graph: dict[str, set[str]] = {}
    for path in _ROOT.rglob("*.py"):
        package = path.relative_to(_ROOT).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "disagg" and len(parts) > 1 and parts[1] != package:
                    graph.setdefault(package, set()).add(parts[1])
    return graph


def test_engine_kv_server_import_one_way() -> None:
    graph = _package_imports()
    assert not graph.get("engine", set()) & {"kv", "server"}, graph.get("engine")
    assert "server" not in graph.get("kv", set()), graph.get("kv")
    for a in _LAYERED:
        for b in graph.get(a, set()) & set(_LAYERED):
            assert a not in graph.get(b, set()), f"{a} and {b} import each other"


def test_kv_never_imports_the_http_framework() -> None:
    """The side channel's routes live with the server (server/kv_routes.py)."""
    for path in (_ROOT / "kv").rglob("*.py"):
        assert "aiohttp" not in path.read_text(), path


# -- the whole graph: modules of disagg/ and benchmarks/ ------------------------------------------

_REPO = _ROOT.parent
_TREES = (_ROOT, _REPO / "benchmarks")
_MAX_LINES = 400


def _module_files() -> dict[str, Path]:
    """Dotted name -> file, for every module of disagg/ and benchmarks/ (benchmarks import their
    siblings by bare name, from their folder on sys.path: `benchmarks.x` is known as `x` too)."""
    files: dict[str, Path] = {}
    for tree in _TREES:
        for path in tree.rglob("*.py"):
            parts = path.relative_to(_REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def _imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _module_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports: every import statement counts, at the top, inside a
    function (lazy) or under `if TYPE_CHECKING` (a circle held by a lazy import is still one)."""
    files = _module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bench_prefix = "benchmarks." if name.startswith("benchmarks.") else ""
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            for imported in _imported_names(node, package):
                for candidate in (imported, bench_prefix + imported if bench_prefix else ""):
                    if candidate in files and candidate != name:
                        deps.add(candidate)
        graph[name] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_disagg_or_benchmarks() -> None:
    graph = _module_graph()
    assert "disagg.engine.engine" in graph and graph["disagg.engine.engine"], "graph is empty"
    assert _circles(graph) == []


def test_no_module_over_400_lines() -> None:
    long = {
        str(path.relative_to(_REPO)): n
        for path in _module_files().values()
        if (n := len(path.read_text().splitlines())) > _MAX_LINES
    }
    assert not long, f"split these by what they hold: {long}"
