"""The invariants the library promises, checked after every step of a program and at its end.

Each check reads the admission through its public readings (``snapshot``,
``queue_depth``, ``config``, ``is_connected``, ``generation``, the lifecycle
events) plus the core's list of live leases, which also holds the leases on
providers a refresh removed (the snapshot shows configured providers only).
The calls of the code under test are seen from outside, as :class:`Call`.
A broken promise raises :class:`AssertionError` naming it.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any, final

import attrs

from iop_admission import AdmissionError, AdmissionEvent, ConfigError, LeaseScopeError, ModelGroup, NodeNotFound
from iop_admission.core import AdmissionState, Lease

from ._calls import BodyFailed, Call

__all__ = ["Books", "check_end", "check_step"]


def core_of(admission: Any) -> AdmissionState:
    """The sans-I/O core both layers are built on (its live leases include removed providers')."""
    core = admission._core
    assert isinstance(core, AdmissionState)
    return core


@final
@attrs.define(eq=False)
class Books:
    """What the checks remember between steps: the leases live at the last check, and the events."""

    live: dict[int, Lease] = attrs.Factory(dict)
    events: list[AdmissionEvent] = attrs.Factory(list)
    allowed: tuple[type[BaseException], ...] = ()
    step: int = 0  # the step being checked (0: before the first)


def check_step(admission: Any, calls: Sequence[Call], books: Books) -> None:
    """Every promise that holds between steps (see the module docstring)."""
    live = {lease.id: lease for lease in core_of(admission).live_leases()}
    _counters(admission)
    _new_grants(admission, live, books.live)
    _nothing_leaked(admission, live, calls)
    _fifo(admission, calls, books.step)
    _outcomes(calls, books.allowed)
    _released_once(admission, books.events, end=False)
    books.live = live


def check_end(admission: Any, calls: Sequence[Call], books: Books) -> None:
    """After every call ended: nothing queued, nothing leased, every counter 0, every lease released once."""
    running = [str(c) for c in calls if not c.ended]
    assert not running, f"never ended: {', '.join(running)}"
    check_step(admission, calls, books)
    assert admission.queue_depth == 0, f"{admission.queue_depth} waiters left in the queue"
    snapshot = admission.snapshot()
    for p in snapshot.providers:
        counters = (p.in_flight, p.long_in_flight, p.queued, p.long_queued)
        assert counters == (0, 0, 0, 0), f"{p.node_id}/{p.provider_id}: counters {counters} after every call ended"
    for t in snapshot.tenants:
        waiting, in_flight = t.waiting, t.in_flight
        assert (waiting, in_flight) == (0, 0), f"tenant {t.name}: {waiting} waiting, {in_flight} in flight at the end"
    _released_once(admission, books.events, end=True)


def _counters(admission: Any) -> None:
    snapshot = admission.snapshot()
    assert snapshot.queue_depth >= 0, f"queue depth {snapshot.queue_depth}"
    for p in snapshot.providers:
        for name in ("in_flight", "long_in_flight", "queued", "long_queued"):
            value = getattr(p, name)
            assert value >= 0, f"{p.node_id}/{p.provider_id}: {name} is {value}"
    for t in snapshot.tenants:
        assert t.waiting >= 0 and t.in_flight >= 0, f"tenant {t.name}: waiting {t.waiting}, in flight {t.in_flight}"


def _new_grants(admission: Any, live: dict[int, Lease], before: dict[int, Lease]) -> None:
    """Leases granted since the last check went to configured, enabled, connected providers
    with room: capacity and long slots are never exceeded by a grant (a refresh that lowers a
    capacity keeps the leases above it, and no grant follows until they fall below)."""
    count: collections.Counter[tuple[object, bool]] = collections.Counter()
    for lease in live.values():
        count[lease.provider, False] += 1
        count[lease.provider, True] += lease.long
    providers = admission.config.providers
    for lease in live.values():
        if lease.id in before:
            continue
        key = lease.provider
        spec = providers.get(key)
        assert spec is not None, f"lease {lease.id} granted on {key}, which the config in force does not have"
        assert spec.enabled, f"lease {lease.id} granted on disabled {key}"
        node = key.node_id
        assert admission.is_connected(node), f"lease {lease.id} granted on {key}, whose node is not connected"
        assert lease.generation == admission.generation(node), f"lease {lease.id} granted on a fenced generation"
        assert count[key, False] <= spec.capacity, f"{key}: {count[key, False]} leases > capacity {spec.capacity}"
        if lease.long:
            slots = spec.long_context_capacity
            assert count[key, True] <= slots, f"{key}: {count[key, True]} long leases > long slots {slots}"


def _nothing_leaked(admission: Any, live: dict[int, Lease], calls: Sequence[Call]) -> None:
    """Every live lease belongs to a call still inside its ``async with``; every waiter to a call
    still waiting."""
    holding = [c for c in calls if c.holding]
    long_live = sum(lease.long for lease in live.values())
    long_holding = sum(c.ask.long for c in holding)
    assert len(live) <= len(holding) and long_live <= long_holding, (
        f"{len(live)} leases live ({long_live} long) but {len(holding)} calls hold one ({long_holding} long):"
        " a lease outlived its call (leaked)"
    )
    waiting = sum(c.waiting for c in calls)
    depth = admission.queue_depth
    assert depth <= waiting, f"{depth} waiters queued but {waiting} calls wait: a waiter outlived its call"


def _fifo(admission: Any, calls: Sequence[Call], step: int) -> None:
    """FIFO within a tenant: no call entered during this step while an earlier call of the same
    tenant waits that could have used its slot -- one of the same model and kind, or, when the
    client's ``async with`` gave the lease, one whose model lists its provider (if the earlier
    call is long, only a long lease took a slot it could use)."""
    waiting = [c for c in calls if c.waiting]
    if not waiting:
        return
    models = admission.config.models
    for call in calls[waiting[0].number - 1 :]:
        if not call.entered or call.entered_step != step:
            continue
        for earlier in waiting:
            if earlier.number > call.number:
                break
            if earlier.ask.tenant == call.ask.tenant and _could_use(earlier, call, models):
                raise AssertionError(f"{call} entered while the earlier {earlier} still waits (FIFO within a tenant)")


def _could_use(earlier: Call, call: Call, models: Mapping[str, ModelGroup]) -> bool:
    """Whether ``earlier`` could have used the slot ``call`` took."""
    if (earlier.ask.model, earlier.ask.long) == (call.ask.model, call.ask.long):
        return True
    group = models.get(earlier.ask.model)
    if call.lease is None or group is None or call.lease.provider not in group.candidates:
        return False
    return call.lease.long or not earlier.ask.long


_NOT_EXPECTED = (ConfigError, LeaseScopeError, NodeNotFound)  # misuse or a broken program, never an answer


def _outcomes(calls: Sequence[Call], allowed: tuple[type[BaseException], ...]) -> None:
    """A call ends normally, by its body's planted failure, by the runner's cancellation, or
    with an admission error that answers a request (not a misuse error)."""
    for call in calls:
        error = call.error
        if error is not None:
            answer = isinstance(error, AdmissionError) and not isinstance(error, _NOT_EXPECTED)
            planted = isinstance(error, BodyFailed) and call.fail
            assert answer or planted or isinstance(error, allowed), f"{call} raised {error!r}"
        outcome = call.handle.outcome if call.handle is not None else None
        if outcome == "cancelled":
            assert call.cancelled, (
                f"{call} was cancelled, and not by the runner (the revocation of a lease whose scope was never"
                " exited cancels its task)"
            )
        else:  # the call's own errors are in call.error: this one came from the runtime, as the task ended
            assert outcome in (None, "ok"), (
                f"{call}'s task ended with {outcome} outside the code under test (trio's, when a task ends"
                " inside a cancel scope it never exited, such as a lease scope never exited)"
            )


def _released_once(admission: Any, events: list[AdmissionEvent], *, end: bool) -> None:
    """Each granted lease is released once (at the end: exactly once), as the events tell."""
    assert admission.snapshot().events_dropped == 0, "the runner's event buffer overflowed"
    granted = {e.lease_id for e in events if e.kind == "granted"}
    released = collections.Counter(e.lease_id for e in events if e.kind == "released")
    twice = [i for i, n in released.items() if n > 1]
    assert not twice, f"leases {twice} released more than once"
    unknown = set(released) - granted
    assert not unknown, f"leases {sorted(unknown, key=str)} released but never granted"
    if end:
        left = granted - set(released)
        assert not left, f"leases {sorted(left, key=str)} granted and never released"
