"""The console commands' entry points: each starts its daemon, or says in one
line what to install when the ``daemons`` extra is missing.

``pip install iop-admission`` installs the library (trio and attrs only); the
Edge, the Node, the mock backend, the status CLI and the stack launcher need
``pip install "iop-admission[daemons]"``. This module imports only the standard
library until it knows the extra is there.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable

# What the daemons import beyond the library (the import names of the `daemons` extra).
DAEMON_MODULES = (
    "cattrs",
    "trio_websocket",
    "wsproto",
    "ruamel.yaml",
    "h11",
    "httpx",
    "httptools",
    "prometheus_client",
    "orjson",
    "rich",
)


def missing_modules() -> list[str]:
    """The daemons' modules that cannot be imported here."""
    missing = []
    for name in DAEMON_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a dotted name whose parent is absent
            found = False
        if not found:
            missing.append(name)
    return missing


def _start(command: str, module: str, attribute: str) -> None:
    missing = missing_modules()
    if missing:
        sys.exit(
            f"{command}: the daemons extra is not installed (missing {', '.join(missing)}); "
            f'run: pip install "iop-admission[daemons]"'
        )
    main: Callable[[], None] = getattr(importlib.import_module(module), attribute)
    main()


def edge() -> None:
    """``iop-edge``."""
    _start("iop-edge", "iop_edge.__main__", "main")


def node() -> None:
    """``iop-node``."""
    _start("iop-node", "iop_node.__main__", "main")


def mock_backend() -> None:
    """``iop-mock-backend``."""
    _start("iop-mock-backend", "iop_mock.cli", "main")


def status() -> None:
    """``iop``, the status CLI."""
    _start("iop", "iop_edge.status_cli", "main")


def stack() -> None:
    """``iop-stack``."""
    _start("iop-stack", "iop_stack", "main")
