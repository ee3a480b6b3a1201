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
  (``Task.uncancel``) and raises :class:`~iop_admission.LeaseRevoked`; its
  capacity stays counted (``revoked_in_flight``) until the body has left the
  ``async with``, however long a body that catches the cancellation runs on;
* a waiter past its queue deadline gets :class:`~iop_admission.QueueTimeout`;
  ``refresh`` re-arms every queued waiter's timer to its new deadline;
* ``subscribe()`` delivers the trio layer's lifecycle events
  (:class:`~iop_admission.AdmissionEvent`) as an async iterator, best effort;
* it has the same calls as :class:`iop_admission.Admission`, with the same
  parameters (``tests/library/test_layer_parity.py`` compares them), and the
  synchronous ones work with or without a running loop, as there;
* a lease asked for outside a running asyncio loop -- under trio, say -- raises
  a ``RuntimeError`` that names the layer to use.

The differences that remain between the layers are one table in
docs/admission.md ("One library on two layers"). The futures, timers and body
tasks live in the hand-off (``_aio_handoff.py``); this module is the facade.

Times are the running loop's ``loop.time()``. Like ``asyncio.Lock``, an
:class:`AsyncAdmission` belongs to the loop that first uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import NoReturn, final

from ._config import PoolConfig, ProviderKey, ProviderReport
from ._errors import LeaseScopeError, NodeNotFound
from ._layers.aio_handoff import AsyncHandoff, now_or_none, running_loop
from ._layers.events import AdmissionEvent
from ._layers.readings import Readings
from .core import AdmissionState, Lease, PreparedRefresh

__all__ = ["AsyncAdmission", "AsyncLeaseScope"]


@final
class AsyncAdmission(Readings):
    """Provider-wide leases, one fair global queue, connectivity generations, for asyncio.

    Args:
        config: the pool configuration.

    Raises:
        ConfigError: listing every problem of ``config``.

    ``connect``, ``disconnect``, ``refresh``, ``snapshot`` and the other
    synchronous calls work with or without a running loop; ``lease``,
    ``retry``, ``subscribe`` and ``watch_ejections`` need one. The queries
    (``config``, ``snapshot``, ``waiters``...) are the trio layer's
    (:class:`~iop_admission._layers.readings.Readings`).
    """

    def __init__(self, config: PoolConfig) -> None:
        core = AdmissionState(config)
        self._handoff = handoff = AsyncHandoff(core)
        super().__init__(core, now_or_none, handoff)

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
    ) -> AsyncLeaseScope:
        """Ask for a lease on one of ``model``'s candidates: ``async with admission.lease(model) as lease:``.

        ``tenant``, ``cost``, ``revocable`` and ``tokens`` as :meth:`iop_admission.Admission.lease`
        (``revocable=False``: fencing does not cancel the body's task).
        Raises (on entry): ``ModelNotFound``, ``Unavailable``, ``QueueFull``,
        ``TenantLimitExceeded``, ``QueueTimeout``, as :meth:`iop_admission.Admission.lease`,
        and ``RuntimeError`` outside a running asyncio loop (under trio: use ``Admission``).
        Raises (on exit): ``LeaseRevoked`` when fencing cancelled the body.
        """
        return AsyncLeaseScope(self._handoff, model, long, None, tenant, cost, None, revocable, tokens)

    def settle(self, lease: Lease, actual: float) -> None:
        """Charge ``lease``'s tenant the cost it used instead of its reserve (see ``Admission.settle``)."""
        self._core.settle(lease, actual)

    def settle_tokens(self, lease: Lease, used: int) -> None:
        """Replace ``lease``'s token reservation with the ``used`` tokens (see ``Admission.settle_tokens``)."""
        self._handoff.apply(self._core.settle_tokens(lease, used))

    def retry(self, lease: Lease, *, reason: str | None = None) -> AsyncLeaseScope:
        """Ask again for the request ``lease`` served, on a candidate not tried (see ``Admission.retry``).

        ``reason`` goes into the ``retried`` event.
        """
        return AsyncLeaseScope(self._handoff, lease.model, lease.long, lease, reason=reason)

    def report_failure(self, lease: Lease) -> None:
        """Count a provider failure of ``lease``; may eject its provider (see ``Admission.report_failure``)."""
        self._handoff.apply(self._core.report_failure(lease, self._clock()))

    def report_success(self, lease: Lease) -> None:
        """Count a success of ``lease``; restores its provider if ejected."""
        self._handoff.apply(self._core.report_success(lease, self._clock()))

    def report_health(self, provider: ProviderKey, report: ProviderReport) -> None:
        """A node's report of ``provider``'s own health (see ``Admission.report_health``)."""
        self._handoff.apply(self._core.report_health(provider, report, self._clock()))

    async def watch_ejections(self) -> NoReturn:
        """Wait until cancelled: under asyncio each ejection already ends at its time, on a loop
        timer of this layer's own. Here so that code written for either layer (which starts
        ``watch_ejections`` beside the users of the admission) runs on both."""
        running_loop("watch_ejections")
        await asyncio.Event().wait()  # set by nobody: ends by cancellation only
        raise AssertionError("an event nobody sets was set")  # pragma: no cover

    # ----------------------------------------------------- nodes and config

    def connect(self, node_id: str) -> int:
        """Start a new generation of ``node_id`` and bring its providers online; return the generation."""
        if not self._core.knows_node(node_id):
            raise NodeNotFound(node_id, self._core.nodes())
        generation, decisions = self._core.connect(node_id)
        handoff = self._handoff
        handoff.apply(decisions)
        if handoff.subscribers:
            handoff.emit(AdmissionEvent("connected", now_or_none(), node_id=node_id, generation=generation))
        return generation

    def disconnect(self, node_id: str, generation: int) -> bool:
        """Fence ``generation`` of ``node_id``: its leases are revoked; False if stale (no effect).

        A revoked lease's capacity stays counted (``revoked_in_flight``) until its body has left.
        """
        done, decisions = self._core.disconnect(node_id, generation)
        handoff = self._handoff
        handoff.apply(decisions)
        if done and handoff.subscribers:
            handoff.emit(AdmissionEvent("disconnected", now_or_none(), node_id=node_id, generation=generation))
        return done

    def hold(self, provider: ProviderKey, runs: int, long_runs: int = 0) -> None:
        """Count ``runs`` held elsewhere against ``provider``'s capacity, ``long_runs`` of them against
        its long slots too (see ``Admission.hold``)."""
        self._handoff.apply(self._core.hold(provider, runs, long_runs))

    def prepare_refresh(self, config: PoolConfig, *, pause: Callable[[], None] | None = None) -> PreparedRefresh:
        """Validate ``config`` for :meth:`refresh`; safe in a worker thread (see ``Admission.prepare_refresh``)."""
        return self._core.prepare_refresh(config, pause)

    def refresh(self, config: PoolConfig | PreparedRefresh) -> None:
        """Replace the configuration atomically; leases are kept, queue deadlines move with the timeout."""
        decisions = self._core.refresh(config)
        handoff = self._handoff
        handoff.rearm_deadlines()
        handoff.apply(decisions)
        if handoff.subscribers:
            handoff.emit(AdmissionEvent("refreshed", now_or_none()))

    # ------------------------------------------------------------------ events

    @asynccontextmanager
    async def subscribe(self, buffer: int = 256) -> AsyncIterator[AsyncIterator[AdmissionEvent]]:
        """``async with admission.subscribe() as events: async for event in events: ...``

        Events queue in a buffer of ``buffer``; when it is full an event is
        dropped and counted in :attr:`events_dropped`. No correctness path
        reads events.
        """
        running_loop("subscribe")
        queue: asyncio.Queue[AdmissionEvent] = asyncio.Queue(buffer)
        subscribers = self._handoff.subscribers
        subscribers.append(queue)
        try:
            yield _events(queue)
        finally:
            subscribers.remove(queue)

    def __repr__(self) -> str:
        return f"<AsyncAdmission {self._core!r}>"


