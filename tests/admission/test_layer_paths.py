"""The layers' rarer paths, on both layers where both have them (the ``layer`` fixture), else on the
one that has them: a grant fenced before its task resumed, several decisions carried out at once,
shedding for a higher band, a revoked body that does not await again, a revocation beside an outside
cancellation, a waiter failed and cancelled in the same step, misuse of a lease scope, and the trio
layer's readings at the current time. After each, nothing is left in the layer's own books.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import trio
import trio.testing
from tests.admission.layers import AsyncioLayer, Layer, VirtualTimeLoop, books_closed
from tests.admission.layers import books_closed as _books_closed

from iop_admission import (
    Admission,
    AdmissionEvent,
    LeaseRevoked,
    LeaseScopeError,
    ModelGroup,
    ModelNotFound,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    TenantLimitExceeded,
    TenantSpec,
)
from iop_admission.aio import AsyncAdmission

GPU0 = ProviderKey("node-a", "gpu0")
BIG, FAST = "ornith:35b", "ornith-fast"


def _config(*, tenants: tuple[TenantSpec, ...] = (), max_queue: int = 8) -> PoolConfig:
    spec = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    return PoolConfig(
        policy=QueuePolicy(max_queue=max_queue, queue_timeout=30.0),
        providers={GPU0: spec},
        models={BIG: ModelGroup(candidates=(GPU0,)), FAST: ModelGroup(candidates=(GPU0,))},
        outlier=OutlierPolicy(consecutive_failures=1, base_ejection=5.0, max_ejection=10.0),
        tenants=tenants,
    )


def test_a_grant_fenced_before_its_task_resumes_raises_lease_revoked(layer: Layer) -> None:
    """The waiter is granted (a held run elsewhere ends) and its node fenced in the same step: its task
    gets ``LeaseRevoked`` naming the lease, node and generation, and the body never runs."""
    errors: list[BaseException] = []
    ran: list[bool] = []

    async def scenario() -> None:
        admission = layer.admission(_config())
        generation = admission.connect("node-a")
        admission.hold(GPU0, 1)

        async def wait() -> None:
            try:
                async with admission.lease(BIG):
                    ran.append(True)
            except LeaseRevoked as exc:
                errors.append(exc)

        async with layer.tasks() as spawn:
            spawn(wait)
            await layer.settle()
            admission.hold(GPU0, 0)  # granted: the task is rescheduled, not resumed yet
            assert admission.disconnect("node-a", generation)
        assert ran == []
        assert [(e.lease_id, e.node_id, e.generation, str(e)) for e in errors] == [
            (1, "node-a", 1, "lease 1 revoked: node 'node-a' generation 1 was fenced")
        ]
        _books_closed(admission)

    layer.run(scenario)


def test_a_refresh_that_fails_two_waiters_fails_both(layer: Layer) -> None:
    """Several decisions at once (two waiters of a removed model): each one is carried out."""
    outcomes: list[str] = []

    async def scenario() -> None:
        admission = layer.admission(_config())
        admission.connect("node-a")

        async def wait() -> None:
            try:
                async with admission.lease(BIG):
                    pass
            except ModelNotFound as exc:
                outcomes.append(str(exc))

        async with layer.tasks() as spawn:
            holder = admission.lease(FAST)
            await holder.__aenter__()
            spawn(wait)
            spawn(wait)
            await layer.settle()
            config = admission.config
            admission.refresh(PoolConfig(config.policy, config.providers, {FAST: config.models[FAST]}))
            await layer.settle()
            await holder.__aexit__(None, None, None)
        assert outcomes == ["model 'ornith:35b' is not configured"] * 2
        _books_closed(admission)

    layer.run(scenario)


def test_a_higher_band_sheds_the_lower_waiter_of_a_full_queue(layer: Layer) -> None:
    """A full queue, a waiter of a negative band, a newcomer above it: the waiter is
    shed (``TenantLimitExceeded`` with ``shed``) and its ``rejected`` event names its tenant."""
    errors: list[TenantLimitExceeded] = []
    events: list[AdmissionEvent] = []

    async def scenario() -> None:
        tenants = (TenantSpec("low", priority=-1), TenantSpec("high"))
        admission = layer.admission(_config(tenants=tenants, max_queue=1))
        admission.connect("node-a")

        async def wait(tenant: str) -> None:
            try:
                async with admission.lease(BIG, tenant=tenant):
                    pass
            except TenantLimitExceeded as exc:
                errors.append(exc)

        async with admission.subscribe() as stream, layer.tasks() as spawn:

            async def collect() -> None:
                async for event in stream:
                    events.append(event)

            collector = spawn(collect)
            holder = admission.lease(FAST, tenant="high")
            await holder.__aenter__()
            spawn(lambda: wait("low"))
            await layer.settle()
            spawn(lambda: wait("high"))
            await layer.settle()
            await holder.__aexit__(None, None, None)
            await layer.settle()
            collector.cancel()
        assert [(e.tenant, e.limit) for e in errors] == [("low", "shed")]
        rejected = [e for e in events if e.kind == "rejected"]
        assert rejected == [AdmissionEvent("rejected", 0.0, model=BIG, reason="TenantLimitExceeded", tenant="low")]
        _books_closed(admission)

    layer.run(scenario)


def test_a_later_waiters_wait_and_a_long_leases_events(layer: Layer) -> None:
    """A waiter queued at t=1 and granted at t=3 waited 2 s (its lease and its ``granted`` event say
    so); a long lease's events say it is long; a pool without tenants names no tenant."""
    events: list[AdmissionEvent] = []
    waits: list[float] = []

    async def scenario() -> None:
        admission = layer.admission(_config())
        admission.connect("node-a")

        async def wait() -> None:
            async with admission.lease(BIG, long=True) as lease:
                waits.append(lease.queue_wait)

        async with admission.subscribe() as stream, layer.tasks() as spawn:

            async def collect() -> None:
                async for event in stream:
                    events.append(event)

            collector = spawn(collect)
            holder = admission.lease(FAST)
            await holder.__aenter__()
            await layer.sleep(1.0)
            spawn(wait)
            await layer.sleep(2.0)
            await holder.__aexit__(None, None, None)
            await layer.settle()
            with pytest.raises(ModelNotFound):
                async with admission.lease("ornith:7b", long=True):
                    pass
            await layer.settle()
            collector.cancel()
        assert waits == [2.0]
        assert events[-1] == AdmissionEvent("rejected", 3.0, model="ornith:7b", long=True, reason="ModelNotFound")
        lease = {"model": BIG, "provider": GPU0, "lease_id": 2, "generation": 1, "node_id": "node-a", "long": True}
        assert [e for e in events if e.model == BIG] == [
            AdmissionEvent("queued", 1.0, model=BIG, long=True),
            AdmissionEvent("granted", 3.0, waited=2.0, **lease),
            AdmissionEvent("released", 3.0, **lease),
        ]
        _books_closed(admission)

    layer.run(scenario)


def test_a_revoked_body_that_does_not_await_again_costs_no_time(layer: Layer) -> None:
    """The body ends right after its node is fenced: ``LeaseRevoked`` at once (the pending
    cancellation taken without waiting), nothing left to cancel the task later."""

    async def scenario() -> None:
        admission = layer.admission(_config())
        generation = admission.connect("node-a")
        before = trio.current_time() if layer.name == "trio" else asyncio.get_running_loop().time()
        with pytest.raises(LeaseRevoked):
            async with admission.lease(BIG):
                admission.disconnect("node-a", generation)
        after = trio.current_time() if layer.name == "trio" else asyncio.get_running_loop().time()
        assert after == before
        await layer.sleep(1.0)  # no cancellation left pending on this task
        _books_closed(admission)

    layer.run(scenario)


def test_a_revocation_beside_an_outside_cancellation_ends_cancelled(layer: Layer) -> None:
    """The body's task is cancelled from outside as its node is fenced: the outside cancellation wins
    (the task ends cancelled, not with ``LeaseRevoked``), as a task group or a timeout expects."""

    async def scenario() -> None:
        admission = layer.admission(_config())
        generation = admission.connect("node-a")

        async def body() -> None:
            async with admission.lease(BIG):
                await layer.sleep(100.0)

        async with layer.tasks() as spawn:
            handle = spawn(body)
            await layer.settle()
            handle.cancel()
            admission.disconnect("node-a", generation)
        assert handle.outcome == "cancelled"
        _books_closed(admission)

    layer.run(scenario)


