"""House rules that a reader of ``src/`` relies on, checked from the source text.

- No package imports another package's private modules: whatever ``iop_edge``
  needs from ``iop_admission`` is public API (exported, documented), never
  ``iop_admission._x``.
- No function body is longer than 50 lines (docstring excluded): a longer one
  is split into named steps.
- No module imports another module's underscore names (``from ._x import
  _y``, ``from . import _x``), inside a package or across packages.
- No class of ``src/`` is over 300 lines of code, docstrings aside (known exceptions
  listed, each with its reason).
- The benchmarks (``benchmarks/``) use public names only: no package's
  private module, no other module's underscore name; they write no CRLF
  (requests are encoded by ``iop_http``).
- The tests (``tests/``) hold the packages through their public names: no private module,
  no other module's underscore name, no private attribute of a project object, but for the
  few listed, each with its reason (a sensitivity test breaking a private step on purpose, a
  checker reading what no public query gives).

Read from the source text, so they hold for code no test happens to import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
BENCHMARKS = SRC.parent / "benchmarks"
PRIVATE_FOR_NOW: set[str] = set()
"""Benchmarks of a private name, until its package makes it public; an entry that is public now must go."""
MAX_BODY_LINES = 50
LONG_FOR_NOW: set[str] = set()
"""Known offenders being split by open work; an entry that is no longer long must go."""


def private_imports(source: str, package: str) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of each import of another ``iop_*`` package's private name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            top, *rest = name.split(".")
            if top.startswith("iop_") and top != package and any(_private(part) for part in rest):
                yield node.lineno, name


def private_modules(source: str) -> set[str]:
    """The private modules or names of ``iop_*`` packages ``source`` imports, each up to its first private part."""
    found = set()
    for _, name in private_imports(source, ""):
        parts = name.split(".")
        private = next(i for i, part in enumerate(parts) if _private(part))
        found.add(".".join(parts[: private + 1]))
    return found


def _private(name: str) -> bool:
    """An underscore name that is no dunder (``__main__`` is a package's public entry point)."""
    return name.startswith("_") and not name.endswith("__")


def test_no_private_import_across_packages() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line}: {name}"
        for path in sorted(SRC.rglob("*.py"))
        for line, name in private_imports(path.read_text(encoding="utf-8"), path.relative_to(SRC).parts[0])
    ]
    assert not found, found


def test_the_scan_reports_cross_package_private_imports_only() -> None:
    source = (
        "from iop_admission._config import validate_pool\n"
        "from iop_edge.nodes.link import NodeLink\n"
        "import iop_wire._codec\n"
        "from iop_admission import _state\n"
        "from iop_admission import Admission\n"
        "from ._http_api import EdgeAPI\n"
    )
    assert list(private_imports(source, "iop_edge")) == [
        (1, "iop_admission._config"),
        (1, "iop_admission._config.validate_pool"),
        (3, "iop_wire._codec"),
        (4, "iop_admission._state"),
    ]


