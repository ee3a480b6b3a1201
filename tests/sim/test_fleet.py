"""The fleet profile of the simulation in CI: a mass drop and reconnect. [reconnect-storm]

The long profile (1,000 nodes, 3 waves, 3 seeds) runs in ``make soak``:
``python -m tests.sim --fleet 1000 --waves 3 --seeds 3``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from ._fleet import SPREAD_LIMIT, run_fleet


@pytest.fixture(autouse=True)
def quiet_daemons() -> Iterator[None]:
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.req("reconnect-storm")
def test_fleet_comes_back_after_a_mass_drop() -> None:
    """[reconnect-storm] 300 nodes, every wire cut at once: all re-register in a new generation,
    admission shows every provider available and idle, and the dials are spread."""
    result = run_fleet(nodes=300, waves=1, seed=1)
    assert result.violations == []
    assert result.registrations == 600
    assert result.busiest_window <= SPREAD_LIMIT


@pytest.mark.req("reconnect-storm")
def test_the_checker_sees_an_unspread_storm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity: with no first-attempt spread (the old policy), the reconnects bunch up
    within 100 ms of the drop and the check reports it."""
    from iop_node.edges import client as _client

    monkeypatch.setattr(_client, "first_delay", lambda policy, rng: 0.0)
    result = run_fleet(nodes=100, waves=1, seed=1)
    assert any("reconnects in one 100 ms window" in v for v in result.violations), result.violations
