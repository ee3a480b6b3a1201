"""Both layers tell the same story: one scenario, run on the trio and the asyncio
layer on virtual time, gives the same lifecycle events (every field, times
included), the same errors (type, arguments and message), the same leases and
the same snapshots.

The scenario goes through every event kind: a node unknown to the config, a
failure that ejects, a retry with its reason, waiters of two tenants, a
tenant's queue limit, a full queue, the probe at the ejection's end and the
restore it brings, a queue timeout, a revocation, a refresh that fails a queued
waiter, the errors of a request for an offline or a removed model, and a
subscriber whose buffer is full. Steps that happen at one virtual instant wake
at most one task, so the order of events is the same on both schedulers.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from tests.admission.layers import AsyncioLayer, Layer, TrioLayer

from iop_admission import (
    AdmissionError,
    AdmissionEvent,
    ModelGroup,
    NodeNotFound,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    RetryPolicy,
    TenantSpec,
)

GPU0 = ProviderKey("node-a", "gpu0")
GPU1 = ProviderKey("node-b", "gpu1")
BIG, FAST = "ornith:35b", "ornith-fast"
EVERY_KIND = {
    "connected",
    "granted",
    "released",
    "ejected",
    "retried",
    "queued",
    "rejected",
    "restored",
    "timed_out",
    "revoked",
    "disconnected",
    "refreshed",
}


def _config() -> PoolConfig:
    spec = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    return PoolConfig(
        policy=QueuePolicy(max_queue=3, queue_timeout=5.0),
        providers={GPU0: spec, GPU1: spec},
        models={BIG: ModelGroup(candidates=(GPU0, GPU1)), FAST: ModelGroup(candidates=(GPU0,))},
        outlier=OutlierPolicy(consecutive_failures=1, base_ejection=2.5, max_ejection=10.0),
        retry=RetryPolicy(max_attempts=2),
        tenants=(TenantSpec("a", max_queue=1), TenantSpec("b", weight=2.0)),
    )


@attrs.frozen
class Transcript:
    events: list[AdmissionEvent]
    outcomes: list[object]


def _error(exc: BaseException) -> tuple[object, ...]:
    return ("error", type(exc).__name__, exc.args, str(exc))


def _lease(lease: Any) -> tuple[object, ...]:
    return (
        "lease",
        lease.id,
        lease.provider,
        lease.long,
        lease.attempt,
        lease.tried,
        lease.probe,
        lease.tenant,
        lease.cost,
        lease.queue_wait,
    )


def _transcript(layer: Layer) -> Transcript:
    events: list[AdmissionEvent] = []
    out: list[object] = []

    async def scenario() -> None:
        admission = layer.admission(_config())

        async def request(model: str, tenant: str, hold: float, long: bool = False) -> None:
            try:
                async with admission.lease(model, tenant=tenant, long=long) as lease:
                    out.append(_lease(lease))
                    await layer.sleep(hold)
                    if lease.probe:
                        admission.report_success(lease)
            except AdmissionError as exc:
                out.append(_error(exc))

        async with layer.tasks() as spawn, admission.subscribe() as stream, admission.subscribe(buffer=1):

            async def collect() -> None:
                async for event in stream:
                    events.append(event)

            collector = spawn(collect)
            watcher = layer.watch_ejections(admission, spawn)
            with pytest.raises(NodeNotFound) as unknown:
                admission.connect("node-x")
            out.append(_error(unknown.value))
            generation = admission.connect("node-a")
            out.append(("generations", generation, admission.connect("node-b"), admission.generation("node-x")))

            # A failure ejects gpu0 until t=2.5; the retry, with its reason, goes to gpu1.
            first_scope = admission.lease(BIG, tenant="a")
            first = await first_scope.__aenter__()
            admission.report_failure(first)
            await first_scope.__aexit__(None, None, None)
            retry_scope = admission.retry(first, reason="connect_error")
            second = await retry_scope.__aenter__()
            out.extend([_lease(first), _lease(second)])
            try:  # a third attempt is one too many: refused, and said so with the model and kind
                async with admission.retry(second, reason="timeout"):
                    pass
            except AdmissionError as exc:
                out.append(_error(exc))

            # Waiters of two tenants; tenant a's queue limit, then the global one.
            for tenant in ("b", "a", "a", "b", "b"):
                spawn(lambda tenant=tenant: request(BIG, tenant, 1.0))
                await layer.settle()
            out.append(("queued", admission.queue_depth, admission.snapshot()))

            # gpu1 serves the waiters one by one from t=1; at t=2.5 gpu0's probe goes to one and restores it.
            await layer.sleep(1.0)
            # Read at t=1 with nothing asked since t=0: the ejection's time left counts from now.
            out.append(("t=1", admission.snapshot(), admission.snapshot(first=1, count=1), admission.snapshot(count=1)))
            out.append(("nodes", admission.generation("node-a"), admission.is_connected("node-b")))
            admission.report_success(second)
            await retry_scope.__aexit__(None, None, None)
            await layer.sleep(3.25)
            out.append(("served", admission.queue_depth, admission.snapshot()))
            admission.hold(GPU1, 1, 1)  # [held-elsewhere] a long run another Edge left on gpu1
            out.append(("held", admission.snapshot(first=1)))
            admission.hold(GPU1, 0, 0)

            # A queue timeout: gpu0 held, a long waiter for the model only gpu0 serves times out at t=9.25.
            holder_scope = admission.lease(FAST, tenant="a", cost=3.0)
            out.append(_lease(await holder_scope.__aenter__()))
            spawn(lambda: request(FAST, "b", 1.0, long=True))
            await layer.sleep(5.5)
            await holder_scope.__aexit__(None, None, None)

            # Fencing node-a revokes the lease running there.
            spawn(lambda: request(FAST, "a", 100.0))
            await layer.settle()
            out.append(("disconnect", admission.disconnect("node-a", generation), admission.is_connected("node-a")))
            await layer.settle()
            spawn(lambda: request(FAST, "a", 1.0))  # nothing online for it: Unavailable
            await layer.settle()

            # A refresh that removes a model fails its queued waiter; gpu1 is ejected meanwhile (a second
            # ejection, after the first one's end).
            holder_scope = admission.lease(BIG, tenant="a")
            holder = await holder_scope.__aenter__()
            out.append(_lease(holder))
            admission.report_failure(holder)
            spawn(lambda: request(BIG, "b", 1.0))
            await layer.settle()
            smaller = attrs.evolve(admission.config, models={FAST: ModelGroup(candidates=(GPU0,))})
            pauses: list[None] = []
            admission.refresh(admission.prepare_refresh(smaller, pause=lambda: pauses.append(None)))
            out.append(("paused", bool(pauses)))
            await layer.settle()
            await holder_scope.__aexit__(None, None, None)
            spawn(lambda: request(BIG, "a", 1.0))  # the model is gone: ModelNotFound
            await layer.settle()
            out.append(("stale disconnect", admission.disconnect("node-a", generation)))
            out.append(("end", admission.queue_depth, admission.snapshot()))
            collector.cancel()
            if watcher is not None:
                watcher.cancel()

    layer.run(scenario)
    return Transcript(events, out)


def _one(events: list[AdmissionEvent], kind: str, **fields: object) -> AdmissionEvent:
    """The one event of ``kind`` whose ``fields`` are as given."""
    (found,) = [e for e in events if e.kind == kind and all(getattr(e, k) == v for k, v in fields.items())]
    return found


def test_both_layers_give_the_same_events_errors_leases_and_snapshots() -> None:
    trio_side = _transcript(TrioLayer())
    asyncio_side = _transcript(AsyncioLayer())
    assert {event.kind for event in trio_side.events} == EVERY_KIND
    assert [e.reason for e in trio_side.events if e.kind == "rejected"] == [
        "RetriesExhausted",
        "TenantLimitExceeded",
        "QueueFull",
        "Unavailable",
        "ModelNotFound",
        "ModelNotFound",
    ]
    for trio_event, asyncio_event in zip(trio_side.events, asyncio_side.events, strict=False):
        assert asyncio_event == trio_event
    assert len(asyncio_side.events) == len(trio_side.events)
    assert asyncio_side.outcomes == trio_side.outcomes


def test_the_events_say_what_happened_field_by_field() -> None:
    """The story both layers tell (the test above) is the right one: each kind of event with every
    field it carries, as the scenario's steps make them."""
    events = _transcript(TrioLayer()).events
    lease = {"model": BIG, "provider": GPU0, "lease_id": 1, "generation": 1, "node_id": "node-a", "tenant": "a"}
    assert _one(events, "granted", lease_id=1) == AdmissionEvent("granted", 0.0, waited=0.0, **lease)
    assert _one(events, "released", lease_id=1) == AdmissionEvent("released", 0.0, **lease)
    assert _one(events, "retried") == AdmissionEvent("retried", 0.0, attempt=2, reason="connect_error", **lease)
    assert _one(events, "ejected", provider=GPU0) == AdmissionEvent(
        "ejected", 0.0, provider=GPU0, node_id="node-a", duration=2.5, failures=1
    )
    assert _one(events, "restored") == AdmissionEvent("restored", 3.5, provider=GPU0, node_id="node-a")
    assert _one(events, "granted", lease_id=3) == AdmissionEvent(
        "granted", 1.0, model=BIG, provider=GPU1, lease_id=3, generation=1, node_id="node-b", waited=1.0, tenant="b"
    )
    assert _one(events, "revoked") == AdmissionEvent(
        "revoked", 9.75, model=FAST, provider=GPU0, lease_id=7, generation=1, node_id="node-a", tenant="a"
    )
    assert _one(events, "queued", long=True) == AdmissionEvent("queued", 4.25, model=FAST, long=True, tenant="b")
    assert _one(events, "timed_out") == AdmissionEvent("timed_out", 9.25, model=FAST, long=True, waited=5.0)
    assert _one(events, "rejected", reason="RetriesExhausted") == AdmissionEvent(
        "rejected", 0.0, model=BIG, reason="RetriesExhausted"
    )
    assert _one(events, "rejected", reason="TenantLimitExceeded") == AdmissionEvent(
        "rejected", 0.0, model=BIG, reason="TenantLimitExceeded", tenant="a"
    )
    assert _one(events, "connected", node_id="node-b") == AdmissionEvent(
        "connected", 0.0, generation=1, node_id="node-b"
    )
    assert _one(events, "disconnected") == AdmissionEvent("disconnected", 9.75, generation=1, node_id="node-a")
