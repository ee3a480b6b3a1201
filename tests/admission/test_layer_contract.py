"""The lease contract, run against both layers: trio (``Admission``) and asyncio
(``AsyncAdmission``), each on the public core.

Each test is a scenario written once against :class:`~tests.admission.layers.Layer`
and run on both layers, on virtual time (the ``layer`` fixture).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from tests.admission.layers import Layer, books_closed

from iop_admission import (
    LeaseRevoked,
    LeaseScopeError,
    OutlierPolicy,
    QueuePolicy,
    QueueTimeout,
    RetryPolicy,
    Unavailable,
)


def _in_flight(admission: Any) -> int:
    return sum(p.in_flight for p in admission.snapshot().providers)


def _drained(admission: Any) -> None:
    books_closed(admission)


def test_lease_released_on_every_exit_path(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")
        async with admission.lease(pool.big) as lease:
            assert lease.provider == pool.gpu0
            assert _in_flight(admission) == 1
        with pytest.raises(ZeroDivisionError):
            async with admission.lease(pool.big):
                1 / 0  # noqa: B018
        _drained(admission)

    layer.run(scenario)


def test_nothing_is_eligible_before_connect(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        with pytest.raises(Unavailable):
            async with admission.lease(pool.big):
                pass
        admission.connect("node-a")
        async with admission.lease(pool.big):
            pass
        _drained(admission)

    layer.run(scenario)


def test_hand_off_in_arrival_order(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")
        order: list[int] = []

        async def job(n: int) -> None:
            async with admission.lease(pool.big):
                order.append(n)
                await layer.sleep(1)

        async with layer.tasks() as spawn:
            for n in range(5):
                spawn(lambda n=n: job(n))
                await layer.settle()
        assert order == [0, 1, 2, 3, 4]
        _drained(admission)

    layer.run(scenario)


def test_cancel_while_queued_withdraws(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")
        async with layer.tasks() as spawn:
            async with admission.lease(pool.big):
                waiter = spawn(lambda: admission.lease(pool.big).__aenter__())
                await layer.settle()
                assert admission.queue_depth == 1
                waiter.cancel()
                await layer.settle()
                assert admission.queue_depth == 0
        assert waiter.outcome == "cancelled"
        _drained(admission)

    layer.run(scenario)


@pytest.mark.parametrize("first", ["cancel", "grant"])
def test_grant_versus_cancel_never_leaks(layer: Layer, pool: Any, first: str) -> None:
    """The waiter's cancellation and its grant in the same step, either order."""

    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")
        ran: list[bool] = []

        async def wait_and_run() -> None:
            async with admission.lease(pool.big):
                ran.append(True)
                await layer.sleep(1)

        async with layer.tasks() as spawn:
            holder = admission.lease(pool.big)
            await holder.__aenter__()
            waiter = spawn(wait_and_run)
            await layer.settle()
            if first == "cancel":
                waiter.cancel()
                await holder.__aexit__(None, None, None)
            else:
                await holder.__aexit__(None, None, None)
                waiter.cancel()
        assert waiter.outcome == "cancelled"
        _drained(admission)

    layer.run(scenario)


