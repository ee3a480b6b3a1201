"""The asyncio layer's lease hand-off: futures of queued waiters, their deadline timers, the
tasks of lease bodies, the ejection timer and the event queues.

It never decides: :class:`iop_admission.core.AdmissionState` does, and this module carries
the decisions out (see :mod:`iop_admission.aio` for the rules). It is to
:class:`~iop_admission.aio.AsyncAdmission` what ``_handoff.py`` is to the trio layer.
"""

from __future__ import annotations

import asyncio
import sys
from threading import get_ident
from typing import final

from iop_admission._errors import LeaseRevoked, QueueTimeout
from iop_admission.core import AdmissionState, Decision, Ejected, Failed, Granted, Lease, Revoked, Waiter

from .events import AdmissionEvent, health_event, lease_event, rejected_event

__all__ = ["AsyncHandoff", "now_or_none", "running_loop"]


def running_loop(call: str) -> asyncio.AbstractEventLoop:
    """The running asyncio loop, or a RuntimeError that says what ``AsyncAdmission.<call>()`` needs."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        trio = sys.modules.get("trio")  # only a program that imported trio can be inside trio.run
        if trio is not None and trio.lowlevel.in_trio_run():
            raise RuntimeError(
                f"AsyncAdmission.{call}() runs under asyncio only; under trio use iop_admission.Admission"
            ) from None
        raise RuntimeError(
            f"AsyncAdmission.{call}() needs a running asyncio event loop: call it from a task of asyncio.run()"
        ) from None


def now_or_none() -> float | None:
    """The running loop's ``time()``, or None outside asyncio (as the trio layer outside trio)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return None