def long_functions(source: str) -> Iterator[tuple[str, int]]:
    """``(qualified name, body lines)`` of each function whose body (docstring excluded) is too long."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body[1:] if ast.get_docstring(child) is not None else child.body
                lines = (child.end_lineno or child.lineno) - body[0].lineno + 1 if body else 0
                if lines > MAX_BODY_LINES:
                    yield f"{prefix}{child.name}", lines
                yield from visit(child, f"{prefix}{child.name}.")

    yield from visit(ast.parse(source), "")


def test_no_function_body_over_50_lines() -> None:
    found = {
        f"{path.relative_to(SRC).as_posix()}:{name}": lines
        for path in sorted(SRC.rglob("*.py"))
        for name, lines in long_functions(path.read_text(encoding="utf-8"))
    }
    assert set(found) - LONG_FOR_NOW == set(), found
    assert set(found) >= LONG_FOR_NOW, f"no longer long, remove from LONG_FOR_NOW: {LONG_FOR_NOW - set(found)}"


def test_the_length_check_counts_the_body_without_its_docstring() -> None:
    body = "\n".join(f"    x = {i}" for i in range(MAX_BODY_LINES))
    source = f'class C:\n    def ok(self):\n        """Doc."""\n{body.replace("    ", "        ")}\n\ndef long():\n{body}\n    return x\n'
    assert list(long_functions(source)) == [("long", MAX_BODY_LINES + 1)]


# ------------------------------------------------------------ one owner per name, rooms of a size

MAX_CLASS_LINES = 300
"""The backstop beside the cohesion rule (tests/docs/test_layout.py): lines of code a class holds,
its docstrings not counted (a public facade documents each operation where it is defined)."""
SIZED_PACKAGES = tuple(sorted(p.name for p in SRC.glob("iop_*") if (p / "__init__.py").exists()))
LARGE_FOR_NOW: set[str] = set()
"""Known classes over the bound; an entry that is no longer large must go."""


def underscore_imports(source: str) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of each ``from x import _name``: another module's private name (dunders aside)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield node.lineno, alias.name


def test_no_module_imports_another_modules_underscore_names() -> None:
    """Inside a package or across packages: what another module needs is a public name of its module."""
    found = [
        f"{path.relative_to(SRC)}:{line}: {name}"
        for path in sorted(SRC.rglob("*.py"))
        for line, name in underscore_imports(path.read_text(encoding="utf-8"))
    ]
    assert not found, found


def test_the_underscore_scan_reports_private_names_only() -> None:
    source = "from . import _server\nfrom ._transport import Checkout, _take\nfrom ._x import __version__\n"
    assert list(underscore_imports(source)) == [(1, "_server"), (2, "_take")]


def docstring_lines(cls: ast.ClassDef) -> int:
    """Lines of the docstrings of ``cls`` and of the functions and classes within it."""
    total = 0
    for node in ast.walk(cls):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
                and first.end_lineno is not None
            ):
                total += first.end_lineno - first.lineno + 1
    return total


def large_classes() -> dict[str, int]:
    """``path:Class`` -> lines of code (docstrings aside) of every class over :data:`MAX_CLASS_LINES`
    in the sized packages."""
    found = {}
    for package in SIZED_PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    lines = node.end_lineno - node.lineno + 1 - docstring_lines(node)
                    if lines > MAX_CLASS_LINES:
                        found[f"{path.relative_to(SRC).as_posix()}:{node.name}"] = lines
    return found


def test_no_class_over_300_lines() -> None:
    """A class holds one concern (the cohesion rule); past 300 lines of code it holds several."""
    large = large_classes()
    assert set(large) - LARGE_FOR_NOW == set(), large
    assert LARGE_FOR_NOW - set(large) == set(), "no longer large: remove from LARGE_FOR_NOW"


def test_only_iop_http_writes_http_line_ends() -> None:
    """HTTP/1.1 is encoded in one place (``iop_http``): no other module of ``src`` holds a CRLF literal."""
    found = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).parts[0] != "iop_http"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, bytes) and b"\r\n" in node.value
    ]
    assert not found, found


def _holds_crlf(value: object) -> bool:
    return (isinstance(value, bytes) and b"\r\n" in value) or (isinstance(value, str) and "\r\n" in value)


def test_benchmarks_use_public_names_and_iop_http_only() -> None:
    """A benchmark measures the project through its public API, and frames HTTP with ``iop_http``."""
    found = set()
    for path in sorted(BENCHMARKS.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        found |= {f"{path.name}:{module}" for module in private_modules(source)}
        found |= {f"{path.name}:{name}" for _, name in underscore_imports(source)}
        found |= {
            f"{path.name}:{node.lineno}: CRLF"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and _holds_crlf(node.value)
        }
    assert found == PRIVATE_FOR_NOW, found


# ------------------------------------------------------------ tests through public interfaces

TESTS = SRC.parent / "tests"
TESTS_PRIVATE: dict[str, str] = {
    "wire/test_wire_properties.py:iop_wire._codec": "switches the codec's fast paths off to check them against the converter",
    "sim/test_sim.py:iop_admission._core": "a sensitivity test breaks the core's dispatch on purpose",
    "admission/test_health_table.py:iop_admission._core": "the health transition table itself: its entries, its refusals",
    **dict.fromkeys(
        ("config/test_fast_parse.py:iop_config._fast_yaml", "config/test_loader.py:iop_config._fast_yaml"),
        "the fast YAML reader checked against PyYAML's own, its fallback forced",
    ),
    **dict.fromkeys(
        ("config/test_fast_parse.py:iop_config._loader", "config/test_loader.py:iop_config._loader"),
        "the loader's parses counted and forced to fail (its fallback to the round-trip reader)",
    ),
    "config/test_fast_parse.py:iop_config._positions": "the round-trip reader's plain values, the fast reader's oracle",
    "edge/test_edge_reload.py:iop_edge._service": "the reload's reader and turns wrapped to count and to hold them",
    "edge/test_overload_paced_refusals.py:iop_edge.listener.server._Connection": "one connection driven alone",
    "ha/test_leader_fence.py:iop_edge.nodes.link._withhold_runs": "the rule that withholds runs, on its own",
}
"""Test modules' imports of a private module, each with its reason; an entry no longer imported must go."""
TESTS_PRIVATE_ATTRIBUTES: dict[str, str] = {
    **dict.fromkeys(
        (
            "admission/layers.py:_handoff",
            "admission/layers.py:_parked",
            "admission/layers.py:_bodies",
        ),
        "the layers' checker: a lease's hand-off holds no parked task nor body once the layer is idle",
    ),
    **dict.fromkeys(
        (
            "admission/test_tenant_machine.py:_pool",
            "admission/test_tenant_machine.py:_tenants",
            "admission/test_tenant_machine.py:_vtime",
        ),
        "the fairness model checks the core's own virtual times and admitting flags against its own",
    ),
    **dict.fromkeys(
        ("admission/test_ledger_core_machine.py:_pool", "admission/test_ledger_core_machine.py:_slot"),
        "the ledger machine checks each provider's TokenLedger (its pin, its leases) and the groups' choice"
        " against its own model; the snapshot shows only the sums",
    ),
    "edge/test_config_reader.py:_lookups": "a rebuilt config's memoised lookups equal a loaded one's",
    "edge/test_config_reader.py:_Rebuilder": "the reader's pickle format read back piece by piece",
    "edge/test_config_reader.py:_Writer": "the reader's pickle format written piece by piece",
    "edge/test_metrics.py:_events": "a cancelled run() leaves no subscriber behind (no public count of them)",
    "edge/test_node_socket.py:_send_lock": "holds the send lock to stand for another send under way",
    **dict.fromkeys(
        (
            "sim/_world.py:_candidates",
            "sim/_world.py:_epoch",
            "sim/_world.py:_pool",
            "sim/_world.py:_release",
            "sim/_world.py:_reported",
            "sim/_world.py:_slot",
            "sim/_world.py:_tenants",
            "sim/_tenants.py:_candidates",
            "sim/_tenants.py:_slot",
            "sim/_tenants.py:_tenants",
            "sim/_health.py:_pool",
        ),
        "the simulation's invariants read the core's and the daemons' inner state after every step",
    ),
}
"""Private attributes of project objects read by tests, each with its reason; an entry no longer read must go."""