def test_asyncio_a_waiter_failed_then_cancelled_in_one_step_ends_cancelled() -> None:
    """asyncio: the waiter's failure is set, then its task is cancelled before it resumes: the task
    raises ``CancelledError`` (a cancellation is never turned into another error)."""
    layer = AsyncioLayer()

    async def scenario() -> None:
        admission = AsyncAdmission(_config())
        admission.connect("node-a")
        async with layer.tasks() as spawn:
            holder = admission.lease(FAST)
            await holder.__aenter__()
            handle = spawn(lambda: admission.lease(BIG).__aenter__())
            await layer.settle()
            config = admission.config
            admission.refresh(PoolConfig(config.policy, config.providers, {FAST: config.models[FAST]}))
            handle.cancel()
            await layer.settle()
            await holder.__aexit__(None, None, None)
        assert handle.outcome == "cancelled"
        _books_closed(admission)

    layer.run(scenario)


def test_asyncio_a_revoked_body_sees_why_and_its_own_error_stands() -> None:
    """asyncio: the revoked body's task is cancelled with the reason (``lease N revoked``); a body that
    catches that and raises an error of its own gets its own error out of the scope, not ``LeaseRevoked``."""
    seen: list[object] = []
    layer = AsyncioLayer()

    async def scenario() -> None:
        admission = AsyncAdmission(_config())
        generation = admission.connect("node-a")

        async def body() -> None:
            async with admission.lease(BIG):
                try:
                    await asyncio.sleep(100.0)
                except asyncio.CancelledError as exc:
                    seen.append(exc.args)
                    raise ValueError("the body's own") from None

        async with layer.tasks() as spawn:
            handle = spawn(body)
            await layer.settle()
            admission.disconnect("node-a", generation)
        assert (seen, handle.outcome) == ([("lease 1 revoked",)], "ValueError")
        _books_closed(admission)

    layer.run(scenario)


def test_asyncio_a_lease_entered_outside_a_task_is_refused_and_handed_back() -> None:
    """asyncio: entering a lease from a plain callback (no task) is a ``RuntimeError`` that says so,
    and the lease it was granted goes back at once."""
    errors: list[BaseException] = []

    async def scenario() -> None:
        admission = AsyncAdmission(_config())
        admission.connect("node-a")
        loop = asyncio.get_running_loop()

        def drive() -> None:
            entering = admission.lease(BIG).__aenter__()
            try:
                entering.send(None)
            except RuntimeError as exc:
                errors.append(exc)

        loop.call_soon(drive)
        await asyncio.sleep(0)
        assert [str(e) for e in errors] == ["AsyncAdmission.lease() must be entered from an asyncio task"]
        _books_closed(admission)

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        runner.run(scenario())


@pytest.mark.parametrize("layer_name", ["trio", "asyncio"])
def test_misusing_a_lease_scope_says_how(layer_name: str) -> None:
    """Each misuse of a scope is a ``LeaseScopeError`` with its own words: entered twice, exited
    before it was entered, exited twice (and, asyncio, exited while it is still being entered)."""
    messages: list[str] = []

    async def misuse(admission: Any) -> None:
        admission.connect("node-a")
        scope = admission.lease(BIG)
        for step in (scope.__aexit__, None, scope.__aenter__, scope.__aexit__, scope.__aexit__):
            if step is None:
                await scope.__aenter__()
                continue
            try:
                await step(None, None, None) if step == scope.__aexit__ else await step()
            except LeaseScopeError as exc:
                messages.append(str(exc))
        _books_closed(admission)

    if layer_name == "trio":
        trio.run(misuse, Admission(_config()), clock=trio.testing.MockClock(autojump_threshold=0))
        entered_only = "a lease scope can be exited only after it was entered"
        assert messages == [entered_only, "a lease scope can be entered only once", entered_only]
    else:

        async def main() -> None:
            admission = AsyncAdmission(_config())
            await misuse(admission)
            holder = admission.lease(BIG)
            await holder.__aenter__()
            queued = admission.lease(BIG)
            task = asyncio.ensure_future(queued.__aenter__())
            await asyncio.sleep(0)
            try:  # exited from another task while it waits to be entered
                await queued.__aexit__(None, None, None)
            except LeaseScopeError as exc:
                messages.append(str(exc))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await holder.__aexit__(None, None, None)
            _books_closed(admission)

        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            runner.run(main())
        exited = "a lease scope can be exited once, after it was entered (it is {})"
        assert messages == [
            exited.format("new"),
            "a lease scope can be entered only once",
            exited.format("exited"),
            exited.format("entering"),
        ]


