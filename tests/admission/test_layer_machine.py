"""Both layers as machines of their own: random programs of clients on virtual time, trio and asyncio.

The core's machines prove the decisions; this one proves that each layer carries them out in the
states that matter (issue 44): a program is a list of clients -- each asks for a lease (normal or
long), holds it a while, reports a failure or a success and, after a failure, retries -- with
pauses, cancellations and node drops between them, run on one layer on virtual time
(``tests/admission/layers.py``). Each program starts with a prelude that builds the health
moments the docs name (two ejections pending, a long waiter put in panic mode the instant a
retry takes the last probe, clients timing out together); the rest is random. After every step
each provider's ``in_flight`` (with the revoked bodies that run on: a client may take its lease
with ``revocable=False``) and the queue depth equal what the clients hold and wait for, and
no provider runs past its capacity; at the end the books close. The named interactions are
counted from what the clients saw and the events, per layer, with floors (``COVERAGE``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st
from tests.admission.layer_clock import now
from tests.admission.layers import AsyncioLayer, Handle, Layer, TrioLayer, books_closed
from tests.admission.state_coverage import PROFILE, Coverage

from iop_admission import (
    AdmissionError,
    AdmissionEvent,
    ModelGroup,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    RetryPolicy,
)

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
M, ON_A, ON_B = "m", "a", "b"
LAYERS = {"trio": TrioLayer(), "asyncio": AsyncioLayer()}
FLOORS = {
    "two ejections pending": 20,
    "probes granted to a retry": 20,
    "grants in panic mode the instant a probe started": 20,
    "simultaneous timeouts": 20,
}
COVERAGE = {name: Coverage(f"{name} layer", FLOORS) for name in LAYERS}
_EXAMPLES = {"soak": 300, "dev": 10, "mutate": 15}.get(PROFILE, 40)


def _config() -> PoolConfig:
    spec = ProviderSpec(capacity=2, long_context_capacity=1, context_window_tokens=1024, total_context_tokens=1024)
    return PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=3.0),
        providers={A: spec, B: spec},
        models={M: ModelGroup((A, B)), ON_A: ModelGroup((A,)), ON_B: ModelGroup((B,))},
        retry=RetryPolicy(max_attempts=2),
        outlier=OutlierPolicy(consecutive_failures=1, base_ejection=1.0, max_ejection=2.0),
    )


@attrs.frozen
class Client:
    """One client: ask at the step's time, hold ``hold`` seconds, report ``report``; retry a failure."""

    model: str
    long: bool = False
    hold: float = 1.0
    report: str = "ok"  # "ok", "fail" or "none"
    retry: bool = True
    revocable: bool = True  # False: a node drop does not cancel the body, which holds on


@attrs.frozen
class Pause:
    seconds: float


@attrs.frozen
class Cancel:
    index: int


@attrs.frozen
class Bounce:
    node: str


Step = Client | Pause | Cancel | Bounce

STEPS = st.one_of(
    st.builds(
        Client,
        model=st.sampled_from((M, M, ON_A, ON_B)),
        long=st.sampled_from((False, False, False, True)),
        hold=st.sampled_from((0.25, 0.5, 1.0, 2.0, 4.0)),
        report=st.sampled_from(("ok", "fail", "fail", "none")),
        retry=st.booleans(),
        revocable=st.sampled_from((True, True, False)),
    ),
    st.builds(Pause, st.sampled_from((0.25, 0.5, 1.0, 3.0))),
    st.builds(Cancel, st.integers(0, 30)),
    st.builds(Bounce, st.sampled_from(("node-a", "node-b"))),
)

# The prelude, at t=0: B's long slot taken for a long while; A and B fail one after the other (two
# ejections pending); at t=1 the ejections end: A's probe goes to a client of ``a``; a long client
# of ``m`` waits (A probes, B has no long slot); a client of ``m`` on A since t=0 fails at t=1.5
# and retries: B's probe goes to the retry, and the long waiter is in panic mode, granted on A at
# once. At t=4 two clients fill A for 8 s and three more queue behind them: they time out together.
PRELUDE: tuple[Step, ...] = (
    Client(ON_B, long=True, hold=6.0, report="none"),
    Client(M, hold=1.5, report="fail", retry=True),
    Client(ON_A, hold=0.0, report="fail", retry=False),
    Client(ON_B, hold=0.0, report="fail", retry=False),
    Pause(1.0),
    Client(ON_A, hold=5.0, report="none"),
    Client(M, long=True, hold=1.0, report="ok"),
    Pause(3.0),
    Client(ON_A, hold=8.0, report="none"),
    Client(ON_A, hold=8.0, report="none"),
    Client(ON_A, hold=1.0, report="ok"),
    Client(ON_A, hold=1.0, report="ok"),
    Client(ON_A, hold=1.0, report="ok"),
    Pause(3.5),
)


@attrs.define
class Run:
    """What one program did on one layer: the clients' grants and the events."""

    layer: Layer
    admission: Any
    holding: dict[int, tuple[ProviderKey, bool]] = attrs.Factory(dict)  # client -> (provider, long) held
    waiting: set[int] = attrs.Factory(set)
    grants: list[tuple[float, ProviderKey, bool, int, bool]] = attrs.Factory(
        list
    )  # time, provider, probe, attempt, panic
    events: list[AdmissionEvent] = attrs.Factory(list)
    handles: list[Handle] = attrs.Factory(list)

    def granted(self, index: int, lease: Any) -> None:
        self.waiting.discard(index)
        self.holding[index] = (lease.provider, lease.long)
        health = {(p.node_id, p.provider_id): p.health for p in self.admission.snapshot().providers}
        panic = not lease.probe and health[(lease.provider.node_id, lease.provider.provider_id)] == "ejected"
        self.grants.append((now(self.layer), lease.provider, lease.probe, lease.attempt, panic))

    async def attempt(self, index: int, scope: Any, client: Client) -> Any:
        """One attempt through ``scope`` (a lease or a retry): the lease, if it failed and may retry."""
        self.waiting.add(index)
        try:
            async with scope as lease:
                self.granted(index, lease)
                try:
                    await self.layer.sleep(client.hold)
                    if client.report == "fail":
                        self.admission.report_failure(lease)
                        return lease
                    if client.report == "ok":
                        self.admission.report_success(lease)
                finally:
                    del self.holding[index]
        finally:
            self.waiting.discard(index)
        return None

    def client(self, index: int, client: Client) -> Callable[[], Awaitable[None]]:
        async def body() -> None:
            try:
                scope = self.admission.lease(client.model, long=client.long, revocable=client.revocable)
                failed = await self.attempt(index, scope, client)
                if failed is not None and client.retry:
                    await self.attempt(index, self.admission.retry(failed, reason="test"), client)
            except AdmissionError:
                pass

        return body

    def check(self) -> None:
        """Counters equal what the clients hold and wait for (a body that ignores its revocation,
        ``revocable=False``, counts as revoked until it leaves); no provider past its capacity."""
        snap = self.admission.snapshot()
        assert snap.queue_depth == len(self.waiting), (snap.queue_depth, self.waiting)
        for p in snap.providers:
            key = ProviderKey(p.node_id, p.provider_id)
            held = [long for provider, long in self.holding.values() if provider == key]
            running, long_running = p.in_flight + p.revoked_in_flight, p.long_in_flight + p.revoked_long_in_flight
            assert (running, long_running) == (len(held), sum(held)), (p, held)
            assert running <= p.capacity and long_running <= p.long_context_capacity


def _run(layer: Layer, program: list[Step], watch: bool) -> Run:
    admission = layer.admission(_config())
    run = Run(layer, admission)

    async def scenario() -> None:
        async with layer.tasks() as spawn, admission.subscribe() as stream:

            async def collect() -> None:
                async for event in stream:
                    run.events.append(event)

            collector = spawn(collect)
            watcher = layer.watch_ejections(admission, spawn) if watch else None
            for node in ("node-a", "node-b"):
                admission.connect(node)
            for step in (*PRELUDE, *program):
                await _step(run, spawn, step)
                await layer.settle()
                run.check()
            await layer.sleep(100.0)
            for handle in run.handles:
                handle.cancel()
            await layer.settle()
            run.check()
            books_closed(admission)
            collector.cancel()
            if watcher is not None:
                watcher.cancel()

    layer.run(scenario)
    return run


async def _step(run: Run, spawn: Callable[[Callable[[], Awaitable[object]]], Handle], step: Step) -> None:
    if isinstance(step, Client):
        run.handles.append(spawn(run.client(len(run.handles), step)))
    elif isinstance(step, Pause):
        await run.layer.sleep(step.seconds)
    elif isinstance(step, Cancel):
        if run.handles:
            run.handles[step.index % len(run.handles)].cancel()
    else:
        if run.admission.is_connected(step.node):
            run.admission.disconnect(step.node, run.admission.generation(step.node))
        await run.layer.settle()
        run.admission.connect(step.node)


def _count(run: Run, coverage: Coverage) -> int:
    """The named interactions ``run`` reached, counted into ``coverage``; how many."""
    hits: list[str] = []
    timeouts = [e.time for e in run.events if e.kind == "timed_out"]
    hits += ["simultaneous timeouts"] * sum(timeouts.count(t) > 1 for t in set(timeouts))
    until: dict[ProviderKey, float] = {}
    for e in run.events:
        if e.kind == "ejected":
            assert e.provider is not None and e.time is not None and e.duration is not None
            if any(k != e.provider and end > e.time for k, end in until.items()):
                hits.append("two ejections pending")
            until[e.provider] = e.time + e.duration
        elif e.kind == "restored":
            until.pop(e.provider, None)  # type: ignore[arg-type]
    hits += ["probes granted to a retry"] * sum(probe and attempt > 1 for _, _, probe, attempt, _ in run.grants)
    probe_times = {(t, p) for t, p, probe, _, _ in run.grants if probe}
    hits += ["grants in panic mode the instant a probe started"] * sum(
        panic and any(pt == t and pp != p for pt, pp in probe_times) for t, p, _, _, panic in run.grants
    )
    for name in hits:
        coverage.hit(name)
    coverage.examples += 1
    return len(hits)


@pytest.fixture(scope="module", autouse=True)
def _check_coverage() -> object:
    yield
    for coverage in COVERAGE.values():
        coverage.check()


@pytest.mark.req("outlier-ejection", "failover-before-first-byte", "queue-ownership")
@pytest.mark.parametrize("name", sorted(LAYERS))
@settings(max_examples=_EXAMPLES, deadline=None)
@given(program=st.lists(STEPS, max_size=20), watch=st.booleans())
def test_a_layer_carries_out_every_decision_in_the_states_that_matter(
    name: str, program: list[Step], watch: bool
) -> None:
    """Any program of clients on one layer: counters equal what the clients hold and wait for after
    every step, nothing past capacity, the books close; the named interactions are counted."""
    run = _run(LAYERS[name], program, watch)
    target(float(_count(run, COVERAGE[name])), label="named interactions reached")
