"""The layout of ``src/`` as a map of the house, checked from the source text.

- No folder holds more than :data:`MAX_MODULES` modules: a bigger room is split into rooms
  named for their jobs (``iop_edge/{listener,api,nodes,ha,ui,config}``).
- No module is longer than :data:`MAX_MODULE_LINES` lines.
- No import circle between modules: what a module imports at import time (outside
  ``if TYPE_CHECKING:`` and function bodies) never leads back to it.

Known exceptions are listed with their reason; an entry that no longer applies must go.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_MODULES = 12
MAX_MODULE_LINES = 500
CROWDED_FOR_NOW: dict[str, str] = {
    "iop_admission": "the core's parts (slots and choice, waiting, health, tenancy, refresh) become their own "
    "package when AdmissionState is composed of them instead of mixins (issue 41, open)",
}
LONG_FOR_NOW: dict[str, str] = {
    "iop_http/reader.py": "the request reader and its rules; the Node's answer parser joins iop_http next (issue 41)",
    "iop_node/upstream/transport.py": "pool, connection and HTTP/1.1 in one; to split as httpcore cuts them (issue 41)",
}


def modules() -> Iterator[Path]:
    yield from (p for p in sorted(SRC.rglob("*.py")) if "egg-info" not in str(p))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_no_folder_holds_more_than_twelve_modules() -> None:
    crowded = {}
    for folder in sorted({p.parent for p in modules()}):
        count = sum(1 for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
        name = str(folder.relative_to(SRC))
        if count > MAX_MODULES and name not in CROWDED_FOR_NOW:
            crowded[name] = count
    assert not crowded, crowded
    gone = [name for name in CROWDED_FOR_NOW if len(list((SRC / name).glob("*.py"))) <= MAX_MODULES + 2]
    assert not gone, f"no longer crowded, remove from CROWDED_FOR_NOW: {gone}"


def test_no_module_over_500_lines() -> None:
    long = {}
    for path in modules():
        name = str(path.relative_to(SRC))
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES and name not in LONG_FOR_NOW:
            long[name] = lines
    assert not long, long
    short = [name for name in LONG_FOR_NOW if len((SRC / name).read_text(encoding="utf-8").splitlines()) <= MAX_MODULE_LINES]
    assert not short, f"no longer long, remove from LONG_FOR_NOW: {short}"


def import_time_imports(source: str, name: str, is_package: bool) -> Iterator[str]:
    """The modules ``name`` imports when it is imported (top level; not under ``if TYPE_CHECKING``)."""
    package = name if is_package else name.rpartition(".")[0]
    for node in _top_level(ast.parse(source).body):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.If | ast.Try):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
            for handler in getattr(node, "handlers", ()):
                yield from _top_level(handler.body)
        else:
            yield node


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = import_time_imports(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
        # A module's own packages are imported before it, whatever it says: no edge to them.
        graph[name] = {t for t in targets if t in paths and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle() -> None:
    assert cycles(import_graph()) == []


def test_the_circle_check_finds_a_circle_and_ignores_type_checking_imports() -> None:
    a = "from typing import TYPE_CHECKING\nimport p.b\nif TYPE_CHECKING:\n    from p.c import C\n"
    assert set(import_time_imports(a, "p.a", False)) == {"typing", "typing.TYPE_CHECKING", "p.b"}
    assert set(import_time_imports("from .b import x\n", "p.a", False)) == {"p.b", "p.b.x"}
    assert set(import_time_imports("from . import b\n", "p", True)) == {"p", "p.b"}
    assert cycles({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}) == [["p.a", "p.b", "p.c"]]
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == []
