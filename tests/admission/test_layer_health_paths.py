"""Health and timer paths of both layers that the machines reached too rarely, with exact steps.

Each scenario runs on the trio and the asyncio layer on virtual time (``tests/admission/layers.py``)
and is the scenario of a semantic bug that passed the suite before (issue 44): a retry whose
grant starts a probe must wake the waiter it puts in panic mode at once (the layer carries out the
core's ``drain_decisions()`` after a retry, not only after a request); two ejections pending end
each at its own time (the asyncio layer's timer is armed again after it fires); two waiters
timing out in one instant both get their ``timed_out`` event; and without ``watch_ejections`` a
report after an ejection's time ends it, as docs/admission.md says.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from tests.admission.layer_clock import now
from tests.admission.layers import Layer, TrioLayer

from iop_admission import (
    AdmissionError,
    AdmissionEvent,
    ModelGroup,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
)

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
C = ProviderKey("node-c", "gpu2")
WINDOW = 32768


def _config(models: dict[str, tuple[ProviderKey, ...]], capacity: int = 1, long_cap: int = 1) -> PoolConfig:
    keys = dict.fromkeys(k for cands in models.values() for k in cands)
    spec = ProviderSpec(
        capacity=capacity,
        long_context_capacity=long_cap,
        context_window_tokens=WINDOW,
        total_context_tokens=WINDOW * long_cap,
    )
    return PoolConfig(
        policy=QueuePolicy(max_queue=16, queue_timeout=60.0),
        providers=dict.fromkeys(keys, spec),
        models={name: ModelGroup(candidates=cands) for name, cands in models.items()},
        outlier=OutlierPolicy(consecutive_failures=1, base_ejection=1.0, max_ejection=4.0),
    )


def _connected(layer: Layer, config: PoolConfig) -> Any:
    admission = layer.admission(config)
    for node in sorted({k.node_id for k in config.providers}):
        admission.connect(node)
    return admission


class Log:
    """What each request of a scenario got: ``(virtual time, provider, long, probe)`` or its error."""

    def __init__(self, layer: Layer, admission: Any) -> None:
        self.layer = layer
        self.admission = admission
        self.got: dict[str, object] = {}

    def request(
        self, name: str, model: str, *, at: float = 0.0, hold: float = 100.0, long: bool = False
    ) -> Callable[[], Awaitable[None]]:
        """A task body: at virtual time ``at`` ask for ``model``, record the grant, hold it ``hold``."""

        async def body() -> None:
            await self.layer.sleep(at)
            try:
                async with self.admission.lease(model, long=long) as lease:
                    self.got[name] = (self.now(), lease.provider, lease.long, lease.probe)
                    await self.layer.sleep(hold)
            except AdmissionError as exc:
                self.got[name] = type(exc).__name__

        return body

    def fail_over(
        self, model: str, on: ProviderKey, *, ends: float, hold: float = 0.0
    ) -> Callable[[], Awaitable[None]]:
        """A task body: a lease of ``model`` (on ``on``) whose run ends at ``ends`` without a report,
        then its retry, recorded as ``"retry"`` and held ``hold``."""

        async def body() -> None:
            async with self.admission.lease(model) as first:
                assert first.provider == on
                await self.layer.sleep(ends)
            async with self.admission.retry(first, reason="connect_error") as again:
                self.got["retry"] = (self.now(), again.provider, again.long, again.probe)
                await self.layer.sleep(hold)

        return body

    async def eject(self, model: str) -> None:
        """A lease of ``model`` whose run fails: its provider is ejected now."""
        async with self.admission.lease(model) as lease:
            self.admission.report_failure(lease)

    def now(self) -> float:
        return now(self.layer)


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
def test_a_retry_that_starts_a_probe_wakes_the_waiter_it_puts_in_panic_mode(layer: Layer) -> None:
    """gpu0's probe is out and gpu1's long slot taken: a long waiter of m waits. At t=2 a retry of m
    takes gpu1's probe; now no candidate admits, and the waiter is granted gpu0's free long slot then."""
    admission = _connected(layer, _config({"m": (A, B), "a": (A,), "b": (B,)}, capacity=3))
    log = Log(layer, admission)

    async def scenario() -> None:
        async with layer.tasks() as spawn:
            spawn(log.fail_over("m", A, ends=2.0, hold=100.0))
            await layer.settle()
            spawn(log.request("b long", "b", long=True))
            await layer.settle()
            await log.eject("a")
            await log.eject("b")
            watcher = layer.watch_ejections(admission, spawn)
            spawn(log.request("a probe", "a", at=1.0))
            spawn(log.request("waiter", "m", at=1.5, long=True))
            await layer.sleep(50.0)
            assert log.got["retry"] == (2.0, B, False, True)
            assert log.got["waiter"] == (2.0, A, True, False)
            if watcher is not None:
                watcher.cancel()

    layer.run(scenario)


@pytest.mark.req("outlier-ejection")
def test_two_ejections_pending_each_end_at_their_own_time(layer: Layer) -> None:
    """gpu0 is ejected at t=0 (until 1), gpu1 at t=0.5 (until 1.5), gpu2 is full: a waiter for each
    gets its provider's probe at that provider's ejection end, the second after the first fired."""
    admission = _connected(layer, _config({"a": (A, C), "b": (B, C), "c": (C,)}))
    log = Log(layer, admission)

    async def scenario() -> None:
        async with layer.tasks() as spawn:
            spawn(log.request("c", "c", hold=1000.0))
            await layer.settle()
            watcher = layer.watch_ejections(admission, spawn)
            await log.eject("a")
            spawn(log.request("wait a", "a", at=0.25))
            await layer.sleep(0.5)
            await log.eject("b")
            spawn(log.request("wait b", "b", at=0.25))
            await layer.sleep(10.0)
            assert log.got["wait a"] == (1.0, A, False, True)
            assert log.got["wait b"] == (1.5, B, False, True)
            if watcher is not None:
                watcher.cancel()
            await layer.sleep(1000.0)

    layer.run(scenario)


@pytest.mark.req("queue-ownership")
def test_two_waiters_timing_out_in_one_instant_both_say_so(layer: Layer) -> None:
    """Two waiters queued at t=0 behind a held slot share their deadline: both fail with QueueTimeout
    at t=60 and each has its ``timed_out`` event."""
    admission = _connected(layer, _config({"m": (A,)}))
    log = Log(layer, admission)
    events: list[AdmissionEvent] = []

    async def scenario() -> None:
        async with layer.tasks() as spawn, admission.subscribe() as stream:

            async def collect() -> None:
                async for event in stream:
                    events.append(event)

            collector = spawn(collect)
            spawn(log.request("holder", "m", hold=100.0))
            await layer.settle()
            spawn(log.request("first", "m"))
            spawn(log.request("second", "m"))
            await layer.sleep(100.0)
            collector.cancel()

    layer.run(scenario)
    assert (log.got["first"], log.got["second"]) == ("QueueTimeout", "QueueTimeout")
    timed_out = [e for e in events if e.kind == "timed_out"]
    assert [(e.time, e.waited) for e in timed_out] == [(60.0, 60.0), (60.0, 60.0)]


@pytest.mark.req("outlier-ejection")
@pytest.mark.parametrize("ok", [True, False])
def test_trio_a_report_after_an_ejections_time_ends_it_without_the_watcher(ok: bool) -> None:
    """No ``watch_ejections``: gpu0 is ejected at t=0 until t=1 and a waiter of m (gpu0, or gpu1,
    full) waits. At t=3 a report of gpu1's lease, success or failure, ends the ejection first: the
    waiter gets gpu0's probe then, not at gpu1's release."""
    layer = TrioLayer()
    admission = _connected(layer, _config({"m": (A, B), "a": (A,), "b": (B,)}))
    log = Log(layer, admission)

    async def on_b() -> None:
        async with admission.lease("b") as lease:
            await layer.sleep(3.0)
            (admission.report_success if ok else admission.report_failure)(lease)
            await layer.sleep(10.0)

    async def scenario() -> None:
        async with layer.tasks() as spawn:
            spawn(on_b)
            await layer.settle()
            await log.eject("a")
            spawn(log.request("waiter", "m", at=0.5))
            await layer.sleep(20.0)
            assert log.got["waiter"] == (3.0, A, False, True)

    layer.run(scenario)


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
def test_a_retry_after_an_ejections_time_gets_the_probe_without_the_watcher(layer: Layer) -> None:
    """No ``watch_ejections``: gpu0 is ejected at t=0 until t=1; a lease of m on gpu1 ends at t=2
    without a report and retries, with nothing asked or reported since t=0. The retry ends the
    ejection first (trio: every request, retry and report advances; asyncio: its timer did at t=1),
    so it gets gpu0's probe, not a grant in panic mode."""
    admission = _connected(layer, _config({"m": (B, A), "a": (A,)}))
    log = Log(layer, admission)

    async def scenario() -> None:
        async with layer.tasks() as spawn:
            await log.eject("a")
            spawn(log.fail_over("m", B, ends=2.0))
            await layer.sleep(5.0)
            assert log.got["retry"] == (2.0, A, False, True)

    layer.run(scenario)
