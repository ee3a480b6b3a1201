"""Fixtures for the trio-layer admission tests.

Every test here runs on ``MockClock(autojump_threshold=0)`` (take the
``autojump_clock`` fixture), observes waiting with
``trio.testing.wait_all_tasks_blocked()`` and ends with ``drain_check``.

The shared pool of [cross-model-tests]: two model keys, ``ornith:35b`` and
``ornith-fast``, both on the one provider ``node-a/gpu0``. The constants are
exposed through the ``pool`` fixture so test modules need no import of this file.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import final

import attrs
import pytest
import trio
import trio.testing
from tests.admission import state_coverage
from tests.admission.layers import AsyncioLayer, Layer, TrioLayer

from iop_admission import (
    Admission,
    AdmissionError,
    Lease,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
)

GPU0 = ProviderKey("node-a", "gpu0")
GPU1 = ProviderKey("node-b", "gpu1")
BIG = "ornith:35b"
FAST = "ornith-fast"
WINDOW = 32768


@final
@attrs.frozen
class Pool:
    """Names and config builders of the test pools."""

    gpu0: ProviderKey = GPU0
    gpu1: ProviderKey = GPU1
    big: str = BIG
    fast: str = FAST

    @staticmethod
    def spec(capacity: int = 1, long_cap: int = 1, *, priority: int = 0, enabled: bool = True) -> ProviderSpec:
        """A valid provider spec (total_context_tokens = window * long_cap)."""
        return ProviderSpec(
            capacity=capacity,
            long_context_capacity=long_cap,
            context_window_tokens=WINDOW,
            total_context_tokens=WINDOW * long_cap,
            priority=priority,
            enabled=enabled,
        )

    def shared(
        self,
        *,
        capacity: int = 1,
        long_cap: int = 1,
        max_queue: int = 64,
        queue_timeout: float = 30.0,
        enabled: bool = True,
        models: tuple[str, ...] = (BIG, FAST),
    ) -> PoolConfig:
        """``models`` (default ornith:35b and ornith-fast) all on node-a/gpu0."""
        return PoolConfig(
            policy=QueuePolicy(max_queue=max_queue, queue_timeout=queue_timeout),
            providers={GPU0: self.spec(capacity, long_cap, enabled=enabled)},
            models={m: ModelGroup(candidates=(GPU0,)) for m in models},
        )

    def two_nodes(
        self,
        *,
        gpu0: ProviderSpec | None = None,
        gpu1: ProviderSpec | None = None,
        max_queue: int = 64,
        queue_timeout: float = 30.0,
    ) -> PoolConfig:
        """node-a/gpu0 and node-b/gpu1; ornith:35b lists both, ornith-fast only gpu0."""
        return PoolConfig(
            policy=QueuePolicy(max_queue=max_queue, queue_timeout=queue_timeout),
            providers={GPU0: gpu0 or self.spec(), GPU1: gpu1 or self.spec()},
            models={BIG: ModelGroup(candidates=(GPU0, GPU1)), FAST: ModelGroup(candidates=(GPU0,))},
        )

    def single(self, key: ProviderKey = GPU1, models: tuple[str, ...] = (BIG,)) -> PoolConfig:
        """Only provider ``key`` (default node-b/gpu1), listed by ``models``."""
        return PoolConfig(
            policy=QueuePolicy(),
            providers={key: self.spec()},
            models={m: ModelGroup(candidates=(key,)) for m in models},
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The state coverage of every admission machine that ran: counts beside floors (issue 44)."""
    for table in state_coverage.tables():
        terminalreporter.write_line(table)


@pytest.fixture
def pool() -> Pool:
    return Pool()


@pytest.fixture(params=[TrioLayer(), AsyncioLayer()], ids=lambda layer: layer.name)
def layer(request: pytest.FixtureRequest) -> Layer:
    """Each layer of admission in turn, on virtual time (``tests/admission/layers.py``)."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def _drain_check(admission: Admission) -> None:
    """Assert nothing is left: no waiter, no lease, every provider counter 0."""
    snap = admission.snapshot()
    assert snap.queue_depth == 0
    for p in snap.providers:
        counters = (p.in_flight, p.long_in_flight, p.queued, p.long_queued, p.revoked_in_flight)
        assert counters == (0, 0, 0, 0, 0), f"{p.node_id}/{p.provider_id}: {counters}"
        assert p.status != "removed", f"{p.node_id}/{p.provider_id} is listed as removed with nothing running"
    assert list(admission._core.live_leases()) == [] and list(admission._core.revoked_running()) == []


@pytest.fixture
def drain_check() -> Callable[[Admission], None]:
    return _drain_check


@final
@attrs.define(eq=False)
class Request:
    """One ``async with admission.lease(...)`` run in its own task, recorded.

    The body holds the lease until :attr:`release` is set (or for ``hold``
    seconds). ``scope`` wraps the whole request; cancel it to cancel the task.
    """

    admission: Admission
    model: str
    long: bool = False
    hold: float | None = None
    lease: Lease | None = None
    error: BaseException | None = None
    granted_at: float | None = None
    ended_at: float | None = None
    body_finished: bool = False
    release: trio.Event = attrs.Factory(trio.Event)
    done: trio.Event = attrs.Factory(trio.Event)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    log: list[Request] | None = None

    async def run(self) -> None:
        with self.scope:
            try:
                async with self.admission.lease(self.model, long=self.long) as lease:
                    self.lease = lease
                    self.granted_at = trio.current_time()
                    if self.log is not None:
                        self.log.append(self)
                    if self.hold is None:
                        await self.release.wait()
                    else:
                        await trio.sleep(self.hold)
                    self.body_finished = True
            except AdmissionError as exc:
                self.error = exc
        self.ended_at = trio.current_time()
        self.done.set()

    @property
    def cancelled(self) -> bool:
        return self.scope.cancelled_caught

    @property
    def waiting(self) -> bool:
        return self.lease is None and not self.done.is_set()


Spawn = Callable[..., Awaitable[Request]]


@pytest.fixture
def spawn() -> Spawn:
    """``await spawn(nursery, admission, model, long=..., hold=..., log=...)``.

    Starts a :class:`Request` and returns once every task is blocked, so the
    request is either holding its lease, parked in the queue, or finished.
    With ``settle=False`` it returns at once, before the request's task ran.
    """

    async def start(
        nursery: trio.Nursery,
        admission: Admission,
        model: str,
        *,
        settle: bool = True,
        **kwargs: object,
    ) -> Request:
        request = Request(admission, model, **kwargs)  # type: ignore[arg-type]
        nursery.start_soon(request.run)
        if settle:
            await trio.testing.wait_all_tasks_blocked()
        return request

    return start


@pytest.fixture
def handoff(spawn: Spawn) -> Spawn:
    """``await handoff(nursery, admission, model, holder=BIG, **kwargs)``.

    Holds a ``holder`` lease on the full provider, queues a :class:`Request` for
    ``model`` behind it, then releases: the grant is handed to the request,
    whose task has *not run yet* when this returns (same tick as the grant).
    """

    async def start(
        nursery: trio.Nursery, admission: Admission, model: str, *, holder: str = BIG, **kwargs: object
    ) -> Request:
        async with admission.lease(holder):
            request = await spawn(nursery, admission, model, **kwargs)
            assert request.waiting
        return request

    return start