def test_trio_readings_count_from_the_current_time_and_in_their_window() -> None:
    """trio: ``snapshot``, ``provider_rows`` and ``waiters`` read at the current time (an ejection's
    time left, a waiter's age), in the window asked for; outside trio, at the latest time seen."""
    two = ProviderKey("node-a", "gpu1")
    spec = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    config = PoolConfig(
        policy=QueuePolicy(queue_timeout=30.0),
        providers={GPU0: spec, two: spec},
        models={BIG: ModelGroup(candidates=(GPU0,)), FAST: ModelGroup(candidates=(two,))},
        outlier=OutlierPolicy(consecutive_failures=1, base_ejection=5.0, max_ejection=10.0),
    )
    admission = Admission(config)
    readings: dict[str, object] = {}

    async def wait() -> None:
        async with admission.lease(FAST):
            pass

    kept: list[Any] = []

    async def main() -> None:
        admission.connect("node-a")
        async with admission.lease(BIG) as failed:
            await trio.sleep(1.0)
            admission.report_failure(failed)  # at t=1: gpu0 ejected until t=6
        async with trio.open_nursery() as nursery, admission.lease(FAST) as holder:
            kept.append(holder)
            nursery.start_soon(wait)
            await trio.sleep(2.0)
            rows = admission.provider_rows(count=1)
            readings["rows"] = [(r["node_id"], r["provider_id"], r["ejection_left"]) for r in rows]
            readings["second_row"] = [r["provider_id"] for r in admission.provider_rows(first=1)]
            readings["ejection_left"] = admission.snapshot().providers[0].ejection_left
            readings["ages"] = [w.age for w in admission.waiters()]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert readings == {
        "rows": [("node-a", "gpu0", 3.0)],
        "second_row": ["gpu1"],
        "ejection_left": 3.0,
        "ages": [2.0],
    }
    # Outside trio, a report counts at the latest time passed to the pool (t=1, the first report).
    admission.report_failure(kept[0])
    gpu1 = admission.snapshot().providers[1]
    assert (gpu1.health, gpu1.ejection_left) == ("ejected", 5.0)


def test_a_cancelled_waiter_is_not_a_rejection(layer: Layer) -> None:
    """A waiter withdrawn by its task's cancellation gives no ``rejected`` event (it was not refused)."""
    events: list[AdmissionEvent] = []

    async def scenario() -> None:
        admission = layer.admission(_config())
        admission.connect("node-a")
        async with admission.subscribe() as stream, layer.tasks() as spawn:

            async def collect() -> None:
                async for event in stream:
                    events.append(event)

            collector = spawn(collect)
            holder = admission.lease(FAST)
            await holder.__aenter__()
            waiter = spawn(lambda: admission.lease(BIG).__aenter__())
            await layer.settle()
            waiter.cancel()
            await layer.settle()
            await holder.__aexit__(None, None, None)
            await layer.settle()
            collector.cancel()
        assert [e.kind for e in events] == ["granted", "queued", "released"]
        _books_closed(admission)

    layer.run(scenario)


def test_trio_a_grant_in_the_tick_its_waiters_deadline_fires_wins() -> None:
    """trio: the waiter is granted, then its queue deadline passes before it resumes (the same
    tick): the grant stands, and its body runs in a fresh scope, not cancelled by that deadline."""
    clock = trio.testing.MockClock()
    ran: list[float] = []

    async def main() -> None:
        admission = Admission(_config())
        admission.connect("node-a")

        async def wait() -> None:
            async with admission.lease(BIG):
                await trio.sleep(1.0)  # the deadline passed: a body cancelled by it would not sleep
                ran.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            async with admission.lease(FAST):
                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                clock.jump(30.0)  # the waiter's queue_timeout; its deadline is processed at the next checkpoint
            # Leaving the block granted the waiter before that checkpoint; from here time may run.
            clock.autojump_threshold = 0
        books_closed(admission)

    trio.run(main, clock=clock)
    assert ran == [31.0]


def test_trio_admission_under_asyncio_says_which_layer_to_use() -> None:
    """``Admission.lease()`` entered under asyncio: a ``RuntimeError`` that names the asyncio layer."""

    async def scenario() -> None:
        admission = Admission(_config())
        admission.connect("node-a")
        with pytest.raises(RuntimeError) as caught:
            async with admission.lease(BIG):
                pass
        assert str(caught.value) == (
            "Admission.lease() runs under trio only; under asyncio use iop_admission.aio.AsyncAdmission"
        )

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        runner.run(scenario())
