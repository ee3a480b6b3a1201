"""The layout of ``src/`` as a map of the house, checked from the source text.

- No folder holds more than :data:`MAX_MODULES` modules: a bigger room is split into rooms
  named for their jobs (``iop_edge/{listener,api,nodes,ha,ui,config}``).
- No module is longer than :data:`MAX_MODULE_LINES` lines.
- No class holds unrelated concerns: its methods share its attributes (one group, LCOM4).
- No import circle between modules: what a module imports at import time (outside
  ``if TYPE_CHECKING:`` and function bodies) never leads back to it.

Known exceptions are listed with their reason; an entry that no longer applies must go.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_MODULES = 12
MAX_MODULE_LINES = 500
CROWDED_FOR_NOW: dict[str, str] = {}
LONG_FOR_NOW: dict[str, str] = {}
LOOSE_FOR_NOW: dict[str, str] = {}
"""Classes whose methods fall into unrelated groups, each with its reason; an entry that holds one group must go."""


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
    short = [
        name for name in LONG_FOR_NOW if len((SRC / name).read_text(encoding="utf-8").splitlines()) <= MAX_MODULE_LINES
    ]
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


def method_groups(cls: ast.ClassDef) -> list[list[str]]:
    """The groups of ``cls``'s methods that share no attribute with each other (LCOM4).

    Two methods are in one group when they read or write a common ``self`` attribute or one
    calls the other. Static and class methods, dunders other than ``__init__``, and methods
    touching no attribute of ``self`` (a stub, a pure helper) are left out. A cohesive class has
    one group; several mean several concerns in one class.
    """
    uses: dict[str, set[str]] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        decorators = {ast.unparse(d) for d in node.decorator_list}
        if decorators & {"staticmethod", "classmethod"} or (node.name.startswith("__") and node.name != "__init__"):
            continue
        attributes = {
            x.attr
            for x in ast.walk(node)
            if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self"
        }
        if attributes:
            uses[node.name] = attributes
    group = {name: name for name in uses}

    def root(name: str) -> str:
        while group[name] != name:
            name = group[name]
        return name

    for a in uses:
        for b in uses:
            if a < b and (uses[a] & uses[b] or b in uses[a] or a in uses[b]):
                group[root(a)] = root(b)
    found: dict[str, list[str]] = {}
    for name in uses:
        found.setdefault(root(name), []).append(name)
    return list(found.values())


def _is_value(cls: ast.ClassDef) -> bool:
    """A frozen attrs value (config, snapshot, message): fields and what is derived from them."""
    return any("frozen" in ast.unparse(d) for d in cls.decorator_list)


def _is_protocol(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(base).endswith("Protocol") for base in cls.bases)


def test_no_class_holds_unrelated_concerns() -> None:
    split = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and not _is_protocol(node) and not _is_value(node):
                key = f"{path.relative_to(SRC)}:{node.name}"
                groups = method_groups(node)
                if len(groups) > 1 and key not in LOOSE_FOR_NOW:
                    split[key] = [sorted(g) for g in groups]
    assert not split, split
    whole = [key for key in LOOSE_FOR_NOW if len(_groups_of(key)) <= 1]
    assert not whole, f"one group now, remove from LOOSE_FOR_NOW: {whole}"


def _groups_of(key: str) -> list[list[str]]:
    path, _, name = key.partition(":")
    tree = ast.parse((SRC / path).read_text(encoding="utf-8"))
    return next(method_groups(n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_cohesion_check_finds_two_concerns_in_one_class() -> None:
    source = (
        "class Two:\n"
        "    def a(self): return self.x\n"
        "    def b(self): self.x = 1\n"
        "    def c(self): return self.y\n"
        "    def stub(self): ...\n"
        "class One:\n"
        "    def a(self): return self.x\n"
        "    def b(self): return self.a() + self.y\n"
        "    def c(self): return self.y\n"
    )
    two, one = (n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    assert sorted(sorted(g) for g in method_groups(two)) == [["a", "b"], ["c"]]
    assert method_groups(one) == [["a", "b", "c"]]


FIGURES = re.compile(
    r"µs|py-spy|[Mm]easured (with|on|at)|benchmark(?:'s)? box|\d+(\.\d+)? ?(µs|ms of CPU)|% of (the|its) [\w']+ CPU"
)
"""What a measurement in a docstring or comment looks like: timings, profilers, percentages of CPU."""
FIGURES_FOR_NOW: dict[str, str] = {}
"""Modules whose measurement history still waits to move to docs/benchmarks.md; an entry that holds none must go."""


def _figures(path: Path) -> list[str]:
    """``line: figure`` for each measurement in ``path``'s prose strings (docstrings) and comments."""
    text = path.read_text(encoding="utf-8")
    found = []
    for node in ast.walk(ast.parse(text)):
        prose = isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value.strip()
        if prose and (match := FIGURES.search(node.value)):  # type: ignore[attr-defined]
            found.append(f"{node.lineno}: {match.group(0)}")
    for number, line in enumerate(text.splitlines(), 1):
        if "#" in line and (match := FIGURES.search(line.split("#", 1)[1])):
            found.append(f"{number}: {match.group(0)}")
    return found


def test_docstrings_and_comments_carry_the_why_not_the_figures() -> None:
    """Measurements and their history live in docs/benchmarks.md ("Figures behind the code") and in
    commit messages; the code says why in words."""
    found = {}
    for path in modules():
        name = str(path.relative_to(SRC))
        hits = _figures(path)
        if hits and name not in FIGURES_FOR_NOW:
            found[name] = hits
    assert not found, found
    clean = [name for name in FIGURES_FOR_NOW if not _figures(SRC / name)]
    assert not clean, f"no figures left, remove from FIGURES_FOR_NOW: {clean}"