async def _events(queue: asyncio.Queue[AdmissionEvent]) -> AsyncIterator[AdmissionEvent]:
    while True:
        yield await queue.get()


@final
class AsyncLeaseScope:
    """What :meth:`AsyncAdmission.lease` returns: a single-use async context manager."""

    __slots__ = (
        "_handoff",
        "_model",
        "_long",
        "_retry_of",
        "_lease",
        "_state",
        "_tenant",
        "_cost",
        "_reason",
        "_revocable",
        "_tokens",
    )

    def __init__(
        self,
        handoff: AsyncHandoff,
        model: str,
        long: bool,
        retry_of: Lease | None,
        tenant: str | None = None,
        cost: float = 1.0,
        reason: str | None = None,
        revocable: bool = True,
        tokens: int | None = None,
    ) -> None:
        self._handoff = handoff
        self._tokens = tokens
        self._reason = reason
        self._tenant = tenant
        self._cost = cost
        self._model = model
        self._long = long
        self._retry_of = retry_of
        self._revocable = revocable
        self._lease: Lease | None = None
        self._state = "new"

    async def __aenter__(self) -> Lease:
        if self._state != "new":
            raise LeaseScopeError("a lease scope can be entered only once")
        self._state = "entering"
        handoff = self._handoff
        task = handoff.cached()
        if task is not None:
            loop = handoff.loop
            assert loop is not None
        else:  # raises outside a running loop, saying why
            loop, task = handoff.running("retry" if self._retry_of is not None else "lease")
        now = loop.time()
        result = handoff.ask(
            now, self._model, self._long, self._retry_of, self._tenant, self._cost, self._reason, self._tokens
        )
        lease = result if type(result) is Lease else await handoff.queued(result, now, loop)
        self._lease = handoff.open(lease, task, self._revocable)
        self._state = "entered"
        return lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        lease = self._lease
        if self._state != "entered" or lease is None:
            raise LeaseScopeError(f"a lease scope can be exited once, after it was entered (it is {self._state})")
        self._state = "exited"
        task = self._handoff.close(lease, exc_type)
        if task is not None:
            await self._handoff.revoked(lease, task, exc_type)
