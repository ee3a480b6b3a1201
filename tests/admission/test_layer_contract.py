"""The lease contract, run against both layers: trio (``Admission``) and asyncio
(``AsyncAdmission``), each on the public core.

Each test is a scenario written once against :class:`Layer`, a thin harness
that runs it under ``trio.run`` (``MockClock(autojump_threshold=0)``: virtual
time) or ``asyncio.run`` (real time, with timeouts of a few hundredths of a
second; no test asserts on elapsed time). ``settle()`` lets every other task
run until blocked: trio's ``wait_all_tasks_blocked``, asyncio's round of
``sleep(0)`` steps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import attrs
import pytest
import trio
import trio.testing

from iop_admission import (
    Admission,
    LeaseRevoked,
    LeaseScopeError,
    OutlierPolicy,
    PoolConfig,
    QueuePolicy,
    QueueTimeout,
    RetryPolicy,
    Unavailable,
)
from iop_admission.aio import AsyncAdmission


class Handle(Protocol):
    outcome: str | None

    def cancel(self) -> None: ...


class Layer(Protocol):
    name: str

    def admission(self, config: PoolConfig) -> Any: ...

    async def settle(self) -> None: ...

    async def sleep(self, seconds: float) -> None: ...

    def tasks(self) -> contextlib.AbstractAsyncContextManager[Callable[[Callable[[], Awaitable[object]]], Handle]]: ...

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None: ...


@attrs.define
class _Handle:
    outcome: str | None = None
    _cancel: Callable[[], None] | None = None

    def cancel(self) -> None:
        assert self._cancel is not None
        self._cancel()


def _record(handle: _Handle, exc: BaseException | None) -> None:
    handle.outcome = "ok" if exc is None else type(exc).__name__


class TrioLayer:
    name = "trio"

    def admission(self, config: PoolConfig) -> Admission:
        return Admission(config)

    async def settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked()

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    @contextlib.asynccontextmanager
    async def tasks(self) -> AsyncIterator[Callable[[Callable[[], Awaitable[object]]], Handle]]:
        async with trio.open_nursery() as nursery:

            def spawn(fn: Callable[[], Awaitable[object]]) -> Handle:
                scope = trio.CancelScope()
                handle = _Handle(None, scope.cancel)

                async def body() -> None:
                    with scope:
                        try:
                            await fn()
                        except Exception as exc:
                            _record(handle, exc)
                            return
                        except trio.Cancelled:
                            handle.outcome = "cancelled"
                            raise
                        _record(handle, None)

                nursery.start_soon(body)
                return handle

            yield spawn

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None:
        trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


class AsyncioLayer:
    name = "asyncio"

    def admission(self, config: PoolConfig) -> AsyncAdmission:
        return AsyncAdmission(config)

    async def settle(self) -> None:
        for _ in range(50):
            await asyncio.sleep(0)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds / 100)  # scenarios' seconds are hundredths here

    @contextlib.asynccontextmanager
    async def tasks(self) -> AsyncIterator[Callable[[Callable[[], Awaitable[object]]], Handle]]:
        async with asyncio.TaskGroup() as group:

            def spawn(fn: Callable[[], Awaitable[object]]) -> Handle:
                handle = _Handle()

                async def body() -> None:
                    try:
                        await fn()
                    except Exception as exc:
                        _record(handle, exc)
                        return
                    except asyncio.CancelledError:
                        handle.outcome = "cancelled"
                        return
                    _record(handle, None)

                task = group.create_task(body())
                handle._cancel = task.cancel
                return handle

            yield spawn

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None:
        asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.fixture(params=[TrioLayer(), AsyncioLayer()], ids=lambda layer: layer.name)
def layer(request: pytest.FixtureRequest) -> Layer:
    return request.param  # type: ignore[no-any-return]


def _timeout(layer: Layer, seconds: float) -> float:
    return seconds / 100 if layer.name == "asyncio" else seconds


def _in_flight(admission: Any) -> int:
    return sum(p.in_flight for p in admission.snapshot().providers)


def _drained(admission: Any) -> None:
    assert admission.queue_depth == 0
    assert _in_flight(admission) == 0


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
        admission = layer.admission(pool.shared(queue_timeout=_timeout(layer, 1)))
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
        admission = layer.admission(pool.shared(queue_timeout=_timeout(layer, 2)))
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
        admission = layer.admission(pool.shared(max_queue=1, queue_timeout=_timeout(layer, 1)))
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
        ejection = _timeout(layer, 1.0)
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
