"""The Edge's log of the providers' health ([outlier-ejection], [token-ledger]): :class:`HealthLog`,
fed by admission's events through :func:`iop_edge.admission_feed.feed` beside the metrics."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing
from tests.admission.token_pools import A, token_pool, tokens_spec

from iop_admission import Admission, AdmissionEvent, ProviderReport
from iop_edge.admission_feed import feed
from iop_edge.nodes.health_log import HealthLog


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "iop_edge.nodes"]


async def test_a_cut_is_told_once_when_it_begins_and_once_when_it_ends(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A 30-token lease on a budget of 100; the engine reports 0.5 (cut to 80), 0.9 (40: a move
    within the cut, DEBUG), 0.3 (back to 100), 0.9 again (a new cut); every observer of the feed
    sees each event."""
    caplog.set_level(logging.DEBUG, "iop_edge.nodes")
    admission = Admission(token_pool(tokens_spec(100, window=100)))
    log = HealthLog(lambda: admission.config)
    kinds: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(feed, admission, (log.observe, lambda event: kinds.append(event.kind)))
        admission.connect("node-a")
        async with admission.lease("m", tokens=30):
            for kv_use in (0.5, 0.9, 0.3, 0.9):
                admission.report_health(A, ProviderReport("ready", kv_use=kv_use))
                await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert _lines(caplog) == [
        (
            "WARNING",
            f"provider {A}: token budget cut to 80 of 100 tokens by the engine's report "
            "(its cache holds more than was reserved, or it preempted)",
        ),
        ("DEBUG", f"provider {A}: token budget 40 of 100 tokens (lowered)"),
        ("INFO", f"provider {A}: token budget back to 100 tokens (the engine reports no pressure)"),
        (
            "WARNING",
            f"provider {A}: token budget cut to 40 of 100 tokens by the engine's report "
            "(its cache holds more than was reserved, or it preempted)",
        ),
    ]
    assert kinds.count("budget_changed") == 4 and "granted" in kinds and "released" in kinds


def test_an_ejection_and_a_restoration_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "iop_edge.nodes")
    admission = Admission(token_pool(tokens_spec()))
    log = HealthLog(lambda: admission.config)
    log.observe(AdmissionEvent("ejected", 1.0, provider=A, node_id=A.node_id, duration=30.0, failures=5))
    log.observe(AdmissionEvent("granted", 2.0, model="m", provider=A))
    log.observe(AdmissionEvent("restored", 31.0, provider=A, node_id=A.node_id))
    assert _lines(caplog) == [
        ("WARNING", f"provider {A} ejected for 30.0 s after 5 consecutive failures"),
        ("INFO", f"provider {A} restored"),
    ]


def test_a_provider_gone_from_the_config_ends_its_cut_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """A refresh removed the provider while cut: its next move is no cut (no configured budget), so
    the log says the budget is back, once, rather than failing."""
    caplog.set_level(logging.INFO, "iop_edge.nodes")
    config = token_pool(tokens_spec(100))
    log = HealthLog(lambda: config)
    log.observe(AdmissionEvent("budget_changed", 1.0, provider=A, reason="lowered", token_budget=50))
    config = token_pool()
    log.observe(AdmissionEvent("budget_changed", 2.0, provider=A, reason="raised", token_budget=100))
    log.observe(AdmissionEvent("budget_changed", 3.0, provider=A, reason="raised", token_budget=100))
    assert [level for level, _ in _lines(caplog)] == ["WARNING", "INFO"]