def _defined_private_names(paths: Iterator[Path]) -> set[str]:
    """Underscore names (dunders aside) that ``paths`` define: functions, classes, assigned names and attributes."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if _private(name)}


def private_attribute_reads(source: str, project: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of each ``x._name`` where ``_name`` is one of ``project``'s and ``x`` is not ``self``/``cls``."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in project
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            yield node.lineno, node.attr


def test_tests_import_public_names_only() -> None:
    """A test holds a package by its public names, so a move inside a package moves no test."""
    found = {
        f"{path.relative_to(TESTS).as_posix()}:{module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in private_modules(path.read_text(encoding="utf-8"))
    }
    assert found - set(TESTS_PRIVATE) == set(), found - set(TESTS_PRIVATE)
    assert set(TESTS_PRIVATE) - found == set(), "no longer imported: remove from TESTS_PRIVATE"


def test_tests_read_no_private_attribute_of_the_project() -> None:
    """A private attribute of ``src/`` (one no test module defines itself) read by a test: listed, with its reason."""
    project = _defined_private_names(SRC.rglob("*.py")) - _defined_private_names(TESTS.rglob("*.py"))
    found = {
        f"{path.relative_to(TESTS).as_posix()}:{name}"
        for path in sorted(TESTS.rglob("*.py"))
        for _, name in private_attribute_reads(path.read_text(encoding="utf-8"), project)
    }
    assert found - set(TESTS_PRIVATE_ATTRIBUTES) == set(), found - set(TESTS_PRIVATE_ATTRIBUTES)
    assert set(TESTS_PRIVATE_ATTRIBUTES) - found == set(), "no longer read: remove from TESTS_PRIVATE_ATTRIBUTES"


def test_the_attribute_scan_reports_other_objects_private_names_only() -> None:
    source = "self._a\ncls._a\nstate._a\nstate._b\nstate.a\n"
    assert list(private_attribute_reads(source, {"_a"})) == [(3, "_a")]
