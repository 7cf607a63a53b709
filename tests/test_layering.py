"""The packages import one way: server -> kv -> engine (and everything -> protocol/config).

Every `import disagg.X` in the package counts, including the lazy ones inside functions: a
cycle between engine, kv and server is how a contract ends up owned by its implementation.
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
