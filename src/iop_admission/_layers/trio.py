"""The trio layer of admission: parks, wakes, times out and cancels.

It never decides: :class:`iop_admission.core.AdmissionState` does, and this
module carries the decisions out.

Rules this module implements (and why):

* **Hand-off.** A queued request parks in ``wait_task_rescheduled``. The core
  grants it synchronously when capacity appears and we reschedule the task
  with the lease as its value. Trio calls the abort function only for a task
  that is still parked, so a waiter is either granted *or* withdrawn, never
  both -- there is no window where a grant can be lost.

* **Cancellation-atomic.** ``__aenter__`` either returns a lease or leaves no
  change behind. Cancellation (or the queue deadline) while parked withdraws
  the waiter in the abort function. A cancellation that arrives after the
  grant but before the task resumes gives the grant back and raises: the body
  never starts, as under asyncio. After that check there is no await before
  the lease is handed to the caller; should anything between the grant and the
  return raise, the grant is released before the exception propagates.

* **Release is synchronous and happens once.** ``__aexit__`` never awaits; it
  releases through the core, once (a revoked lease too: fencing only revokes
  it). Release is by scope exit only -- never by a callback that an event
  fan-out could drop.

* **Fencing cancels the body.** Each lease body runs inside its own cancel
  scope. When the core revokes a lease (its node generation was fenced) the
  scope is cancelled, and the ``async with`` raises :class:`LeaseRevoked`.
  The lease's capacity comes back at that scope's exit, not before
  ([revoked-in-flight]): a body runs to its next checkpoint, or longer if it
  shields itself, and holds its provider's capacity all that time.

* **Deadlines live in the core.** The waiter's cancel scope only mirrors
  ``waiter.deadline``; a refresh that changes the queue timeout moves every
  parked waiter's scope deadline to ``enqueue_time + new timeout``. When a
  deadline fires, the core's ``expire`` removes the waiter (and any other whose
  deadline passed, in arrival order): the path the state machine proves is the
  one that runs. A cancellation before the deadline withdraws the waiter.

* **The I/O bookkeeping stays in this layer.** The parked task and deadline
  scope of each waiter, and the cancel scope of each lease body, live in the
  hand-off's maps (``_handoff``) keyed by the core's objects; the core's objects
  carry no I/O state. The ``async with`` shell is ``_lease_scope``, the event
  fan-out ``_trio_events``; this module is the facade that ties them together.

* **No Ctrl-C inside a state change.** ``connect``, ``disconnect``,
  ``refresh``, health reports, ejection ends and both halves of a lease scope
  (a retry's too) run with trio's
  ``enable_ki_protection``, as trio's own ``Lock`` and ``CapacityLimiter`` do:
  a ``KeyboardInterrupt`` is delivered after the core's counters, queue and the
  lease's scope agree again, never half-way through a grant or a release.

* **Ejections end on time.** :meth:`Admission.watch_ejections` sleeps until
  the core's next ejection end and calls ``advance`` then, so the probe is
  granted to a waiter at that instant; every lease request and report also
  advances first, so without the watcher an ejection ends at the next call.

* **Events are best effort.** Subscribers get lifecycle events through
  bounded memory channels; a full channel drops the event and counts it. No
  correctness path reads events.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import NoReturn, final

import trio

from iop_admission._config import PoolConfig, ProviderKey, ProviderReport
from iop_admission._errors import NodeNotFound
from iop_admission.core import AdmissionState, Lease, PreparedRefresh

from .events import AdmissionEvent
from .lease_scope import LeaseScope
from .readings import Readings
from .trio_events import EventFanout, now_or_none
from .trio_handoff import Handoff

__all__ = ["Admission", "AdmissionEvent", "Lease", "LeaseScope"]


@final
class Admission(Readings):
    """Provider-wide leases, one fair global queue, connectivity generations.

    Args:
        config: the pool configuration.

    Raises:
        ConfigError: listing every problem of ``config``.

    ``connect``, ``disconnect``, ``refresh`` and ``snapshot`` are synchronous
    and work with or without a running trio loop; ``lease`` and ``subscribe``
    need one. The queries (``config``, ``snapshot``, ``waiters``...) are the
    asyncio layer's too (:class:`~iop_admission._layers.readings.Readings`).
    """

    def __init__(self, config: PoolConfig) -> None:
        core = AdmissionState(config)
        self._events = events = EventFanout()
        super().__init__(core, now_or_none, events)
        self._handoff = Handoff(core, events)

    # ------------------------------------------------------------------ leases

    def lease(
        self,
        model: str,
        *,
        long: bool = False,
        tenant: str | None = None,
        cost: float = 1.0,
        revocable: bool = True,
        tokens: int | None = None,
    ) -> LeaseScope:
        """Ask for a lease on one of ``model``'s candidates.

        Use as ``async with admission.lease(model, long=...) as lease:``. The lease is released when
        the block exits, whichever way it exits.

        ``tenant``: the configured tenant the request is charged to (None, or a name not configured:
        the default tenant); ``cost``: its reserved cost, 1 per request or estimated tokens
        (:meth:`settle` replaces it with the usage). With ``PoolConfig.tenants`` the queue is served
        by band, then weighted fair share, then FIFO within a tenant. ``tokens``: its prompt plus
        ``max_tokens``, held on a provider with a token budget until the exit ([token-ledger]).

        ``revocable=False``: the body gets no cancel scope of its own, so fencing its node generation
        does not cancel it (it runs to its end); for short bodies that need no revocation, at a lower
        cost. Its capacity counts until it leaves, as for any revoked lease, and the exit still raises
        ``LeaseRevoked`` if the lease was revoked while it ran.

        Entering checkpoints. It returns at once when a candidate is
        dispatchable, otherwise waits in the global queue. Cancelled while
        waiting, it leaves the queue and nothing else changes.

        Raises (on entry):
            ModelNotFound: unknown model (also if a refresh removes it while waiting).
            Unavailable: no eligible candidate, or none whose budget holds ``tokens`` (now or after a disconnect/refresh).
            QueueFull: the global queue holds ``max_queue`` waiters.
            TenantLimitExceeded: the tenant's ``max_queue`` is reached, or the
                request is of a negative band and was shed (``limit`` names which).
            QueueTimeout: no grant before the queue deadline.

        Raises (on exit):
            LeaseRevoked: the lease's node generation was fenced while the body ran.
        """
        return LeaseScope(self._handoff, model, long, None, None, tenant, cost, revocable, tokens)

    def settle(self, lease: Lease, actual: float) -> None:
        """Charge ``lease``'s tenant the cost it used (tokens the backend reported) instead of its reserve."""
        self._core.settle(lease, actual)

    def settle_tokens(self, lease: Lease, used: int) -> None:
        """Set ``lease``'s reservation to the ``used`` tokens (0 once its stream ended); freed room goes to waiters."""
        self._handoff.apply(self._core.settle_tokens(lease, used))

    def retry(self, lease: Lease, *, reason: str | None = None) -> LeaseScope:
        """Ask again, for the request ``lease`` served, on a candidate it has not tried.

        Use as ``async with admission.retry(lease, reason=...) as lease2:``
        once ``lease``'s run failed before any byte reached the client
        ([failover-before-first-byte]). The retry keeps the request's place in
        arrival order and its queue deadline; ``lease2.attempt`` is one more.
        Entering checkpoints and behaves like :meth:`lease` (cancellation while
        waiting leaves no trace). ``reason`` goes into the ``retried`` event.

        Raises (on entry):
            RetriesExhausted: ``lease`` was the last of ``retry.max_attempts`` attempts.
            QueueTimeout: the request's queue deadline passed (before or while waiting).
            Unavailable: no eligible candidate that was not tried.
            ModelNotFound: the model was removed.
            RuntimeError: ``lease`` was retried before.
        """
        return LeaseScope(self._handoff, lease.model, lease.long, retry_of=lease, reason=reason)

    @trio.lowlevel.enable_ki_protection
    def report_failure(self, lease: Lease) -> None:
        """Count a provider failure of ``lease`` ([outlier-ejection]); may eject its provider.

        Once per lease: a second report, or one for a lease granted before its
        provider's last ejection or restore or its node's reconnect, changes
        nothing. Synchronous; uses ``trio.current_time()`` inside trio. Ends the
        ejections whose time has come first, as a lease request does.
        """
        now = self._clock()
        self._handoff.advance(now)
        self._handoff.apply(self._core.report_failure(lease, now))

    @trio.lowlevel.enable_ki_protection
    def report_success(self, lease: Lease) -> None:
        """Count a success of ``lease``: resets its provider's failures; restores it if ejected.

        Once per lease, like :meth:`report_failure`. Synchronous.
        """
        now = self._clock()
        self._handoff.advance(now)
        self._handoff.apply(self._core.report_success(lease, now))

    @trio.lowlevel.enable_ki_protection
    def report_health(self, provider: ProviderKey, report: ProviderReport) -> None:
        """A node's report of ``provider``'s own health ([health-probe]; docs/admission.md, Active
        health). Synchronous; ends the ejections whose time has come first, as a lease's report does."""
        now = self._clock()
        self._handoff.advance(now)
        self._handoff.apply(self._core.report_health(provider, report, now))

    async def watch_ejections(self) -> NoReturn:
        """End each ejection at its time, so its probe can go to a waiter at once.

        Runs until cancelled; start it in a nursery beside the users of this
        admission. Checkpoints (it sleeps). Without it an ejection ends at the
        next lease request or report after its time.

        Raises:
            RuntimeError: not inside ``trio.run`` (under asyncio: ``AsyncAdmission``).
        """
        _need_trio("watch_ejections")
        while True:
            self._handoff.ejection_wakeup = wakeup = trio.Event()
            self._handoff.advance(trio.current_time())
            end = self._core.next_ejection_end()
            with trio.move_on_at(math.inf if end is None else end):
                await wakeup.wait()

    @trio.lowlevel.enable_ki_protection
    def connect(self, node_id: str) -> int:
        """Start a new generation of ``node_id`` and bring its providers online.

        If the node was already connected, the old generation is fenced first.
        Waiters are re-evaluated at once.

        Returns:
            The new generation.

        Raises:
            NodeNotFound: no configuration so far had a provider on ``node_id``
                (a typo, most likely); nothing changed.
        """
        if not self._core.knows_node(node_id):
            raise NodeNotFound(node_id, self._core.nodes())
        generation, decisions = self._core.connect(node_id)
        self._handoff.apply(decisions)
        if self._events.subscribers:
            self._events.emit(AdmissionEvent("connected", now_or_none(), node_id=node_id, generation=generation))
        return generation

    @trio.lowlevel.enable_ki_protection
    def disconnect(self, node_id: str, generation: int) -> bool:
        """Take ``node_id`` offline if ``generation`` is its current generation.

        Fences the generation: every lease on the node's providers is revoked
        at once (``in_flight`` reads 0 immediately) and its body is cancelled;
        its capacity stays counted as ``revoked_in_flight`` until the body has
        left its ``async with``. Waiters fall back to remaining providers or
        fail with :class:`Unavailable` at once.

        Returns:
            False, with no effect, for a stale generation or a node not connected.
        """
        done, decisions = self._core.disconnect(node_id, generation)
        if done:
            self._handoff.apply(decisions)
            if self._events.subscribers:
                self._events.emit(AdmissionEvent("disconnected", now_or_none(), node_id=node_id, generation=generation))
        return done

    @trio.lowlevel.enable_ki_protection
    def hold(self, provider: ProviderKey, runs: int, long_runs: int = 0) -> None:
        """Count ``runs`` held elsewhere against ``provider``'s capacity, ``long_runs`` of them
        against its long-context slots too [held-elsewhere].

        Runs this pool did not grant but that use the provider all the same
        (another Edge's, still running on the node) count in its
        ``in_flight`` (the long ones in ``long_in_flight``) until a later call
        lowers the counts (0 ends them) or the node's generation ends
        (``disconnect``, ``connect``). A lower count hands the room to waiters
        at once. A provider not configured, or whose node is not connected, is
        left as it is.

        Raises:
            ValueError: ``runs`` is negative, or ``long_runs`` is negative or more than ``runs``.
        """
        self._handoff.apply(self._core.hold(provider, runs, long_runs))

    def prepare_refresh(self, config: PoolConfig, *, pause: Callable[[], None] | None = None) -> PreparedRefresh:
        """Validate ``config`` and work out what it changes, for :meth:`refresh` to apply.

        Reads only the configuration in force (no lease, waiter or node
        state), so it is safe to call in a worker thread while this admission
        serves; it changes nothing. ``refresh(prepared)`` then has the outcome
        of ``refresh(config)`` whatever happened in between, and touches only
        what changed if the configuration in force is still the one prepared
        against. O(providers + candidates). ``pause``: called every few dozen
        providers and candidates (a worker thread's chance to let the loop run).

        Raises:
            ConfigError: listing every problem of ``config``.
        """
        return self._core.prepare_refresh(config, pause)

    @trio.lowlevel.enable_ki_protection
    def refresh(self, config: PoolConfig | PreparedRefresh) -> None:
        """Replace the configuration atomically; existing leases are kept.

        ``config``: a :class:`PoolConfig`, or what :meth:`prepare_refresh`
        made of one (same outcome; see there).

        Raises:
            ConfigError: listing every problem; nothing changed.
        """
        decisions = self._core.refresh(config)
        self._handoff.rearm_deadlines()
        self._handoff.apply(decisions)
        if self._events.subscribers:
            self._events.emit(AdmissionEvent("refreshed", now_or_none()))

    # ------------------------------------------------------------------ events

    @asynccontextmanager
    async def subscribe(self, buffer: int = 256) -> AsyncIterator[trio.MemoryReceiveChannel[AdmissionEvent]]:
        """Receive lifecycle events through a channel holding up to ``buffer`` events.

        When the channel is full, new events are dropped and counted in
        :attr:`Snapshot.events_dropped`; admission never waits for a subscriber.

        Entering and leaving do not block (leaving closes the channel).

        Raises:
            RuntimeError: not inside ``trio.run`` (under asyncio: ``AsyncAdmission``).
        """
        _need_trio("subscribe")
        async with self._events.subscribe(buffer) as receive:
            yield receive

    def __repr__(self) -> str:
        return f"<Admission {self._core!r}>"


def _need_trio(call: str) -> None:
    """Raise a RuntimeError naming the asyncio layer when ``Admission.<call>()`` runs outside trio."""
    if not trio.lowlevel.in_trio_run():
        raise RuntimeError(
            f"Admission.{call}() runs under trio only; under asyncio use iop_admission.aio.AsyncAdmission"
        )
