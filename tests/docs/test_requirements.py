"""``docs/requirements.md`` and the ``req("id")`` markers agree.

The checks read the test files' source (not the collected session), so they
hold whichever subset of the suite is run:

- every marker names an id the document lists;
- every id marked *implemented* has at least one marked test, and its
  ``Tests:`` line names exactly the files holding those markers;
- an id a test's docstring names in brackets is on that test's markers;
- the files the document links as contracts exist;
- nothing in the repository points at a file outside it.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "docs" / "requirements.md"
HEADING = re.compile(r"^### `(?P<id>[a-z0-9]+(?:-[a-z0-9]+)*)` — (?P<status>implemented|planned)$", re.M)
BRACKETED = re.compile(r"\[([a-z0-9]+(?:-[a-z0-9]+)+)\]")


@attrs.frozen
class Requirement:
    id: str
    status: str
    text: str


def requirements() -> dict[str, Requirement]:
    """Every ``### `id` — status`` section of docs/requirements.md."""
    text = REQUIREMENTS.read_text(encoding="utf-8")
    found: dict[str, Requirement] = {}
    heads = list(HEADING.finditer(text))
    for head, after in zip(heads, [*heads[1:], None], strict=True):
        body = text[head.end() : after.start() if after else len(text)]
        assert head["id"] not in found, f"{head['id']} is listed twice"
        found[head["id"]] = Requirement(head["id"], head["status"], body)
    return found


def _marker_ids(node: ast.expr) -> Iterator[str]:
    """The ids of every ``pytest.mark.req(...)`` call inside ``node``."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.mark.req":
            for arg in call.args:
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), ast.unparse(call)
                yield arg.value


def _test_files() -> list[Path]:
    return sorted((ROOT / "tests").rglob("test_*.py"))


@functools.cache
def marked_files() -> dict[str, set[str]]:
    """id -> the test files (relative to the repo) with a marker naming it."""
    where: dict[str, set[str]] = defaultdict(set)
    for path in _test_files():
        for req_id in _marker_ids(ast.parse(path.read_text(encoding="utf-8"))):
            where[req_id].add(path.relative_to(ROOT).as_posix())
    return where


def _tests_line(req: Requirement) -> set[str]:
    match = re.search(r"^Tests: (.*)$", req.text, re.M)
    assert match, f"{req.id}: no 'Tests:' line"
    return set(re.findall(r"`([^`]+)`", match[1]))


def test_requirements_document_lists_ids() -> None:
    reqs = requirements()
    assert len(reqs) >= 16
    assert {r.status for r in reqs.values()} <= {"implemented", "planned"}


def test_every_marker_names_a_listed_id() -> None:
    known = requirements()
    unknown = {req_id: sorted(files) for req_id, files in marked_files().items() if req_id not in known}
    assert not unknown, f"markers name ids missing from docs/requirements.md: {unknown}"


@pytest.mark.parametrize("req", [r for r in requirements().values() if r.status == "implemented"], ids=lambda r: r.id)
def test_implemented_id_has_marked_tests_listed_in_the_document(req: Requirement) -> None:
    files = marked_files().get(req.id, set())
    assert files, f"[{req.id}] is implemented but no test is marked req({req.id!r})"
    listed = _tests_line(req)
    expected = "Tests: " + ", ".join(f"`{f}`" for f in sorted(files))
    assert listed == files, f"docs/requirements.md, [{req.id}]: the Tests line should read\n{expected}"


def _decorated_ids(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> set[str]:
    return {req_id for decorator in node.decorator_list for req_id in _marker_ids(decorator)}


def _module_ids(tree: ast.Module) -> set[str]:
    ids: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(ast.unparse(t) == "pytestmark" for t in stmt.targets):
            ids.update(_marker_ids(stmt.value))
    return ids


def _docstring_gaps(tree: ast.Module, known: set[str]) -> Iterator[str]:
    module_ids = _module_ids(tree)
    scopes: list[tuple[ast.AST, set[str]]] = [(tree, module_ids)]
    while scopes:
        parent, inherited = scopes.pop()
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, ast.ClassDef):
                scopes.append((node, inherited | _decorated_ids(node)))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                named = set(BRACKETED.findall(ast.get_docstring(node) or "")) & known
                missing = named - inherited - _decorated_ids(node)
                if missing:
                    yield f"{node.name} (line {node.lineno}): {sorted(missing)}"


def test_ids_named_in_test_docstrings_are_marked() -> None:
    known = set(requirements())
    gaps = {
        path.relative_to(ROOT).as_posix(): list(_docstring_gaps(ast.parse(path.read_text(encoding="utf-8")), known))
        for path in _test_files()
    }
    gaps = {path: found for path, found in gaps.items() if found}
    assert not gaps, f"docstrings name ids their test is not marked with (add pytest.mark.req): {gaps}"


def test_contract_links_exist() -> None:
    for req in requirements().values():
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", req.text):
            assert (REQUIREMENTS.parent / link).exists(), f"[{req.id}] links to a missing file: {link}"


def _repository_texts() -> Iterator[Path]:
    yield from (ROOT / name for name in ("README.md", "Makefile", "pyproject.toml", "daemons/pyproject.toml"))
    for folder in ("src", "tests", "docs", "benchmarks", "deploy"):
        for path in sorted((ROOT / folder).rglob("*")):
            if (
                path.suffix in {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".json", ".service"}
                and ".peers" not in path.parts
            ):
                yield path


def test_nothing_refers_to_files_outside_the_repository() -> None:
    """Contracts live in docs/: no file may point at SPEC.md, DESIGN.md or a shared folder beside the repo."""
    outside = re.compile(r"\b(?:SPEC|DESIGN|CONVENTIONS)\.md\b|\.\./shared\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in _repository_texts()
        if path != Path(__file__)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if outside.search(line)
    ]
    assert not offenders, offenders
