"""The trio layer's lease hand-off: parks waiters, wakes them, opens and closes lease bodies.

It never decides: :class:`iop_admission.core.AdmissionState` does, and this
module carries the decisions out (see :mod:`iop_admission._admission` for the
rules). The I/O bookkeeping lives here, in maps keyed by the core's objects:
the parked task and deadline scope of each queued waiter, and the cancel scope
of each lease body (fencing cancels it).
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import final

import outcome
import trio

from iop_admission._errors import LeaseRevoked, QueueTimeout
from iop_admission.core import AdmissionState, Decision, Ejected, Failed, Granted, Lease, Revoked, Waiter

from .events import AdmissionEvent, HealthNews, health_event
from .trio_events import EventFanout, now_or_none

__all__ = ["Handoff"]


@final
class Handoff:
    """Carries the core's decisions out under trio, and runs both halves of a lease scope."""

    __slots__ = ("core", "events", "ejection_wakeup", "_parked", "_bodies")

    def __init__(self, core: AdmissionState, events: EventFanout) -> None:
        self.core = core
        self.events = events
        self.ejection_wakeup: trio.Event | None = None  # set when a new ejection starts
        self._parked: dict[Waiter, tuple[trio.lowlevel.Task, trio.CancelScope]] = {}  # queued: (task, deadline scope)
        self._bodies: dict[Lease, trio.CancelScope] = {}  # live leases' body scopes (fencing cancels them)

    # -------------------------------------------------------------- decisions

    def apply(self, decisions: list[Decision]) -> None:
        """Carry out core decisions: wake granted/failed waiters, cancel revoked bodies."""
        for d in decisions:
            if type(d) is Granted:
                trio.lowlevel.reschedule(self._parked.pop(d.waiter)[0], outcome.Value(d.lease))
            elif type(d) is Failed:
                trio.lowlevel.reschedule(self._parked.pop(d.waiter)[0], outcome.Error(d.error))
            elif type(d) is Revoked:
                scope = self._bodies.get(d.lease)
                if scope is not None:
                    scope.cancel()
                if self.events.subscribers:
                    self.events.lease("revoked", d.lease)
            else:
                self._health_event(d)

    def _health_event(self, d: HealthNews) -> None:
        if type(d) is Ejected and self.ejection_wakeup is not None:
            self.ejection_wakeup.set()  # a new end time for watch_ejections
        if self.events.subscribers:
            self.events.emit(health_event(now_or_none(), d))

    @trio.lowlevel.enable_ki_protection
    def advance(self, now: float) -> None:
        """End the ejections whose time has come (their probes may go to waiters)."""
        end = self.core.next_ejection_end()
        if end is not None and end <= now:
            self.apply(self.core.advance(now))

    def rearm_deadlines(self) -> None:
        """Move every parked waiter's deadline scope to the core's (possibly refreshed) deadline."""
        for waiter, (_, scope) in self._parked.items():
            scope.deadline = waiter.deadline

    # ----------------------------------------------------- lease scope halves

    @trio.lowlevel.enable_ki_protection
    async def acquire(
        self,
        model: str,
        long: bool,
        retry_of: Lease | None,
        reason: str | None,
        tenant: str | None = None,
        cost: float = 1.0,
        revocable: bool = True,
        tokens: int | None = None,
    ) -> Lease:
        """Grant a lease (a retry of ``retry_of`` if given), waiting in the queue if need be,
        and open its body's cancel scope (``revocable``; otherwise the body has none).

        Checkpoints. Cancellation-atomic: returns a lease whose body scope is
        open, or raises and leaves no change behind.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        core = self.core
        events = self.events
        now = trio.current_time()
        self.advance(now)
        try:
            if retry_of is None:
                result = core.request(model, long, now, tenant, cost, tokens)
            else:
                result = core.retry(retry_of, now)
        except Exception as exc:
            if events.subscribers:
                events.rejected(model, long, exc)
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        shed = core.drain_decisions()  # waiters of a lower negative band evicted for this request
        if shed:
            self.apply(shed)
        if retry_of is not None and events.subscribers:
            events.lease("retried", retry_of, attempt=retry_of.attempt + 1, reason=reason)
        scope: trio.CancelScope | None = None
        if type(result) is Lease:
            lease = result
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            assert type(result) is Waiter
            lease, scope = await self._wait(result, now)
        if lease._revoked:  # fenced since the grant: the body never runs on an offline generation
            self._give_back(lease, scope)
            raise LeaseRevoked(lease.id, lease.provider.node_id, lease.generation)
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:  # cancelled since the grant: the body never starts, as under asyncio
            self._give_back(lease, scope)
            raise
        self._open_body(lease, scope, revocable)
        if events.subscribers:
            events.lease("granted", lease, waited=lease.queue_wait)
        return lease

    def _open_body(self, lease: Lease, scope: trio.CancelScope | None, revocable: bool) -> None:
        """Give the body of ``lease`` its cancel scope (``scope``, the queue's, still open, or a new
        one), the one fencing cancels; none if not ``revocable`` (the queue's scope closes).

        Nothing here awaits; if anything raises, the grant goes back before the error propagates.
        """
        if not revocable:  # no body scope: fencing does not cancel the body (the queue's scope closes)
            if scope is not None:
                scope.__exit__(None, None, None)
            return
        if scope is None:
            try:
                scope = trio.CancelScope()
                scope.__enter__()
            except BaseException:
                self.apply(self.core.release(lease))
                raise
        self._bodies[lease] = scope

    def _give_back(self, lease: Lease, scope: trio.CancelScope | None) -> None:
        """Close the scope of a grant whose body will not start and release the lease: its
        capacity comes back at once (fenced, or cancelled, between the grant and the body)."""
        if scope is not None:
            scope.__exit__(None, None, None)
        self.apply(self.core.release(lease))

    async def _wait(self, waiter: Waiter, asked: float) -> tuple[Lease, trio.CancelScope | None]:
        """Park until granted, failed, cancelled or past the deadline (``asked``: the time of the
        request, or for a retry the time it asked again; ``queue_wait`` counts from it).

        Checkpoints (it blocks). Past its deadline the core expires the waiter;
        cancelled before, it is withdrawn. Either way nothing else changes.

        Granted, it returns the lease and, still open, the scope that carried
        the queue deadline, its deadline lifted: it becomes the body's scope
        (one cancel scope per queued lease instead of two). None instead if
        that deadline fired in the same tick as the grant (the caller then
        opens a fresh scope, so the body is not cancelled by a queue deadline).
        """
        core = self.core
        events = self.events
        if events.subscribers:
            tenant = waiter.tenant if waiter._ticket is not None else None  # as lease events
            events.emit(AdmissionEvent("queued", now_or_none(), model=waiter.model, long=waiter.long, tenant=tenant))

        def abort(_: object) -> trio.lowlevel.Abort:
            core.expire(trio.current_time())  # this waiter too, if its deadline is what fired
            core.withdraw(waiter)  # a no-op once expired
            freed = core.drain_decisions()  # grants the headroom it held allows [token-ledger]
            if freed:
                self.apply(freed)
            return trio.lowlevel.Abort.SUCCEEDED

        timer = trio.CancelScope(deadline=waiter.deadline)
        timer.__enter__()
        self._parked[waiter] = (trio.lowlevel.current_task(), timer)
        try:
            lease: Lease = await trio.lowlevel.wait_task_rescheduled(abort)
        except BaseException as exc:
            self._parked.pop(waiter, None)
            if not timer.__exit__(type(exc), exc, exc.__traceback__):
                if events.subscribers and not isinstance(exc, trio.Cancelled):
                    events.rejected(waiter.model, waiter.long, exc)
                raise
            # Our own deadline fired (the scope swallowed its Cancelled): a timeout.
        else:
            granted = trio.current_time()
            lease.queue_wait = granted - asked
            # What ``timer.cancel_called`` reads (and its own clock read): the deadline moves only
            # while the waiter is parked, nothing else cancels this scope, and the clock only goes on.
            if granted >= timer.deadline:
                timer.__exit__(None, None, None)
                return lease, None
            timer.deadline = math.inf
            return lease, timer
        waited = trio.current_time() - waiter.enqueue_time
        if events.subscribers:
            events.emit(AdmissionEvent("timed_out", now_or_none(), model=waiter.model, long=waiter.long, waited=waited))
        raise QueueTimeout(waiter.model, waited)

    @trio.lowlevel.enable_ki_protection
    def release(
        self,
        lease: Lease,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        """Close the body's scope (if it has one) and release the lease; whether the scope swallowed ``exc``.

        Synchronous on purpose: a cancelled task cannot skip the release.
        """
        scope = self._bodies.pop(lease, None)
        try:
            suppressed = scope.__exit__(exc_type, exc, tb) if scope is not None else False
        finally:
            decisions = self.core.release(lease)
            if decisions:
                self.apply(decisions)
            if self.events.subscribers:
                self.events.lease("released", lease)
        if lease._revoked and (suppressed or exc_type is None):
            raise LeaseRevoked(lease.id, lease.provider.node_id, lease.generation) from None
        return bool(suppressed)