@final
class AsyncHandoff:
    """Carries the core's decisions out under asyncio, and runs both halves of a lease scope."""

    def __init__(self, core: AdmissionState) -> None:
        self.core = core
        self.futures: dict[Waiter, asyncio.Future[Lease]] = {}  # queued waiters' futures
        self.timers: dict[Waiter, asyncio.TimerHandle] = {}  # and their deadline timers
        self.bodies: dict[Lease, asyncio.Task[object]] = {}  # live leases' tasks (fencing cancels them)
        self.revoking: set[Lease] = set()  # leases whose task this layer cancelled
        self.ejection_timer: asyncio.TimerHandle | None = None
        self.ejection_unarmed = False  # an ejection started outside a running loop: no timer ends it
        self.subscribers: list[asyncio.Queue[AdmissionEvent]] = []
        self.dropped = 0  # events a full subscriber buffer did not take
        # The loop of the latest lease scope and its thread: a cache, not a binding (see ``running``).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = 0

    def running(self, call: str) -> tuple[asyncio.AbstractEventLoop, asyncio.Task[object] | None]:
        """The running loop and its current task (None outside a task), for ``AsyncAdmission.<call>()``,
        or a RuntimeError that says what it needs (:func:`running_loop`).

        ``asyncio.get_running_loop()`` checks the process id (a ``getpid()`` system call) each
        time; a lease scope asks :meth:`cached` first, and comes here when that finds nothing.
        """
        loop = running_loop(call)
        self.loop, self.thread = loop, get_ident()
        return loop, asyncio.current_task(loop)

    def cached(self) -> asyncio.Task[object] | None:
        """The current task of the cached loop when this is the thread it ran in, else None.

        A task there is the current task of this thread's running loop: a thread runs one
        loop at a time, and that loop is inside this task's step (as an admission, the
        hand-off is used from one thread). So the loop and the task are what
        :meth:`running` would return; None sends the caller there (first lease, another
        loop, another thread, no loop).
        """
        loop = self.loop
        return asyncio.current_task(loop) if loop is not None and self.thread == get_ident() else None

    def emit(self, event: AdmissionEvent) -> None:
        for queue in self.subscribers:
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self.dropped += 1

    # -------------------------------------------------------------- decisions

    def apply(self, decisions: list[Decision]) -> None:
        """Carry out core decisions in order (a late grant's release appends its own)."""
        i = 0
        while i < len(decisions):
            d = decisions[i]
            i += 1
            if type(d) is Granted:
                future = self.leave(d.waiter)
                if future.done():  # its task was cancelled first: the grant goes back
                    decisions.extend(self.core.release(d.lease))
                else:
                    future.set_result(d.lease)
            elif type(d) is Failed:
                future = self.leave(d.waiter)
                if not future.done():
                    future.set_exception(d.error)
            elif type(d) is Revoked:
                task = self.bodies.get(d.lease)
                if task is not None and d.lease not in self.revoking:
                    self.revoking.add(d.lease)
                    task.cancel(f"lease {d.lease.id} revoked")
                if self.subscribers:
                    self.emit(lease_event("revoked", now_or_none(), d.lease))
            else:
                if type(d) is Ejected:
                    self.arm_ejection()
                if self.subscribers:
                    self.emit(health_event(now_or_none(), d))

    def leave(self, waiter: Waiter) -> asyncio.Future[Lease]:
        self.timers.pop(waiter).cancel()
        return self.futures.pop(waiter)

    def arm(self, waiter: Waiter, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Set ``waiter``'s deadline timer on ``loop`` (by default the running one)."""
        loop = asyncio.get_running_loop() if loop is None else loop
        self.timers[waiter] = loop.call_at(waiter.deadline, self.expire, waiter)

    def rearm_deadlines(self) -> None:
        """Move every queued waiter's timer to the core's (possibly refreshed) deadline."""
        for waiter, timer in list(self.timers.items()):
            if timer.when() != waiter.deadline:
                timer.cancel()
                self.arm(waiter)

    def expire(self, waiter: Waiter) -> None:
        # The loop runs a timer up to its clock resolution early: the deadline is due now.
        now = max(asyncio.get_running_loop().time(), waiter.deadline)
        for expired in self.core.expire(now):
            future = self.leave(expired)
            if not future.done():
                future.set_exception(QueueTimeout(expired.model, now - expired.enqueue_time))
            if self.subscribers:
                waited = now - expired.enqueue_time
                self.emit(AdmissionEvent("timed_out", now, model=expired.model, long=expired.long, waited=waited))
        self.apply_freed()

    def arm_ejection(self) -> None:
        """Set the loop timer that ends the next ejection (none outside a running loop: the
        ejection then ends at the next lease request after its time)."""
        end = self.core.next_ejection_end()
        if self.ejection_timer is not None:
            self.ejection_timer.cancel()
            self.ejection_timer = None
        running = now_or_none() is not None
        self.ejection_unarmed = end is not None and not running
        if end is not None and running:
            self.ejection_timer = asyncio.get_running_loop().call_at(end, self.advance)

    def advance(self) -> None:
        """End the ejections whose time has come (their probes may go to waiters)."""
        self.ejection_timer = None
        self.apply(self.core.advance(asyncio.get_running_loop().time()))
        self.arm_ejection()

    # ----------------------------------------------------- lease scope halves

    def ask(
        self,
        now: float,
        model: str,
        long: bool,
        retry_of: Lease | None,
        tenant: str | None = None,
        cost: float = 1.0,
        reason: str | None = None,
        tokens: int | None = None,
    ) -> Lease | Waiter:
        """The first half of a lease scope's entry: a lease now (a retry of ``retry_of`` if given),
        or the queued waiter to :meth:`queued` on. Synchronous: an immediate grant does not yield."""
        core = self.core
        if self.ejection_unarmed:  # an ejection started outside a loop: end it now if due, arm its timer
            self.apply(core.advance(now))
            self.arm_ejection()
        try:
            if retry_of is None:
                result = core.request(model, long, now, tenant, cost, tokens)
            else:
                result = core.retry(retry_of, now)
        except Exception as exc:
            if self.subscribers:
                self.emit(rejected_event(now, model, long, exc))
            raise
        shed = core.drain_decisions()  # waiters of a lower negative band evicted for this request
        if shed:
            self.apply(shed)
        if retry_of is not None and self.subscribers:
            self.emit(lease_event("retried", now, retry_of, attempt=retry_of.attempt + 1, reason=reason))
        if type(result) is Waiter and self.subscribers:
            tenant = result.tenant if result._ticket is not None else None  # as lease events
            self.emit(AdmissionEvent("queued", now, model=model, long=long, tenant=tenant))
        return result

    async def queued(self, waiter: Waiter, now: float, loop: asyncio.AbstractEventLoop) -> Lease:
        """Wait in the queue for ``waiter``'s grant (asked at ``now`` of the running ``loop``)."""
        try:
            lease = await self.wait(waiter, loop)
        except Exception as exc:  # failed in the queue; a timeout has its own event
            if self.subscribers and not isinstance(exc, QueueTimeout):
                self.emit(rejected_event(now_or_none(), waiter.model, waiter.long, exc))
            raise
        lease.queue_wait = loop.time() - now
        return lease

    def open(self, lease: Lease, task: asyncio.Task[object] | None, revocable: bool) -> Lease:
        """The last half of a lease scope's entry: the body may start in ``task``, the scope's (if
        ``revocable``, the one fencing cancels)."""
        if lease._revoked:  # fenced between the grant and now: the body never runs, its capacity comes back
            self.apply(self.core.release(lease))
            raise LeaseRevoked(lease.id, lease.provider.node_id, lease.generation)
        if task is None:
            self.apply(self.core.release(lease))
            raise RuntimeError("AsyncAdmission.lease() must be entered from an asyncio task")
        if revocable:
            self.bodies[lease] = task
        if self.subscribers:
            self.emit(lease_event("granted", now_or_none(), lease, waited=lease.queue_wait))
        return lease

    def apply_freed(self) -> None:
        """Grants the headroom a waiter that left had held allows ([token-ledger])."""
        freed = self.core.drain_decisions()
        if freed:
            self.apply(freed)

    async def wait(self, waiter: Waiter, loop: asyncio.AbstractEventLoop) -> Lease:
        future: asyncio.Future[Lease] = loop.create_future()
        self.futures[waiter] = future
        self.arm(waiter, loop)
        try:
            return await future
        except asyncio.CancelledError:
            if self.core.withdraw(waiter):
                self.leave(waiter)
                self.apply_freed()
            elif future.done() and not future.cancelled() and future.exception() is None:
                # Granted, then cancelled before the task resumed: hand the lease back.
                self.apply(self.core.release(future.result()))
            raise

    def close(self, lease: Lease, exc_type: type[BaseException] | None) -> asyncio.Task[object] | None:
        """Release ``lease`` as its body leaves; the body's task if fencing cancelled it (then
        :meth:`revoked` takes that cancellation back). A body with no task to cancel
        (``revocable=False``) that ran revoked gets LeaseRevoked here, as under trio."""
        task = self.bodies.pop(lease, None)
        decisions = self.core.release(lease)
        if decisions:
            self.apply(decisions)
        if self.subscribers:
            self.emit(lease_event("released", now_or_none(), lease))
        if task is None and lease.revoked and exc_type is None:
            raise LeaseRevoked(lease.id, lease.provider.node_id, lease.generation)
        return task if self.revoking and lease in self.revoking else None

    async def revoked(self, lease: Lease, task: asyncio.Task[object], exc_type: type[BaseException] | None) -> None:
        """Take back the cancellation fencing sent to ``lease``'s body (``task``); raise LeaseRevoked."""
        self.revoking.discard(lease)
        if exc_type is None:
            # The body ended without awaiting after the revocation: take the
            # pending cancellation now, so it does not hit the caller later.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
        if task.uncancel() == 0 and exc_type in (None, asyncio.CancelledError):
            raise LeaseRevoked(lease.id, lease.provider.node_id, lease.generation) from None
