"""The public sans-I/O admission core, for event loops other than trio.

:class:`AdmissionState` does no I/O, reads no clock (every call that needs the
time takes ``now``, any monotonic float in seconds), creates no task and is
not thread-safe: call it from one thread, the one running your event loop. Both
layers shipped with the library are built on exactly the names below --
:class:`iop_admission.Admission` (trio) and
:class:`iop_admission.aio.AsyncAdmission` (asyncio) -- so a layer for another
loop needs nothing private.

The contract a layer must keep:

* **Ask.** ``request(model, long, now)`` returns a :class:`Lease` (granted now)
  or a queued :class:`Waiter`; it raises ``ModelNotFound``, ``Unavailable`` or
  ``QueueFull`` and then changes nothing. ``retry(lease, now)`` does the same
  for a failed attempt, keeping its arrival place and queue deadline.
* **Decisions.** Every call that may free or fence capacity (``release``,
  ``connect``, ``disconnect``, ``refresh``, ``report_failure``,
  ``report_success``, ``advance``, ``hold``) returns a list of decisions the layer must
  carry out *in order*, before it calls the core again from another task:
  :class:`Granted` (wake ``waiter``'s task with ``lease``: from this instant the
  task owns the lease, even if it has not run yet), :class:`Failed` (wake it
  with ``error``), :class:`Revoked` (cancel the lease's body; its capacity
  stays counted, as ``revoked_in_flight``, until the layer releases the lease
  when the body has exited), :class:`Ejected` and :class:`Restored` (health news; call
  ``advance(now)`` at ``next_ejection_end()`` to end an ejection on time), and
  :class:`BudgetChanged` (``report_health`` or ``connect``: the engine's report moved a
  provider's effective token budget; news only, nothing to carry out).
* **Waiting.** A queued waiter leaves the queue exactly once: granted, failed,
  ``withdraw(waiter)`` (its task was cancelled; False when a grant or failure
  came first -- then a granted lease must be released by the layer), or
  ``expire(now)``, which removes and returns every waiter whose ``deadline`` is
  ``<= now`` (the layer fails them with ``QueueTimeout``). ``deadline`` may
  move on ``refresh`` (it is ``enqueue_time + queue_timeout``): re-arm timers
  after each refresh. After ``withdraw`` or ``expire``, carry out
  ``drain_decisions()``: a waiter whose tokens were held as headroom
  ([token-ledger]) gives them back as it leaves, and others may be granted.
* **Release.** ``release(lease)`` exactly once per grant on every path, when
  the lease's body has exited -- a revoked one too (``lease.revoked``): its
  capacity comes back only then. A lease revoked before its body started is
  released at once. ``release`` is idempotent (a second call changes nothing).
* **Reading.** :func:`read_snapshot` is the :class:`~iop_admission.Snapshot` a
  layer serves, read in one synchronous step; :func:`waiter_snapshots` the rows of
  the waiters it lists.

The tenants' parts are public too, for a model or a test that checks them on their
own: :class:`FairShare` (the ordering rule, over :class:`Ticket`s, the unnamed tenant
:data:`DEFAULT_TENANT`) and :class:`Tenancy` (the core's tenants and their shares over
the last :data:`RECENT_GRANTS` grants). So is the token budget's:
:class:`TokenLedger` (one provider's reservations and the headroom rule, [token-ledger]) and
:func:`reservation` (prompt plus output, bounded by the window).

Stability promise: the names in ``__all__`` and the contract above follow
semantic versioning from 1.0 on; before 1.0 a change to them is named in the
release notes. Attributes not documented on these classes are private.
"""

from __future__ import annotations

from ._core.records import (
    BudgetChanged,
    Decision,
    Ejected,
    Failed,
    Granted,
    Lease,
    Restored,
    Revoked,
    Waiter,
    WaiterState,
)
from ._core.refresh import PreparedRefresh, prepare_refresh
from ._core.state import AdmissionState
from ._core.tenants import RECENT_GRANTS, Tenancy
from ._fairness import DEFAULT_TENANT, FairShare, Ticket
from ._ledger import TokenLedger, engine_cut, reservation
from ._snapshot import Snapshot
from ._waiting import waiter_snapshots

__all__ = [
    "DEFAULT_TENANT",
    "RECENT_GRANTS",
    "AdmissionState",
    "BudgetChanged",
    "Decision",
    "Ejected",
    "Failed",
    "FairShare",
    "Granted",
    "Lease",
    "PreparedRefresh",
    "Restored",
    "Revoked",
    "Tenancy",
    "Ticket",
    "TokenLedger",
    "Waiter",
    "WaiterState",
    "engine_cut",
    "prepare_refresh",
    "read_snapshot",
    "reservation",
    "waiter_snapshots",
]


def read_snapshot(
    state: AdmissionState, now: float | None, *, events_dropped: int = 0, first: int = 0, count: int | None = None
) -> Snapshot:
    """The :class:`~iop_admission.Snapshot` of ``state`` at ``now`` (None: the last time the state saw).

    ``events_dropped`` is the layer's own count of events its subscribers
    missed; ``first``/``count`` select the configured providers at those
    positions of the config order, as ``Admission.snapshot`` does.
    """
    policy = state.config.policy
    return Snapshot(
        queue_depth=state.queue_depth,
        max_queue=policy.max_queue,
        queue_timeout=policy.queue_timeout,
        events_dropped=events_dropped,
        providers=state.provider_snapshots(now, first, count),
        panic=state.panic_models(),
        tenants=state.tenant_snapshots(),
    )
