"""Suite-wide settings: Hypothesis profiles and ``--req ID``.

``ci`` runs in ``make test``; ``soak`` (``HYPOTHESIS_PROFILE=soak``, ``make soak``)
runs ten times longer. Stateful tests set their own step counts per profile
through ``HYPOTHESIS_PROFILE``. ``mutate`` (``make mutate``, docs/reliability.md) is for
mutation runs: a fixed seed (every run of a mutant gives the same verdict), no
shrinking (a failing example only has to fail, not be explained), no example
database; and the tests run example tests first, Hypothesis tests last, so that
the ``-x`` of a mutation run stops at the cheapest test that kills the mutant.

``pytest --req ID`` (repeatable) runs only the tests marked ``req("ID")``, the
tests that prove requirement ``ID`` of ``docs/requirements.md``.
"""

from __future__ import annotations

import os

import pytest
import trio
from hypothesis import HealthCheck, Phase, settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


class LoopTurns:
    """Counts the event loop's turns: a task that checkpoints forever, one step per turn it gets."""

    def __init__(self) -> None:
        self.count = 0

    async def run(self) -> None:
        while True:
            self.count += 1
            await trio.lowlevel.checkpoint()


@pytest.fixture
async def loop_turns(nursery: trio.Nursery) -> LoopTurns:
    """The loop's turns from now on (work run with ``iop_io.run_in_turns`` gives one per ``yield_to_loop``)."""
    turns = LoopTurns()
    nursery.start_soon(turns.run)
    return turns


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--req", action="append", default=[], metavar="ID", help="run only tests marked req(ID)")


def _is_hypothesis(item: pytest.Item) -> bool:
    return bool(getattr(getattr(item, "obj", None), "is_hypothesis_test", False))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PROFILE == "mutate":
        items.sort(key=_is_hypothesis)  # stable: example tests keep their order, then the Hypothesis ones
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
settings.register_profile(
    "mutate",
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(PROFILE)