def test_cancelled_before_first_step_after_immediate_grant(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")

        async def take() -> None:
            async with admission.lease(pool.big):
                await layer.sleep(1)

        async with layer.tasks() as spawn:
            spawn(take).cancel()
        _drained(admission)
        async with admission.lease(pool.big):
            pass

    layer.run(scenario)


def test_revoke_during_the_body_raises_lease_revoked(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        generation = admission.connect("node-a")

        async def body() -> None:
            async with admission.lease(pool.big):
                await layer.sleep(100)

        async with layer.tasks() as spawn:
            holder = spawn(body)
            await layer.settle()
            assert admission.disconnect("node-a", generation)
        assert holder.outcome == "LeaseRevoked"
        _drained(admission)

    layer.run(scenario)


def test_revoke_of_a_body_that_does_not_await_again(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        generation = admission.connect("node-a")
        with pytest.raises(LeaseRevoked):
            async with admission.lease(pool.big):
                admission.disconnect("node-a", generation)
        await layer.sleep(0.1)  # no cancellation left pending on this task
        _drained(admission)

    layer.run(scenario)


def test_queue_timeout(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared(queue_timeout=1))
        admission.connect("node-a")
        async with layer.tasks() as spawn:
            async with admission.lease(pool.big):
                waiter = spawn(lambda: admission.lease(pool.big).__aenter__())
                await layer.sleep(3)
        assert waiter.outcome == "QueueTimeout"
        _drained(admission)

    layer.run(scenario)


def test_refresh_re_arms_queue_deadlines(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared(queue_timeout=2))
        admission.connect("node-a")

        async def wait_and_run() -> None:
            async with admission.lease(pool.big):
                pass

        async with layer.tasks() as spawn:
            async with admission.lease(pool.big):
                waiter = spawn(wait_and_run)
                await layer.settle()
                admission.refresh(attrs.evolve(admission.config, policy=QueuePolicy(queue_timeout=1000.0)))
                await layer.sleep(4)  # past the old deadline
                assert admission.queue_depth == 1
        assert waiter.outcome == "ok"
        _drained(admission)

    layer.run(scenario)


def test_scope_misuse_raises_lease_scope_error(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")
        scope = admission.lease(pool.big)
        with pytest.raises(LeaseScopeError):
            await scope.__aexit__(None, None, None)
        await scope.__aenter__()
        with pytest.raises(LeaseScopeError):
            await scope.__aenter__()
        await scope.__aexit__(None, None, None)
        with pytest.raises(LeaseScopeError):
            await scope.__aexit__(None, None, None)
        _drained(admission)

    layer.run(scenario)


def test_queue_timeout_error_names_the_model(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared(max_queue=1, queue_timeout=1))
        admission.connect("node-a")
        async with admission.lease(pool.big):
            with pytest.raises(QueueTimeout, match=pool.big):
                async with admission.lease(pool.big):
                    pass
        _drained(admission)

    layer.run(scenario)


def test_subscription_is_an_async_iterator_of_lifecycle_events(layer: Layer, pool: Any) -> None:
    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        async with admission.subscribe() as events:
            generation = admission.connect("node-a")
            async with admission.lease(pool.big) as lease:
                pass
            admission.disconnect("node-a", generation)
            kinds = [(await events.__anext__()).kind for _ in range(4)]
        assert kinds == ["connected", "granted", "released", "disconnected"]
        assert lease.released
        _drained(admission)

    layer.run(scenario)


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
def test_failure_ejects_the_retry_goes_elsewhere_and_the_probe_comes_when_due(layer: Layer, pool: Any) -> None:
    """Both layers: a failure report ejects gpu0; the retry goes to gpu1 (attempt 2, gpu0 tried)
    and a new request too; once the ejection time has passed the next request is gpu0's probe,
    and its success brings gpu0 back."""

    async def scenario() -> None:
        ejection = 1.0
        config = attrs.evolve(pool.two_nodes(), outlier=OutlierPolicy(1, ejection, ejection), retry=RetryPolicy(2))
        admission = layer.admission(config)
        admission.connect("node-a")
        admission.connect("node-b")
        async with admission.lease(pool.big) as first:
            assert first.provider == pool.gpu0
            admission.report_failure(first)
        async with admission.retry(first) as second:
            assert (second.provider, second.attempt, second.tried) == (pool.gpu1, 2, (pool.gpu0, pool.gpu1))
            admission.report_success(second)
        async with admission.lease(pool.big) as during:
            assert during.provider == pool.gpu1 and not during.probe
        await layer.sleep(2.0)
        async with admission.lease(pool.big) as probe:
            assert probe.provider == pool.gpu0 and probe.probe
            admission.report_success(probe)
        [gpu0] = [p for p in admission.snapshot().providers if p.provider_id == pool.gpu0.provider_id]
        assert (gpu0.health, gpu0.failures) == ("online", 0)
        _drained(admission)

    layer.run(scenario)


@pytest.mark.req("held-elsewhere")
def test_runs_held_elsewhere_hold_the_provider_until_lowered(layer: Layer, pool: Any) -> None:
    """[held-elsewhere] both layers: a capacity-1 provider held elsewhere makes a lease wait; lowering
    the count grants it at once."""

    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")
        admission.hold(pool.gpu0, 1)
        granted: list[int] = []

        async def job() -> None:
            async with admission.lease(pool.big):
                granted.append(_in_flight(admission))

        async with layer.tasks() as spawn:
            spawn(job)
            await layer.settle()
            assert granted == [] and admission.queue_depth == 1
            admission.hold(pool.gpu0, 0)
            await layer.settle()
        assert granted == [1]
        _drained(admission)

    layer.run(scenario)
