"""No package in ``src/`` imports another package's private modules.

Whatever ``iop_edge`` needs from ``iop_admission`` is public API (exported by
the package, documented), never ``iop_admission._x``. Read from the source
text, so it holds for code paths no test happens to import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


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
            if top.startswith("iop_") and top != package and any(part.startswith("_") for part in rest):
                yield node.lineno, name


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
        "from iop_edge._links import NodeLink\n"
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
