"""Suite-wide settings: Hypothesis profiles and ``--req ID``.

``ci`` runs in ``make test``; ``soak`` (``HYPOTHESIS_PROFILE=soak``, ``make soak``)
runs ten times longer. Stateful tests set their own step counts per profile
through :data:`STATEFUL`.

``pytest --req ID`` (repeatable) runs only the tests marked ``req("ID")``, the
tests that prove requirement ``ID`` of ``docs/requirements.md``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--req", action="append", default=[], metavar="ID", help="run only tests marked req(ID)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("--req"))
    if not wanted:
        return
    selected, deselected = [], []
    for item in items:
        ids = {req_id for marker in item.iter_markers("req") for req_id in marker.args}
        (selected if ids & wanted else deselected).append(item)
    config.hook.pytest_deselected(items=deselected)
    items[:] = selected


settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "soak",
    max_examples=1_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
