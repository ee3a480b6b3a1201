"""The seeded simulation's leader paused past its TTL with retries in flight (tests/sim/_pause.py),
judged by the checker of ``make chaos``: every request executed at most once, no provider past its
capacity at any instant. [ha-step-down] [epoch-fencing] [failover-before-first-byte]
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

import pytest

from iop_admission import Admission, Lease, LeaseRevoked
from iop_edge.api import failover, rejections, relay, run_failure
from iop_edge.api.failover import AttemptFailed

from ._pause import run_pause_seed
from ._report import run_and_summarize

SEEDS = range(16)
"""About 0.5 s each; the pause with retries in flight fires in 13 of them, 22 times in all."""


@pytest.fixture(autouse=True)
def quiet_daemons() -> Iterator[None]:
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.req("ha-step-down", "epoch-fencing", "failover-before-first-byte")
def test_a_leader_paused_with_retries_in_flight_runs_nothing_twice() -> None:
    """[ha-step-down] [epoch-fencing] 16 seeds: the leader stopped past its TTL while it holds
    retries (a backend down under it), with the HA sites, connection cuts and graceful closes beside:
    no request executed twice at a backend, no provider past its capacity, and every invariant of
    the HA world; the fault fired with retries in flight."""
    summary = run_and_summarize(SEEDS, run=run_pause_seed)
    failed = [(r.seed, r.violations[:5]) for r in summary.failed_seeds]
    assert not failed, f"seeds with violations: {failed}"
    assert summary.fired["leader_pause_retrying"] > 0
    assert summary.fired["retries in flight at a pause"] >= summary.fired["leader_pause_retrying"]
    assert summary.fired["executions"] > 0


async def _attempt_retrying_a_revoked_lease(
    admission: Admission,
    request: tuple[str, bool, str | None, float, int | None],
    previous: Lease | None,
    last: AttemptFailed | None,
    attempt: failover.Callable[[Lease], failover.Awaitable[str]],
) -> str:
    """The attempt before issue 38's fix: a lease revoked under its attempt was retried elsewhere."""
    model, long, tenant, cost, tokens = request
    scope = (
        admission.lease(model, long=long, tenant=tenant, cost=cost, tokens=tokens)
        if previous is None or last is None
        else admission.retry(previous, reason=last.reason)
    )
    held: Lease | None = None
    try:
        async with scope as lease:
            held = lease
            return await attempt(lease)
    except LeaseRevoked as exc:
        if held is None:
            raise
        fenced = AttemptFailed(exc, "node_disconnected", provider_failure=True)
        fenced.lease = held
        raise fenced from None
    except AttemptFailed as failed:
        failed.lease = held
        raise


SENSITIVE_SEEDS = (55, 94, *range(200, 500))
"""Seeds that show the double with the old retry: 55 and 94 do on a quiet box (2 of the first 120
seeds); the world's Edge hands work to threads, so on a loaded box a seed's schedule may differ,
and the search goes on through more seeds until one shows it (bounded)."""


def test_the_checker_sees_a_run_retried_after_its_node_was_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity: with the Edge failing over a run whose node connection was cut under it (as it did
    before issue 38: the lease revoked, or the run's channel closed), the checker reports a request
    executed twice in some seed (a cut while a request ran on one candidate, its retry ran on the other)."""
    monkeypatch.setattr(failover, "_attempt_once", _attempt_retrying_a_revoked_lease)
    for module in (relay, run_failure):
        monkeypatch.setattr(module, "node_disconnected", functools.partial(rejections.node_disconnected, sent=False))
    seen = next(
        (seed for seed in SENSITIVE_SEEDS if any("executed 2 times" in v for v in run_pause_seed(seed).violations)),
        None,
    )
    assert seen is not None, f"no seed of {len(SENSITIVE_SEEDS)} showed the double execution"
