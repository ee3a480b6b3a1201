"""The asyncio layer of admission: :class:`AsyncAdmission`, for FastAPI,
aiohttp and any other asyncio service.

It has the trio layer's semantics (see :class:`iop_admission.Admission`) and is
built, like it, on the public core :mod:`iop_admission.core`:

* a lease is released when its ``async with`` exits, on every path;
* a task cancelled while queued withdraws its waiter; a grant that reaches a
  waiter whose task was already cancelled is released at once, and a task
  cancelled between its grant and its first step releases the lease it was
  handed (the scope never returns a lease it will not release);
* an immediate grant does not yield to the loop (as ``asyncio.Semaphore``),
  so there is no window between the grant and the ``async with`` body;
* a revoked lease (its node generation fenced) cancels the body's task with
  the core's news; the scope takes that cancellation back
  (``Task.uncancel``) and raises :class:`~iop_admission.LeaseRevoked`;
* a waiter past its queue deadline gets :class:`~iop_admission.QueueTimeout`;
  ``refresh`` re-arms every queued waiter's timer to its new deadline;
* ``subscribe()`` delivers the trio layer's lifecycle events
  (:class:`~iop_admission.AdmissionEvent`) as an async iterator, best effort.

Times are the running loop's ``loop.time()``. Like ``asyncio.Lock``, an
:class:`AsyncAdmission` belongs to the loop that first uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import final

from ._config import PoolConfig, ProviderKey
from ._errors import LeaseRevoked, LeaseScopeError, NodeNotFound, QueueTimeout
from ._events import AdmissionEvent, health_event, lease_event, rejected_event
from ._snapshot import Snapshot
from .core import (
    AdmissionState,
    Decision,
    Ejected,
    Failed,
    Granted,
    Lease,
    PreparedRefresh,
    Revoked,
    Waiter,
    read_snapshot,
)

__all__ = ["AsyncAdmission", "AsyncLeaseScope"]


@final
class AsyncAdmission:
    """Provider-wide leases, one fair global queue, connectivity generations, for asyncio.

    Args:
        config: the pool configuration.

    Raises:
        ConfigError: listing every problem of ``config``.
    """

    def __init__(self, config: PoolConfig) -> None:
        self._core = AdmissionState(config)
        self._futures: dict[Waiter, asyncio.Future[Lease]] = {}  # queued waiters' futures
        self._timers: dict[Waiter, asyncio.TimerHandle] = {}  # and their deadline timers
        self._bodies: dict[Lease, asyncio.Task[object]] = {}  # live leases' tasks (fencing cancels them)
        self._revoking: set[Lease] = set()  # leases whose task this layer cancelled
        self._ejection_timer: asyncio.TimerHandle | None = None
        self._subscribers: list[asyncio.Queue[AdmissionEvent]] = []
        self.events_dropped = 0  # events a full subscriber buffer did not take

    # ------------------------------------------------------------------ leases

    def lease(self, model: str, *, long: bool = False, tenant: str | None = None, cost: float = 1.0) -> AsyncLeaseScope:
        """Ask for a lease on one of ``model``'s candidates: ``async with admission.lease(model) as lease:``.

        ``tenant`` and ``cost`` as :meth:`iop_admission.Admission.lease`.
        Raises (on entry): ``ModelNotFound``, ``Unavailable``, ``QueueFull``,
        ``TenantLimitExceeded``, ``QueueTimeout``, as :meth:`iop_admission.Admission.lease`.
        Raises (on exit): ``LeaseRevoked`` when fencing cancelled the body.
        """
        return AsyncLeaseScope(self, model, long, None, tenant, cost)

    def settle(self, lease: Lease, actual: float) -> None:
        """Charge ``lease``'s tenant the cost it used instead of its reserve (see ``Admission.settle``)."""
        self._core.settle(lease, actual)

    def retry(self, lease: Lease, *, reason: str | None = None) -> AsyncLeaseScope:
        """Ask again for the request ``lease`` served, on a candidate not tried (see ``Admission.retry``).

        ``reason`` goes into the ``retried`` event.
        """
        return AsyncLeaseScope(self, lease.model, lease.long, lease, reason=reason)

    def report_failure(self, lease: Lease) -> None:
        """Count a provider failure of ``lease``; may eject its provider (see ``Admission.report_failure``)."""
        self._apply(self._core.report_failure(lease, asyncio.get_running_loop().time()))

    def report_success(self, lease: Lease) -> None:
        """Count a success of ``lease``; restores its provider if ejected."""
        self._apply(self._core.report_success(lease, asyncio.get_running_loop().time()))

    # ----------------------------------------------------- nodes and config

    def connect(self, node_id: str) -> int:
        """Start a new generation of ``node_id`` and bring its providers online; return the generation."""
        if not self._core.knows_node(node_id):
            raise NodeNotFound(node_id, self._core.nodes())
        generation, decisions = self._core.connect(node_id)
        self._apply(decisions)
        if self._subscribers:
            self._emit(AdmissionEvent("connected", _now(), node_id=node_id, generation=generation))
        return generation

    def disconnect(self, node_id: str, generation: int) -> bool:
        """Fence ``generation`` of ``node_id``: its leases are revoked; False if stale (no effect)."""
        done, decisions = self._core.disconnect(node_id, generation)
        self._apply(decisions)
        if done and self._subscribers:
            self._emit(AdmissionEvent("disconnected", _now(), node_id=node_id, generation=generation))
        return done

    def hold(self, provider: ProviderKey, runs: int, long_runs: int = 0) -> None:
        """Count ``runs`` held elsewhere against ``provider``'s capacity, ``long_runs`` of them against
        its long slots too (see ``Admission.hold``)."""
        self._apply(self._core.hold(provider, runs, long_runs))

    def prepare_refresh(self, config: PoolConfig, *, pause: Callable[[], None] | None = None) -> PreparedRefresh:
        """Validate ``config`` for :meth:`refresh`; safe in a worker thread (see ``Admission.prepare_refresh``)."""
        return self._core.prepare_refresh(config, pause)

    def refresh(self, config: PoolConfig | PreparedRefresh) -> None:
        """Replace the configuration atomically; leases are kept, queue deadlines move with the timeout."""
        decisions = self._core.refresh(config)
        for waiter, timer in list(self._timers.items()):
            if timer.when() != waiter.deadline:
                timer.cancel()
                self._arm(waiter)
        self._apply(decisions)
        if self._subscribers:
            self._emit(AdmissionEvent("refreshed", _now()))

    # ----------------------------------------------------------------- queries

    @property
    def config(self) -> PoolConfig:
        """The configuration in force."""
        return self._core.config

    @property
    def queue_depth(self) -> int:
        """Waiters queued now."""
        return self._core.queue_depth

    def snapshot(self, *, first: int = 0, count: int | None = None) -> Snapshot:
        """Read the state admission uses (see ``Admission.snapshot``)."""
        now = asyncio.get_running_loop().time()
        return read_snapshot(self._core, now, events_dropped=self.events_dropped, first=first, count=count)

    def generation(self, node_id: str) -> int:
        """The node's current generation (0 if never connected)."""
        return self._core.generation(node_id)

    def is_connected(self, node_id: str) -> bool:
        """Whether the node is connected."""
        return self._core.is_connected(node_id)

    # ------------------------------------------------------------------ events

    @asynccontextmanager
    async def subscribe(self, buffer: int = 256) -> AsyncIterator[AsyncIterator[AdmissionEvent]]:
        """``async with admission.subscribe() as events: async for event in events: ...``

        Events queue in a buffer of ``buffer``; when it is full an event is
        dropped and counted in :attr:`events_dropped`. No correctness path
        reads events.
        """
        queue: asyncio.Queue[AdmissionEvent] = asyncio.Queue(buffer)
        self._subscribers.append(queue)
        try:
            yield _events(queue)
        finally:
            self._subscribers.remove(queue)

    def _emit(self, event: AdmissionEvent) -> None:
        for queue in self._subscribers:
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self.events_dropped += 1

    # -------------------------------------------------------------- decisions

    def _apply(self, decisions: list[Decision]) -> None:
        """Carry out core decisions in order (a late grant's release appends its own)."""
        i = 0
        while i < len(decisions):
            d = decisions[i]
            i += 1
            if type(d) is Granted:
                future = self._leave(d.waiter)
                if future.done():  # its task was cancelled first: the grant goes back
                    decisions.extend(self._core.release(d.lease))
                else:
                    future.set_result(d.lease)
            elif type(d) is Failed:
                future = self._leave(d.waiter)
                if not future.done():
                    future.set_exception(d.error)
            elif type(d) is Revoked:
                task = self._bodies.get(d.lease)
                if task is not None and d.lease not in self._revoking:
                    self._revoking.add(d.lease)
                    task.cancel(f"lease {d.lease.id} revoked")
                if self._subscribers:
                    self._emit(lease_event("revoked", _now(), d.lease))
            else:
                if type(d) is Ejected:
                    self._arm_ejection()
                if self._subscribers:
                    self._emit(health_event(_now(), d))

    def _leave(self, waiter: Waiter) -> asyncio.Future[Lease]:
        self._timers.pop(waiter).cancel()
        return self._futures.pop(waiter)

    def _arm(self, waiter: Waiter) -> None:
        self._timers[waiter] = asyncio.get_running_loop().call_at(waiter.deadline, self._expire, waiter)

    def _expire(self, waiter: Waiter) -> None:
        # The loop runs a timer up to its clock resolution early: the deadline is due now.
        now = max(asyncio.get_running_loop().time(), waiter.deadline)
        for expired in self._core.expire(now):
            future = self._leave(expired)
            if not future.done():
                future.set_exception(QueueTimeout(expired.model, now - expired.enqueue_time))
            if self._subscribers:
                waited = now - expired.enqueue_time
                self._emit(AdmissionEvent("timed_out", now, model=expired.model, long=expired.long, waited=waited))

    def _arm_ejection(self) -> None:
        end = self._core.next_ejection_end()
        if self._ejection_timer is not None:
            self._ejection_timer.cancel()
            self._ejection_timer = None
        if end is not None:
            self._ejection_timer = asyncio.get_running_loop().call_at(end, self._advance)

    def _advance(self) -> None:
        self._ejection_timer = None
        loop = asyncio.get_running_loop()
        self._apply(self._core.advance(loop.time()))
        self._arm_ejection()

    # ----------------------------------------------------- lease scope halves

    async def _acquire(
        self,
        model: str,
        long: bool,
        retry_of: Lease | None,
        tenant: str | None = None,
        cost: float = 1.0,
        reason: str | None = None,
    ) -> Lease:
        core = self._core
        now = asyncio.get_running_loop().time()
        try:
            if retry_of is None:
                result = core.request(model, long, now, tenant, cost)
            else:
                result = core.retry(retry_of, now)
        except Exception as exc:
            if self._subscribers:
                self._emit(rejected_event(now, model, long, exc))
            raise
        shed = core.drain_decisions()  # waiters of a lower negative band evicted for this request
        if shed:
            self._apply(shed)
        if retry_of is not None and self._subscribers:
            self._emit(lease_event("retried", now, retry_of, attempt=retry_of.attempt + 1, reason=reason))
        if type(result) is Lease:
            lease = result
        else:
            assert type(result) is Waiter
            if self._subscribers:
                tenant = result.tenant if result._ticket is not None else None  # as lease events
                self._emit(AdmissionEvent("queued", now, model=model, long=long, tenant=tenant))
            try:
                lease = await self._wait(result)
            except Exception as exc:  # failed in the queue; a timeout has its own event
                if self._subscribers and not isinstance(exc, QueueTimeout):
                    self._emit(rejected_event(_now(), model, long, exc))
                raise
            lease.queue_wait = asyncio.get_running_loop().time() - now
        if lease.revoked:  # fenced between the grant and now: the body never runs, its capacity comes back
            self._apply(core.release(lease))
            raise LeaseRevoked(lease.id, lease.provider.node_id, lease.generation)
        task = asyncio.current_task()
        if task is None:
            self._apply(core.release(lease))
            raise RuntimeError("AsyncAdmission.lease() must be entered from an asyncio task")
        self._bodies[lease] = task
        if self._subscribers:
            self._emit(lease_event("granted", _now(), lease, waited=lease.queue_wait))
        return lease

    async def _wait(self, waiter: Waiter) -> Lease:
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self._futures[waiter] = future
        self._arm(waiter)
        try:
            return await future
        except asyncio.CancelledError:
            if self._core.withdraw(waiter):
                self._leave(waiter)
            elif future.done() and not future.cancelled() and future.exception() is None:
                # Granted, then cancelled before the task resumed: hand the lease back.
                self._apply(self._core.release(future.result()))
            raise

    async def _release(self, lease: Lease, exc_type: type[BaseException] | None) -> None:
        task = self._bodies.pop(lease)
        self._apply(self._core.release(lease))
        if self._subscribers:
            self._emit(lease_event("released", _now(), lease))
        if lease not in self._revoking:
            return
        self._revoking.discard(lease)
        if exc_type is None:
            # The body ended without awaiting after the revocation: take the
            # pending cancellation now, so it does not hit the caller later.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
        if task.uncancel() == 0 and exc_type in (None, asyncio.CancelledError):
            raise LeaseRevoked(lease.id, lease.provider.node_id, lease.generation) from None

    def __repr__(self) -> str:
        return f"<AsyncAdmission {self._core!r}>"


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _events(queue: asyncio.Queue[AdmissionEvent]) -> AsyncIterator[AdmissionEvent]:
    while True:
        yield await queue.get()


@final
class AsyncLeaseScope:
    """What :meth:`AsyncAdmission.lease` returns: a single-use async context manager."""

    __slots__ = ("_admission", "_model", "_long", "_retry_of", "_lease", "_state", "_tenant", "_cost", "_reason")

    def __init__(
        self,
        admission: AsyncAdmission,
        model: str,
        long: bool,
        retry_of: Lease | None,
        tenant: str | None = None,
        cost: float = 1.0,
        *,
        reason: str | None = None,
    ) -> None:
        self._admission = admission
        self._reason = reason
        self._tenant = tenant
        self._cost = cost
        self._model = model
        self._long = long
        self._retry_of = retry_of
        self._lease: Lease | None = None
        self._state = "new"

    async def __aenter__(self) -> Lease:
        if self._state != "new":
            raise LeaseScopeError("a lease scope can be entered only once")
        self._state = "entering"
        self._lease = await self._admission._acquire(
            self._model, self._long, self._retry_of, self._tenant, self._cost, self._reason
        )
        self._state = "entered"
        return self._lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state != "entered" or self._lease is None:
            raise LeaseScopeError(f"a lease scope can be exited once, after it was entered (it is {self._state})")
        self._state = "exited"
        await self._admission._release(self._lease, exc_type)
