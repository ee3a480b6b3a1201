"""The sans-I/O admission core: the only code that changes admission state.

Like h11's connection object, this module does no I/O, has no clock of its own
(time is passed in as ``now``) and does not import trio. Every method is
synchronous and returns *decisions* -- :class:`Granted`, :class:`Failed`,
:class:`Revoked` -- that the trio layer (``_admission.py``) carries out by
waking parked tasks or cancelling lease bodies. The Hypothesis state machine
drives this class directly.

Why it is built this way:

* **One state per provider.** A :class:`_Provider` holds capacity and the
  in-flight counters for every model group that lists it ([provider-state],
  [long-state]). Model groups hold only references to provider states.

* **Hand-off, decided synchronously.** Whenever capacity may have appeared
  (release, fence, connect, refresh) the core grants waiters right away, before
  returning. A granted waiter owns its lease from that instant even though its
  task has not run yet, exactly like ``trio.CapacityLimiter``. Hence *work
  conservation* holds after every method: no queued waiter has a dispatchable
  candidate. A newcomer is therefore granted only a provider no earlier waiter
  could use -- it never overtakes.

* **Global arrival order without scanning.** Each model group keeps its
  waiters, normal and long separately, in arrival order. Arrival numbers only
  grow, so each is a FIFO deque with lazy deletion; a waiter that leaves
  (granted, cancelled, failed) is skipped when it reaches the front, and a
  deque is compacted when its dead entries outnumber its live ones. Waiters of
  one group share their candidates, so when a head cannot run, nobody behind
  it can. After a release on provider P the next waiter is the earliest head,
  over the groups listing P, that has a dispatchable candidate (the long head
  only when a long slot is free): one release costs O(groups of P),
  independent of queue length. A long waiter blocked on long slots is simply
  not looked at: the normal waiter behind it runs (no head-of-line blocking)
  [cross-group-wakeup].

* **Candidate choice is indexed** [candidate-choice-scale]. The rule --
  highest priority, then lowest ``in_flight / capacity``, then candidate
  order -- is kept per model group as a heap of dispatchable candidates with
  lazy deletion (see :class:`_Group`); a change of a provider's load,
  eligibility or spec re-enters it in every group listing it, O(log n) each
  (:meth:`_Provider.reindex`). Choosing costs the same with one candidate or
  ten thousand. Whoever changes what makes a provider eligible or loaded must
  call ``reindex`` afterwards.

* **Passive health** [outlier-ejection]. Every lease can carry one report,
  failure or success. ``outlier.consecutive_failures`` failures in a row
  eject the provider until a time (``base_ejection`` doubled per ejection in a
  row, capped at ``max_ejection``); :meth:`AdmissionState.advance` ends it, and
  then exactly one *probe* grant may run; its success restores the provider,
  its failure ejects it again for longer. A provider that is ejected or has
  its probe out is not *admitting*: it leaves its groups' choice heaps like a
  full provider (``reindex`` reads ``admitting``). Eligibility (config,
  enabled, connected) is unchanged, so an ejected provider never makes a
  waiter ``Unavailable``. Panic mode: a group whose every eligible candidate is
  non-admitting chooses among them anyway (a scan of its candidates, paid only
  in panic), so ejection never turns a model key with a single bad provider
  into one that admits nothing. A report is *stale* -- and changes nothing --
  when its lease was already reported, its node generation is over, or the
  provider changed health epoch (ejected or restored) since the grant:
  failures of leases granted before an ejection do not lengthen it.

* **Retry keeps the arrival place** [failover-before-first-byte]. Every
  request draws its arrival number when it asks, granted at once or queued.
  :meth:`AdmissionState.retry` asks again for the same request on a candidate
  it has not tried, with that old number and its old queue deadline. A queued
  retry does not share its group's candidates (it excludes the tried ones), so
  it waits in a short list of its own, in arrival order, which ``_dispatch``
  looks at beside the group heads: no later arrival that could use the same
  provider overtakes it. Retries are few (one per failed attempt), and each
  costs a scan of its candidates.

* **Generations fence.** ``connect`` starts a new generation of a node;
  ``disconnect`` with the current generation takes the node offline and
  revokes every live lease on its providers (counters drop at once; each lease
  is released exactly once -- the holder's later release finds it done).
"""

from __future__ import annotations

import bisect
import enum
import itertools
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from heapq import heapify, heappop, heappush, heapreplace
from typing import Any, final

from ._config import PoolConfig, ProviderKey, ProviderSpec, paced, validate_pool
from ._errors import AdmissionError, ModelNotFound, QueueFull, QueueTimeout, RetriesExhausted, Unavailable
from ._snapshot import PROVIDER_FIELDS, ProviderRow, ProviderSnapshot


@final
class WaiterState(enum.Enum):
    """Where a waiter is: ``QUEUED``, then exactly one of the others, for good."""

    QUEUED = "queued"
    GRANTED = "granted"
    FAILED = "failed"
    WITHDRAWN = "withdrawn"  # cancelled or timed out by its own task
    TIMED_OUT = "timed_out"  # expired by AdmissionState.expire()


QUEUED = WaiterState.QUEUED
GRANTED = WaiterState.GRANTED
FAILED = WaiterState.FAILED
WITHDRAWN = WaiterState.WITHDRAWN
TIMED_OUT = WaiterState.TIMED_OUT


@final
class ProviderHealth(enum.Enum):
    """A provider's passive health ([outlier-ejection]); compared by identity."""

    HEALTHY = "healthy"
    EJECTED = "ejected"  # until ejected_until: no grant but in panic mode
    PROBE = "probe"  # ejection time over: the next grant is the probe
    PROBING = "probing"  # the probe runs: no grant but in panic mode


HEALTHY = ProviderHealth.HEALTHY
EJECTED = ProviderHealth.EJECTED
PROBE = ProviderHealth.PROBE
PROBING = ProviderHealth.PROBING

# A deque is compacted once it holds more than this many dead entries and more
# dead than live ones; the rebuild is paid for by the removals that made them.
# A choice heap is rebuilt once it holds more than twice its candidates plus this.
_COMPACT_MIN = 64

# Stamps of provider changes; an index entry is fresh while its stamp is the provider's.
_STAMPS = itertools.count(1)

# A choice index entry is one int, so the heap compares ints, not tuples:
#   -priority | bits of in_flight / capacity | candidate position | stamp
# The bits of a non-negative double sort like the double, so the int sorts like
# the tuple (-priority, load, position) of the rule.
_FLOAT = struct.Struct(">d")
_STAMP_BITS = 64
_POSITION_BITS = 32
_LOAD_SHIFT = _STAMP_BITS + _POSITION_BITS
_PRIORITY_SHIFT = _LOAD_SHIFT + 64
_STAMP_MASK = (1 << _STAMP_BITS) - 1
_POSITION_MASK = (1 << _POSITION_BITS) - 1


@final
class Lease:
    """The right to run one request on one provider.

    A lease is created by a grant and released exactly once: by the holder's
    scope exit, or earlier by fencing (then ``revoked`` is true and the holder's
    release is a no-op).

    Attributes:
        id: unique (per :class:`AdmissionState`) lease number.
        provider: the provider the request runs on.
        generation: the node generation the lease belongs to.
        long: whether it holds a long-context slot too.
        model: the model key it was requested for.
        queue_wait: seconds spent queued before the grant (set by the trio layer).
        arrival: the request's arrival number (kept by its retries).
        enqueue_time: when the request first asked (its queue deadline counts from it).
        attempt: 1 for the first attempt, 2 for the first retry, ...
        tried: providers of this and every earlier attempt, in order.
        probe: whether this lease is its provider's probe after an ejection.
    """

    __slots__ = (
        "id",
        "provider",
        "generation",
        "long",
        "model",
        "queue_wait",
        "arrival",
        "enqueue_time",
        "attempt",
        "tried",
        "probe",
        "_slot",
        "_released",
        "_revoked",
        "_epoch",
        "_reported",
        "_retried",
    )

    def __init__(
        self,
        id: int,
        slot: _Provider,
        model: str,
        long: bool,
        arrival: int,
        enqueue_time: float,
        attempt: int,
        tried: tuple[ProviderKey, ...],
    ) -> None:
        self.id = id
        self.provider: ProviderKey = slot.key
        self.generation = slot.node.generation
        self.long = long
        self.model = model
        self.queue_wait = 0.0
        self.arrival = arrival
        self.enqueue_time = enqueue_time
        self.attempt = attempt
        self.tried: tuple[ProviderKey, ...] = (*tried, slot.key)
        self.probe = False
        self._slot = slot
        self._released = False
        self._revoked = False
        self._epoch = slot.epoch
        self._reported = False
        self._retried = False

    @property
    def released(self) -> bool:
        """True once the lease no longer counts against its provider."""
        return self._released

    @property
    def revoked(self) -> bool:
        """True if the lease was released by fencing its generation."""
        return self._revoked

    def __repr__(self) -> str:
        state = "revoked" if self._revoked else "released" if self._released else "live"
        kind = " long" if self.long else ""
        kind += " probe" if self.probe else ""
        kind += f" attempt {self.attempt}" if self.attempt > 1 else ""
        return f"<Lease {self.id} {self.provider} gen {self.generation}{kind} model {self.model!r} {state}>"


@final
class Waiter:
    """A request queued at the Edge with no provider yet.

    Attributes:
        seq: global arrival number; grants follow it among waiters that can use
            the same provider.
        model, long: what was requested.
        enqueue_time, deadline: in the caller's clock; ``deadline`` is
            ``enqueue_time + policy.queue_timeout`` and moves with a refresh.
        state: a :class:`WaiterState`, compared by identity.
        lease: the granted lease, once ``state == "granted"``.
        error: the failure, once ``state == "failed"``.
        attempt, tried: for a retry, its attempt number and the providers
            already tried (never candidates again); 1 and ``()`` otherwise.
    """

    __slots__ = (
        "seq",
        "model",
        "long",
        "enqueue_time",
        "deadline",
        "state",
        "lease",
        "error",
        "attempt",
        "tried",
        "_candidates",
        "_group",
    )

    def __init__(
        self,
        seq: int,
        model: str,
        long: bool,
        now: float,
        deadline: float,
        attempt: int = 1,
        tried: tuple[ProviderKey, ...] = (),
    ) -> None:
        self.seq = seq
        self.model = model
        self.long = long
        self.enqueue_time = now
        self.deadline = deadline
        self.attempt = attempt
        self.tried = tried
        self.state: WaiterState = QUEUED
        self.lease: Lease | None = None
        self.error: AdmissionError | None = None
        self._candidates: tuple[_Provider, ...] = ()
        self._group: _Group | None = None  # the model group whose deque holds us while queued

    @property
    def candidates(self) -> tuple[ProviderKey, ...]:
        """The waiter's candidate providers, in preference order."""
        return tuple(p.key for p in self._candidates)

    def __repr__(self) -> str:
        kind = " long" if self.long else ""
        kind += f" attempt {self.attempt}" if self.attempt > 1 else ""
        return f"<Waiter {self.seq} {self.model!r}{kind} {self.state.value}>"


@final
class Granted:
    """Decision: ``waiter`` now holds ``lease``; wake it with the lease."""

    __slots__ = ("waiter", "lease")

    def __init__(self, waiter: Waiter, lease: Lease) -> None:
        self.waiter = waiter
        self.lease = lease

    def __repr__(self) -> str:
        return f"Granted({self.waiter!r}, {self.lease!r})"


@final
class Failed:
    """Decision: ``waiter`` left the queue with ``error``; wake it with the error."""

    __slots__ = ("waiter", "error")

    def __init__(self, waiter: Waiter, error: AdmissionError) -> None:
        self.waiter = waiter
        self.error = error

    def __repr__(self) -> str:
        return f"Failed({self.waiter!r}, {type(self.error).__name__})"


@final
class Revoked:
    """Decision: ``lease`` was released by fencing; cancel its body."""

    __slots__ = ("lease",)

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def __repr__(self) -> str:
        return f"Revoked({self.lease!r})"


@final
class Ejected:
    """Decision: ``provider`` is ejected until ``until`` (``duration`` seconds) after ``failures`` failures."""

    __slots__ = ("provider", "until", "duration", "failures")

    def __init__(self, provider: ProviderKey, until: float, duration: float, failures: int) -> None:
        self.provider = provider
        self.until = until
        self.duration = duration
        self.failures = failures

    def __repr__(self) -> str:
        return f"Ejected({self.provider}, {self.duration}s after {self.failures} failures)"


@final
class Restored:
    """Decision: ``provider`` is admitting again after a success."""

    __slots__ = ("provider",)

    def __init__(self, provider: ProviderKey) -> None:
        self.provider = provider

    def __repr__(self) -> str:
        return f"Restored({self.provider})"


Decision = Granted | Failed | Revoked | Ejected | Restored


@final
class PreparedRefresh:
    """A validated configuration and what it changes against the one in force when prepared.

    Made by :func:`prepare_refresh` from the two (immutable) configurations
    only, so it can be made in a worker thread while the state keeps
    changing; :meth:`AdmissionState.refresh` applies it. Applied to the
    configuration it was compared with, the refresh touches only what changed;
    applied to any other (a refresh came in between), it is applied whole.

    Attributes:
        config: the configuration to put in force.
    """

    __slots__ = ("config", "base", "added", "changed", "removed", "groups", "dropped", "same_order")

    def __init__(self, config: PoolConfig, base: PoolConfig) -> None:
        self.config = config
        self.base = base  # the configuration the differences below are against
        self.added: list[ProviderKey] = []  # providers configured now and not in base, in config order
        self.changed: list[ProviderKey] = []  # providers in both whose spec differs
        self.removed: list[ProviderKey] = []  # providers in base only
        self.groups: list[str] = []  # model keys new or with other candidates, in config order
        self.dropped: list[str] = []  # model keys in base only
        self.same_order = False  # the configured providers are base's, in base's order

    def __repr__(self) -> str:
        return (
            f"<PreparedRefresh +{len(self.added)} ~{len(self.changed)} -{len(self.removed)} providers,"
            f" {len(self.groups)} model groups new or changed>"
        )


def prepare_refresh(config: PoolConfig, base: PoolConfig, pause: Callable[[], None] | None = None) -> PreparedRefresh:
    """Validate ``config`` and find what it changes against ``base``; reads nothing else.

    O(providers + candidates), pure: safe in a worker thread. ``pause``: see
    :func:`validate_pool`.

    Raises:
        ConfigError: listing every problem of ``config``.
    """
    validate_pool(config, pause=pause)
    prepared = PreparedRefresh(config, base)
    old, new = base.providers, config.providers
    for key, spec in paced(new.items(), pause):
        before = old.get(key)
        if before is None:
            prepared.added.append(key)
        elif before is not spec and before != spec:
            prepared.changed.append(key)
    if len(old) + len(prepared.added) != len(new):
        prepared.removed = [key for key in paced(old, pause) if key not in new]
    prepared.same_order = not prepared.added and not prepared.removed and _same_items(old, new, pause)
    old_models = base.models
    for name, group in config.models.items():
        before_group = old_models.get(name)
        if before_group is None or not _same_items(before_group.candidates, group.candidates, pause):
            prepared.groups.append(name)
    prepared.dropped = [name for name in old_models if name not in config.models]
    return prepared


def _same_items(old: Iterable[object], new: Iterable[object], pause: Callable[[], None] | None) -> bool:
    """Whether ``old`` and ``new`` hold equal items in the same order (``pause``: as in :func:`paced`)."""
    done = object()
    pairs = itertools.zip_longest(old, new, fillvalue=done)
    return all(a is b or a == b for a, b in paced(pairs, pause))


class _Node:
    __slots__ = ("node_id", "generation", "connected", "providers")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.generation = 0
        self.connected = False
        self.providers: list[_Provider] = []  # configured and retired-with-leases


class _Group:
    """One model key: its candidates, their choice index, and its queued waiters.

    The choice index is one heap per kind (normal, long) of entries
    ``(-priority, in_flight / capacity, candidate position, stamp)``, packed
    into one int (see ``_PRIORITY_SHIFT``), pushed for a candidate that was dispatchable (of that kind) when its stamp
    was issued. Each change of a provider's load, eligibility or spec issues a
    new stamp and pushes fresh entries, O(log n); an entry whose stamp is not its
    provider's current one is stale and is popped when it reaches the top. So
    the top fresh entry is the rule's choice -- highest priority, then lowest
    load, then candidate order -- whatever the number of candidates. A heap
    holding more than twice its candidates (plus a margin) in entries is rebuilt
    from its fresh ones, paid for by the pushes that made it grow.

    Waiters of a group share its candidates, so they wait in two FIFO deques
    (normal, long) in arrival order, with lazy deletion like the heaps.
    """

    __slots__ = (
        "name",
        "providers",
        "heap",
        "long_heap",
        "eligible",
        "long_eligible",
        "admitting",
        "long_admitting",
        "normal",
        "long",
        "normal_live",
        "long_live",
        "normal_dead",
        "long_dead",
    )

    def __init__(self, name: str, providers: tuple[_Provider, ...]) -> None:
        self.name = name
        self.providers = providers
        self.heap: list[int] = []
        self.long_heap: list[int] = []
        self.eligible = 0  # eligible candidates
        self.long_eligible = 0  # eligible candidates with a long capacity >= 1
        self.admitting = 0  # eligible candidates that are admitting (not ejected, no probe out)
        self.long_admitting = 0  # the same with a long capacity >= 1
        self.normal: deque[Waiter] = deque()
        self.long: deque[Waiter] = deque()
        self.normal_live = self.long_live = 0
        self.normal_dead = self.long_dead = 0

    # ---------------------------------------------------------------- choice

    def best(self, long: bool) -> _Provider | None:
        """The candidate the rule picks for a request of this kind; None if none is dispatchable.

        The heap holds admitting candidates only; in panic mode (every eligible
        candidate is ejected or probing) the choice scans the candidates instead.
        """
        heap = self.long_heap if long else self.heap
        providers = self.providers
        while heap:
            entry = heap[0]
            p = providers[(entry >> _STAMP_BITS) & _POSITION_MASK]
            if entry & _STAMP_MASK == p.stamp:
                return p
            heappop(heap)
        if self.in_panic(long):
            return _choose(providers, long, True)
        return None

    def in_panic(self, long: bool) -> bool:
        """Panic mode [outlier-ejection]: some candidate could run the request, none is admitting."""
        if long:
            return self.long_eligible > 0 and self.long_admitting == 0
        return self.eligible > 0 and self.admitting == 0

    def push(self, entry: int, position: int, long: bool) -> None:
        """Enter a fresh entry; it replaces the top when the top is the same candidate's."""
        heap = self.long_heap if long else self.heap
        if heap and (heap[0] >> _STAMP_BITS) & _POSITION_MASK == position:
            heapreplace(heap, entry)  # the usual grant: the chosen provider took load
            return
        heappush(heap, entry)
        if len(heap) > 2 * len(self.providers) + _COMPACT_MIN:
            providers = self.providers
            heap[:] = [e for e in heap if e & _STAMP_MASK == providers[(e >> _STAMP_BITS) & _POSITION_MASK].stamp]
            heapify(heap)

    def link(self, p: _Provider, position: int) -> None:
        """Take in ``p``, just listed at ``position`` of a new group, as its other groups count and index it.

        Its ``reindex`` afterwards (if it changed) moves every group's counts
        together. Entries are appended unsorted: call :meth:`heapify` once all are in.
        """
        p.groups.append((self, position))
        self.eligible += p.counted
        self.long_eligible += p.long_counted
        self.admitting += p.admit_counted
        self.long_admitting += p.long_admit_counted
        if p.eligible and p.admitting and p.in_flight < p.capacity:
            entry = p.rank() + (position << _STAMP_BITS)
            self.heap.append(entry)
            if p.long_in_flight < p.long_capacity:
                self.long_heap.append(entry)

    def heapify(self) -> None:
        heapify(self.heap)
        heapify(self.long_heap)

    def drop_top(self, position: int, long_only: bool) -> None:
        """Pop the candidate's top entries that just went stale (it is no longer dispatchable)."""
        for heap in (self.long_heap,) if long_only else (self.heap, self.long_heap):
            if heap and (heap[0] >> _STAMP_BITS) & _POSITION_MASK == position:
                heappop(heap)

    def could_run(self, long: bool) -> bool:
        """Whether some candidate could ever run a request of this kind without a config change."""
        return (self.long_eligible if long else self.eligible) > 0

    # --------------------------------------------------------------- waiters

    def enqueue(self, waiter: Waiter) -> None:
        waiter._group = self
        if waiter.long:
            self.long.append(waiter)
            self.long_live += 1
        else:
            self.normal.append(waiter)
            self.normal_live += 1

    def head(self, long: bool) -> Waiter | None:
        """Earliest live waiter of one kind, dropping dead entries from the front."""
        q = self.long if long else self.normal
        while q:
            w = q[0]
            if w.state is QUEUED:
                return w
            q.popleft()
            if long:
                self.long_dead -= 1
            else:
                self.normal_dead -= 1
        return None

    def live(self, long: bool) -> list[Waiter]:
        return [w for w in (self.long if long else self.normal) if w.state is QUEUED]

    def forget(self, waiter: Waiter) -> None:
        """Account for a waiter that left; compact its deque if mostly dead."""
        if waiter.long:
            self.long_live -= 1
            self.long_dead += 1
            if self.long_dead > _COMPACT_MIN and self.long_dead > self.long_live:
                self.long = deque(self.live(True))
                self.long_dead = 0
        else:
            self.normal_live -= 1
            self.normal_dead += 1
            if self.normal_dead > _COMPACT_MIN and self.normal_dead > self.normal_live:
                self.normal = deque(self.live(False))
                self.normal_dead = 0


class _Provider:
    """Lease state of one provider key, shared by every model group."""

    __slots__ = (
        "key",
        "node",
        "spec",
        "capacity",
        "long_capacity",
        "priority",
        "configured",
        "eligible",
        "in_flight",
        "long_in_flight",
        "leases",
        "groups",
        "stamp",
        "counted",
        "long_counted",
        "admit_counted",
        "long_admit_counted",
        "health",
        "admitting",
        "failures",
        "streak",
        "ejected_until",
        "epoch",
        "probe_lease",
        "ejections",
        "probes",
    )

    def __init__(self, key: ProviderKey, node: _Node, spec: ProviderSpec) -> None:
        self.key = key
        self.node = node
        self.in_flight = 0
        self.long_in_flight = 0
        self.leases: dict[int, Lease] = {}
        self.groups: list[tuple[_Group, int]] = []  # (model group, position among its candidates)
        self.stamp = 0
        self.counted = False  # counted in its groups' ``eligible``
        self.long_counted = False  # counted in its groups' ``long_eligible``
        self.admit_counted = False  # counted in its groups' ``admitting``
        self.long_admit_counted = False  # counted in its groups' ``long_admitting``
        self.health: ProviderHealth = HEALTHY
        self.admitting = True  # health allows a grant (healthy, or its probe is due)
        self.failures = 0  # consecutive provider failures
        self.streak = 0  # ejections in a row (reset by a restore)
        self.ejected_until = 0.0
        self.epoch = 0  # bumped by every ejection and restore; stale reports differ
        self.probe_lease = 0  # id of the probe lease while PROBING
        self.ejections = 0  # totals, for metrics
        self.probes = 0
        self.configured = True
        self.eligible = False
        self.set_spec(spec)

    def set_spec(self, spec: ProviderSpec) -> None:
        self.spec = spec
        self.capacity = spec.capacity
        self.long_capacity = spec.long_context_capacity
        self.priority = spec.priority

    def update_eligibility(self) -> None:
        self.eligible = self.configured and self.spec.enabled and self.node.connected
        self.reindex()

    def reindex(self) -> None:
        """Re-enter the choice index of every group listing this provider.

        Call after any change of its load, eligibility, health or spec: O(groups x log n).
        A provider that is not admitting (ejected, probe out) is left out like a full one.
        """
        self.stamp = next(_STAMPS)
        eligible = self.eligible
        long_eligible = eligible and self.long_capacity >= 1
        if eligible != self.counted or long_eligible != self.long_counted:
            step, long_step = eligible - self.counted, long_eligible - self.long_counted
            for g, _ in self.groups:
                g.eligible += step
                g.long_eligible += long_step
            self.counted, self.long_counted = eligible, long_eligible
        admit, long_admit = eligible and self.admitting, long_eligible and self.admitting
        if admit != self.admit_counted or long_admit != self.long_admit_counted:
            step, long_step = admit - self.admit_counted, long_admit - self.long_admit_counted
            for g, _ in self.groups:
                g.admitting += step
                g.long_admitting += long_step
            self.admit_counted, self.long_admit_counted = admit, long_admit
        if not admit or self.in_flight >= self.capacity:
            for g, position in self.groups:
                g.drop_top(position, False)
            return
        rank = self.rank()
        long_room = self.long_in_flight < self.long_capacity
        for g, position in self.groups:
            entry = rank + (position << _STAMP_BITS)
            g.push(entry, position, False)
            if long_room:
                g.push(entry, position, True)
            else:
                g.drop_top(position, True)

    def rank(self) -> int:
        """Its choice index entry, position aside: priority, load and current stamp (see ``_PRIORITY_SHIFT``)."""
        load = int.from_bytes(_FLOAT.pack(self.in_flight / self.capacity), "big")
        return (-self.priority << _PRIORITY_SHIFT) + (load << _LOAD_SHIFT) + self.stamp

    def queued(self) -> tuple[int, int]:
        """Candidate pressure: (waiters that could run here, of which long)."""
        normal = long = 0
        for g, _ in self.groups:
            normal += g.normal_live
            long += g.long_live
        if self.long_capacity < 1:
            long = 0
        return normal + long, long


@final
class AdmissionState:
    """Provider lease states, node generations and the global waiter queue.

    Args:
        config: the pool configuration; validated as a whole.

    Raises:
        ConfigError: listing every problem of ``config``.
    """

    def __init__(self, config: PoolConfig) -> None:
        validate_pool(config)
        self._config = config
        self._nodes: dict[str, _Node] = {}
        self._providers: dict[ProviderKey, _Provider] = {}
        self._configured: tuple[_Provider, ...] = ()
        self._groups: dict[str, _Group] = {}
        self._waiters: dict[int, Waiter] = {}  # queued only, in arrival order
        self._seq = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._max_queue = config.policy.max_queue
        self._timeout = config.policy.queue_timeout
        self._retries: list[Waiter] = []  # queued retries, in arrival order (also in _waiters)
        self._unhealthy: dict[ProviderKey, _Provider] = {}  # ejected, probe due or probing
        self._now = 0.0  # the latest time passed in
        self._install(config)

    # ------------------------------------------------------------------ queries

    @property
    def config(self) -> PoolConfig:
        """The configuration in force."""
        return self._config

    @property
    def queue_depth(self) -> int:
        """True number of queued waiters (all model groups)."""
        return len(self._waiters)

    def waiters(self) -> Iterator[Waiter]:
        """Queued waiters in arrival order."""
        return iter(tuple(self._waiters.values()))

    def live_leases(self) -> Iterator[Lease]:
        """Every unreleased lease, including those on providers removed by refresh."""
        for p in self._providers.values():
            yield from tuple(p.leases.values())

    def generation(self, node_id: str) -> int:
        """Current generation of a node (0 if it never connected)."""
        node = self._nodes.get(node_id)
        return node.generation if node else 0

    def knows_node(self, node_id: str) -> bool:
        """Whether some configuration in force so far had a provider on ``node_id``."""
        return node_id in self._nodes

    def nodes(self) -> tuple[str, ...]:
        """The node ids of the configuration in force, in provider order."""
        return tuple(dict.fromkeys(k.node_id for k in self._config.providers))

    def is_connected(self, node_id: str) -> bool:
        """Whether the node is connected in its current generation."""
        node = self._nodes.get(node_id)
        return bool(node and node.connected)

    @property
    def last_time(self) -> float:
        """The latest ``now`` passed to any method."""
        return self._now

    def next_ejection_end(self) -> float | None:
        """The earliest time an ejection ends (pass it to :meth:`advance`), or None."""
        ends = [p.ejected_until for p in self._unhealthy.values() if p.health is EJECTED]
        return min(ends) if ends else None

    def panic_models(self) -> tuple[str, ...]:
        """Model keys in panic mode: every eligible candidate is ejected or probing."""
        return tuple(name for name, g in self._groups.items() if g.in_panic(False))

    def provider_snapshots(
        self, now: float | None = None, first: int = 0, count: int | None = None
    ) -> tuple[ProviderSnapshot, ...]:
        """Per configured provider, in configuration order (see ProviderSnapshot).

        ``ejection_left`` counts from ``now``, by default the latest time passed in.
        ``first``/``count``: only the providers at those positions of the order.
        """
        return tuple(ProviderSnapshot(*values) for values in self._provider_values(now, first, count))

    def provider_rows(self, now: float | None = None, first: int = 0, count: int | None = None) -> list[ProviderRow]:
        """:meth:`provider_snapshots` as plain dicts (see :data:`ProviderRow`), without the objects."""
        return [dict(zip(PROVIDER_FIELDS, values, strict=True)) for values in self._provider_values(now, first, count)]

    def _provider_values(self, now: float | None, first: int, count: int | None) -> Iterator[tuple[Any, ...]]:
        """Each provider's :class:`ProviderSnapshot` field values, in field order."""
        now = self._now if now is None else now
        retried = self._retry_pressure()
        for p in self._configured[first : None if count is None else first + count]:
            spec = p.spec
            queued, long_queued = p.queued() if p.eligible else (0, 0)
            if p.key in retried:
                queued, long_queued = queued + retried[p.key][0], long_queued + retried[p.key][1]
            connected = p.node.connected
            eligible = p.eligible
            if not spec.enabled:
                status = "disabled"
            else:
                status = "available" if connected else "unavailable"
            if not connected:
                health = "offline"
            else:
                health = "online" if p.health is HEALTHY else "ejected"
            yield (
                p.key.node_id,
                p.key.provider_id,
                connected,
                status,
                health,
                p.node.generation,
                spec.capacity,
                spec.long_context_capacity,
                spec.capacity if eligible else 0,
                spec.long_context_capacity if eligible else 0,
                p.in_flight,
                p.long_in_flight,
                queued,
                long_queued,
                spec.priority,
                p.failures,
                max(0.0, p.ejected_until - now) if p.health is EJECTED else 0.0,
                p.ejections,
                p.probes,
            )

    def _retry_pressure(self) -> dict[ProviderKey, tuple[int, int]]:
        """Candidate pressure of queued retries: (waiters, of which long) per provider."""
        out: dict[ProviderKey, tuple[int, int]] = {}
        for w in self._retries:
            for p in w._candidates:
                if p.eligible and (not w.long or p.long_capacity >= 1):
                    n, n_long = out.get(p.key, (0, 0))
                    out[p.key] = (n + 1, n_long + w.long)
        return out

    # ------------------------------------------------------------------ requests

    def request(self, model: str, long: bool, now: float) -> Lease | Waiter:
        """Admit a request now, or queue it.

        Returns:
            A :class:`Lease` when a candidate is dispatchable now; otherwise the
            queued :class:`Waiter` (a later decision grants or fails it).

        Raises:
            ModelNotFound: ``model`` is not configured.
            Unavailable: no candidate is eligible (nothing is queued).
            QueueFull: ``max_queue`` waiters already exist.
        """
        group = self._groups.get(model)
        if group is None:
            raise ModelNotFound(model)
        if now > self._now:
            self._now = now
        best = group.best(long)
        if best is not None:
            return self._grant(best, model, long, next(self._seq), now)
        if not group.could_run(long):
            raise Unavailable(model, long, _reasons(group.providers, long, ()))
        if len(self._waiters) >= self._max_queue:
            raise QueueFull(model, self._max_queue)
        waiter = Waiter(next(self._seq), model, long, now, now + self._timeout)
        waiter._candidates = group.providers
        group.enqueue(waiter)
        self._waiters[waiter.seq] = waiter
        return waiter

    def retry(self, lease: Lease, now: float) -> Lease | Waiter:
        """Ask again for the request ``lease`` served, on a candidate not tried yet.

        The retry keeps the request's arrival number and queue deadline
        (``enqueue_time + queue_timeout``): granted at once when a candidate is
        dispatchable, otherwise queued at its old place in arrival order. A
        retry is never refused for a full queue (the request was admitted once
        already). Each lease can be retried once.

        Returns:
            A :class:`Lease` (``attempt`` one more) or the queued :class:`Waiter`.

        Raises:
            RetriesExhausted: ``lease.attempt`` is ``retry.max_attempts`` already.
            ModelNotFound: the model is no longer configured.
            QueueTimeout: the request's queue deadline is past.
            Unavailable: no candidate left that was not tried is eligible.
            RuntimeError: the lease was retried before.
        """
        if lease._retried:
            raise RuntimeError(f"{lease!r} was retried already")
        model, long = lease.model, lease.long
        if lease.attempt >= self._config.retry.max_attempts:
            raise RetriesExhausted(model, lease.attempt)
        group = self._groups.get(model)
        if group is None:
            raise ModelNotFound(model)
        self._now = max(self._now, now)
        deadline = lease.enqueue_time + self._timeout
        if deadline <= now:
            raise QueueTimeout(model, now - lease.enqueue_time)
        candidates = _untried(group.providers, lease.tried)
        best = _best_of(candidates, long)
        if best is None and not _could_run(candidates, long):
            raise Unavailable(model, long, _reasons(group.providers, long, lease.tried))
        lease._retried = True
        attempt = lease.attempt + 1
        if best is not None:
            return self._grant(best, model, long, lease.arrival, lease.enqueue_time, attempt, lease.tried)
        waiter = Waiter(lease.arrival, model, long, lease.enqueue_time, deadline, attempt, lease.tried)
        waiter._candidates = candidates
        bisect.insort(self._retries, waiter, key=_seq)
        self._enqueue_in_order(waiter)
        return waiter

    def withdraw(self, waiter: Waiter) -> bool:
        """Remove a queued waiter (its task was cancelled or its deadline passed).

        Returns:
            False if the waiter was no longer queued (already granted or failed).
        """
        if waiter.state is not QUEUED:
            return False
        self._remove(waiter, WITHDRAWN)
        return True

    def expire(self, now: float) -> list[Waiter]:
        """Remove every waiter whose deadline is ``<= now``; return them, oldest first.

        Deadlines are ``enqueue_time + queue_timeout`` with one timeout for all
        waiters, and the queue is in arrival order (a retry goes back to its
        arrival place with its original enqueue time), so deadlines grow along
        the queue and the scan stops at the first waiter still in time: the cost
        is the number of waiters expired, not the length of the queue (this is
        the path every firing queue deadline takes).
        """
        out = list(itertools.takewhile(lambda waiter: waiter.deadline <= now, self._waiters.values()))
        for waiter in out:
            self._remove(waiter, TIMED_OUT)
        return out

    def release(self, lease: Lease) -> list[Decision]:
        """Release a lease (idempotent) and hand freed capacity to waiters.

        Returns:
            The grants this release caused; empty if the lease was already
            released (for example by fencing).
        """
        if lease._released:
            return []
        lease._released = True
        slot = lease._slot
        slot.in_flight -= 1
        if lease.long:
            slot.long_in_flight -= 1
        del slot.leases[lease.id]
        if lease.probe and slot.probe_lease == lease.id:
            self._reopen_probe(slot)
        if not slot.configured and not slot.leases:
            self._drop_retired(slot)
            return []
        slot.reindex()
        if self._retries:
            return self._dispatch(g for g, _ in slot.groups)
        for g, _ in slot.groups:
            if g.normal_live or g.long_live:
                return self._dispatch(g for g, _ in slot.groups)
        return []

    # ------------------------------------------------------------------ health

    def report_failure(self, lease: Lease, now: float) -> list[Decision]:
        """Count a provider failure of ``lease`` (once per lease; stale reports change nothing).

        On a healthy provider the ``outlier.consecutive_failures``-th failure in a
        row ejects it (0: never); on an ejected one only its probe's failure
        counts: it ejects the provider again, for twice as long (capped).

        Returns:
            ``Ejected`` and the grants it causes (waiters entering panic mode).
        """
        self._now = max(self._now, now)
        p = self._reportable(lease)
        if p is None:
            return []
        p.failures += 1
        if p.health is HEALTHY:
            limit = self._config.outlier.consecutive_failures
            if limit and p.failures >= limit:
                return self._eject(p, now)
            return []
        if lease.probe and p.probe_lease == lease.id:
            return self._eject(p, now)
        return []

    def report_success(self, lease: Lease, now: float) -> list[Decision]:
        """Count a success of ``lease`` (once per lease; stale reports change nothing).

        A success resets the failure count; on an ejected provider (its probe,
        or a lease granted in panic mode during the ejection) it restores it.

        Returns:
            ``Restored`` and the grants it causes; empty for a healthy provider.
        """
        self._now = max(self._now, now)
        p = self._reportable(lease)
        if p is None:
            return []
        p.failures = 0
        if p.health is HEALTHY:
            return []
        return self._restore(p)

    def advance(self, now: float) -> list[Decision]:
        """End every ejection whose time is ``<= now``: its probe may be granted now.

        Returns:
            The grants this causes (the probe goes to the earliest waiter that can use it).
        """
        self._now = max(self._now, now)
        due = [p for p in self._unhealthy.values() if p.health is EJECTED and p.ejected_until <= now]
        for p in due:
            p.health = PROBE
            p.admitting = True
            p.reindex()
        return self._dispatch(_groups_of(due)) if due else []

    # ------------------------------------------------------------ connectivity

    def connect(self, node_id: str) -> tuple[int, list[Decision]]:
        """Start a new generation of ``node_id``; its providers come online.

        If the node was connected, its old generation is fenced first, as by
        :meth:`disconnect`.

        Returns:
            The new generation and the decisions (revocations, then grants).
        """
        node = self._node(node_id)
        decisions: list[Decision] = []
        if node.connected:
            decisions.extend(self._fence(node))
        node.generation += 1
        node.connected = True
        for p in node.providers:
            p.update_eligibility()
        decisions.extend(self._dispatch(_groups_of(node.providers)))
        return node.generation, decisions

    def disconnect(self, node_id: str, generation: int) -> tuple[bool, list[Decision]]:
        """Take a node offline if ``generation`` is its current, connected one.

        Fences the generation (every live lease on the node's providers is
        revoked and released), then fails each waiter left with no eligible
        candidate with :class:`Unavailable`.

        Returns:
            ``(False, [])`` for a stale generation or a node not connected;
            otherwise ``(True, decisions)``.
        """
        node = self._nodes.get(node_id)
        if node is None or not node.connected or node.generation != generation:
            return False, []
        node.connected = False
        decisions: list[Decision] = list(self._fence(node))
        for p in node.providers:
            p.update_eligibility()
        groups = _groups_of(node.providers)
        decisions.extend(self._fail_stranded(groups))
        if self._unhealthy:  # groups left with only ejected candidates enter panic mode
            decisions.extend(self._dispatch(groups))
        return True, decisions

    # ------------------------------------------------------------------ refresh

    def prepare_refresh(self, config: PoolConfig, pause: Callable[[], None] | None = None) -> PreparedRefresh:
        """:func:`prepare_refresh` against the configuration in force now (reads nothing else).

        Safe in a worker thread while this state changes on another.

        Raises:
            ConfigError: listing every problem of ``config``.
        """
        return prepare_refresh(config, self._config, pause)

    def refresh(self, config: PoolConfig | PreparedRefresh) -> list[Decision]:
        """Apply a new configuration atomically; leases are kept.

        Validates first (on error nothing changes). Then: provider specs are
        replaced (a provider dropped from the config keeps its live leases
        until they end, but takes no new work); model groups are replaced;
        every queued waiter gets its model's new candidates and the deadline
        ``enqueue_time + new queue_timeout``; a waiter whose model is gone
        fails with :class:`ModelNotFound`, one with no eligible candidate left
        with :class:`Unavailable`; finally waiters are re-evaluated in arrival
        order against every provider.

        A :class:`PreparedRefresh` applies its configuration with exactly the
        same outcome. Prepared against the configuration in force, only what
        it changes is touched: the providers whose spec changed (or that were
        added or removed) and the model groups whose candidates changed; the
        other groups keep their index and their waiters' places (O(changes +
        queued waiters)). Otherwise the whole configuration is installed.

        Raises:
            ConfigError: listing every problem; the state is unchanged.
        """
        if isinstance(config, PreparedRefresh):
            if config.base is self._config:
                return self._refresh_changes(config)
            config = config.config
        validate_pool(config)
        self._set_config(config)
        for p in self._providers.values():
            p.configured = False
        self._install(config)
        for p in tuple(self._providers.values()):
            if not p.configured:
                self._forget_health(p)
                if not p.leases:
                    self._drop_retired(p)
        decisions = self._requeue()
        decisions.extend(self._dispatch(self._groups.values()))
        return decisions

    def _refresh_changes(self, prepared: PreparedRefresh) -> list[Decision]:
        """Apply ``prepared`` to the configuration it was prepared against: only what changed.

        The outcome is :meth:`refresh`'s. Groups whose candidates did not change
        are kept, with their counts, index and queued waiters; providers whose
        spec did not change are not touched. Only the groups built anew and the
        groups of changed providers can gain a dispatchable candidate, so only
        they are dispatched (every other waiter could not run before and still cannot).
        """
        config = prepared.config
        self._set_config(config)
        providers = self._providers
        for name in (*prepared.groups, *prepared.dropped):
            old = self._groups.get(name)
            for p in old.providers if old is not None else ():
                p.groups = [entry for entry in p.groups if entry[0] is not old]
        touched = [providers[key] for key in prepared.removed]
        for p in touched:
            p.configured = False
        for key in prepared.changed:
            p = providers[key]
            p.set_spec(config.providers[key])
            touched.append(p)
        touched.extend(self._configure(key, config.providers[key]) for key in prepared.added)
        built = {name: self._build_group(name, config.models[name].candidates) for name in prepared.groups}
        kept = self._groups
        self._groups = {name: built[name] if name in built else kept[name] for name in config.models}
        if not prepared.same_order:
            self._configured = tuple(map(providers.__getitem__, config.providers))
        for p in touched:
            p.update_eligibility()
        for key in prepared.removed:
            p = providers[key]
            self._forget_health(p)
            if not p.leases:
                self._drop_retired(p)
        decisions = self._requeue()
        decisions.extend(self._dispatch(_groups_of(touched, built.values())))
        return decisions

    def _set_config(self, config: PoolConfig) -> None:
        self._config = config
        self._max_queue = config.policy.max_queue
        self._timeout = config.policy.queue_timeout

    def _requeue(self) -> list[Decision]:
        """After a refresh: each queued waiter's new deadline, candidates and place, in arrival order.

        A waiter of a model key that is gone fails with ModelNotFound, one whose
        candidates can no longer run it with Unavailable. A waiter whose group
        was kept stays where it is; the others join their new group's queue.
        """
        decisions: list[Decision] = []
        retries: list[Waiter] = []
        for w in tuple(self._waiters.values()):
            group = self._groups.get(w.model)
            if group is None:
                w._group = None
                decisions.append(self._fail_unindexed(w, ModelNotFound(w.model)))
                continue
            w.deadline = w.enqueue_time + self._timeout
            if w.attempt > 1:  # a queued retry: its own candidates, its own list
                w._candidates = _untried(group.providers, w.tried)
                if _could_run(w._candidates, w.long):
                    retries.append(w)
                else:
                    decisions.append(self._fail_unindexed(w, Unavailable(w.model, w.long)))
                continue
            if w._group is group:  # a kept group: the waiter keeps its place
                if not group.could_run(w.long):
                    self._remove(w, FAILED)
                    w.error = Unavailable(w.model, w.long)
                    decisions.append(Failed(w, w.error))
                continue
            w._group = None
            w._candidates = group.providers
            if group.could_run(w.long):
                group.enqueue(w)
            else:
                decisions.append(self._fail_unindexed(w, Unavailable(w.model, w.long)))
        self._retries = retries
        return decisions

    # ----------------------------------------------------------------- internals

    def _install(self, config: PoolConfig) -> None:
        self._configured = tuple(self._configure(key, spec) for key, spec in config.providers.items())
        for p in self._providers.values():
            p.groups = []
            p.counted = p.long_counted = p.admit_counted = p.long_admit_counted = False
        groups = {}
        for name, model in config.models.items():
            group = _Group(name, tuple(self._providers[k] for k in model.candidates))
            for position, p in enumerate(group.providers):
                p.groups.append((group, position))
            groups[name] = group
        self._groups = groups
        for p in self._providers.values():
            p.update_eligibility()

    def _configure(self, key: ProviderKey, spec: ProviderSpec) -> _Provider:
        """The provider ``key`` with ``spec``, configured: a new one, or the one kept (even retired)."""
        p = self._providers.get(key)
        if p is None:
            node = self._node(key.node_id)
            p = _Provider(key, node, spec)
            self._providers[key] = p
            node.providers.append(p)
        else:
            p.set_spec(spec)
            p.configured = True
        return p

    def _build_group(self, name: str, candidates: tuple[ProviderKey, ...]) -> _Group:
        """A model group new in a refresh, counted and indexed from its candidates' state now."""
        group = _Group(name, tuple(map(self._providers.__getitem__, candidates)))
        for position, p in enumerate(group.providers):
            group.link(p, position)
        group.heapify()
        return group

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node(node_id)
        return node

    def _drop_retired(self, p: _Provider) -> None:
        del self._providers[p.key]
        p.node.providers.remove(p)
        self._unhealthy.pop(p.key, None)

    def _remove(self, waiter: Waiter, state: WaiterState) -> None:
        waiter.state = state
        del self._waiters[waiter.seq]
        if waiter._group is not None:
            waiter._group.forget(waiter)
        elif waiter.attempt > 1:
            self._retries.remove(waiter)

    def _enqueue_in_order(self, waiter: Waiter) -> None:
        """Add a retried waiter to the queue at its arrival place: O(queue), retries only."""
        waiters = self._waiters
        if not waiters or next(reversed(waiters)) < waiter.seq:
            waiters[waiter.seq] = waiter
            return
        items = list(waiters.items())
        items.insert(bisect.bisect_left(items, waiter.seq, key=lambda item: item[0]), (waiter.seq, waiter))
        self._waiters = dict(items)

    def _fail_unindexed(self, waiter: Waiter, error: AdmissionError) -> Failed:
        waiter.state = FAILED
        waiter.error = error
        del self._waiters[waiter.seq]
        return Failed(waiter, error)

    def _grant(
        self,
        p: _Provider,
        model: str,
        long: bool,
        arrival: int,
        enqueue_time: float,
        attempt: int = 1,
        tried: tuple[ProviderKey, ...] = (),
    ) -> Lease:
        lease = Lease(next(self._lease_ids), p, model, long, arrival, enqueue_time, attempt, tried)
        p.in_flight += 1
        if long:
            p.long_in_flight += 1
        p.leases[lease.id] = lease
        if p.health is PROBE:
            p.health = PROBING
            p.admitting = False
            p.probe_lease = lease.id
            p.probes += 1
            lease.probe = True
        p.reindex()
        return lease

    def _reportable(self, lease: Lease) -> _Provider | None:
        """The provider a report of ``lease`` concerns, or None if the report is stale."""
        if lease._reported:
            return None
        lease._reported = True
        p = lease._slot
        if self._providers.get(p.key) is not p or not p.configured:
            return None
        if p.epoch != lease._epoch or p.node.generation != lease.generation:
            return None
        return p

    def _eject(self, p: _Provider, now: float) -> list[Decision]:
        p.streak += 1
        duration = self._config.outlier.ejection_time(p.streak)
        p.health = EJECTED
        p.admitting = False
        p.epoch += 1
        p.probe_lease = 0
        p.ejected_until = now + duration
        p.ejections += 1
        self._unhealthy[p.key] = p
        p.reindex()
        decisions: list[Decision] = [Ejected(p.key, p.ejected_until, duration, p.failures)]
        decisions.extend(self._dispatch(g for g, _ in p.groups))
        return decisions

    def _restore(self, p: _Provider) -> list[Decision]:
        p.health = HEALTHY
        p.admitting = True
        p.failures = p.streak = p.probe_lease = 0
        p.epoch += 1
        del self._unhealthy[p.key]
        p.reindex()
        decisions: list[Decision] = [Restored(p.key)]
        decisions.extend(self._dispatch(g for g, _ in p.groups))
        return decisions

    def _forget_health(self, p: _Provider) -> None:
        """A provider left the config: it starts healthy if it comes back; its reports are stale."""
        p.health = HEALTHY
        p.admitting = True
        p.failures = p.streak = p.probe_lease = 0
        p.epoch += 1
        self._unhealthy.pop(p.key, None)

    def _reopen_probe(self, p: _Provider) -> None:
        """The probe ended without a report (cancelled, fenced): the next grant probes again."""
        p.health = PROBE
        p.admitting = True
        p.probe_lease = 0

    def _dispatch(self, groups: Iterable[_Group]) -> list[Decision]:
        """Grant waiters of ``groups``, earliest first, while one has a dispatchable candidate.

        Within one group and kind, waiters share their candidates: if the head
        cannot run, nobody behind it can. So the next waiter to grant is the
        earliest head (over the groups and both kinds) whose group's index has
        a candidate for its kind, and it goes to that candidate. Queued retries
        of these groups (their own candidates) compete by arrival number too.
        """
        groups = tuple(groups)
        retries = self._retries_of(groups) if self._retries else []
        groups = tuple(g for g in groups if g.normal_live or g.long_live)
        decisions: list[Decision] = []
        while groups or retries:
            first: Waiter | None = None
            best: _Provider | None = None
            for g in groups:
                for long in (False, True):
                    w = g.head(long)
                    if w is not None and (first is None or w.seq < first.seq):
                        choice = g.best(long)
                        if choice is not None:
                            first, best = w, choice
            for w in retries:
                if first is not None and w.seq > first.seq:
                    break
                if w.state is QUEUED:
                    choice = _best_of(w._candidates, w.long)
                    if choice is not None:
                        first, best = w, choice
                        break
            if first is None or best is None:
                break
            self._remove(first, GRANTED)
            w = first
            lease = self._grant(best, w.model, w.long, w.seq, w.enqueue_time, w.attempt, w.tried)
            first.lease = lease
            decisions.append(Granted(first, lease))
        return decisions

    def _retries_of(self, groups: tuple[_Group, ...]) -> list[Waiter]:
        names = {g.name for g in groups}
        return [w for w in self._retries if w.model in names]

    def _fence(self, node: _Node) -> Iterator[Revoked]:
        for p in tuple(node.providers):
            if not p.leases:
                continue
            for lease in tuple(p.leases.values()):
                lease._released = True
                lease._revoked = True
                if lease.probe and p.probe_lease == lease.id:
                    self._reopen_probe(p)
                yield Revoked(lease)
            p.leases.clear()
            p.in_flight = 0
            p.long_in_flight = 0
            if not p.configured:
                self._drop_retired(p)
            else:
                p.reindex()

    def _fail_stranded(self, groups: Iterable[_Group]) -> list[Decision]:
        """Fail, with Unavailable, queued waiters of ``groups`` left with no eligible candidate."""
        stranded: list[Waiter] = []
        for g in groups:
            for long in (False, True):
                if not g.could_run(long):
                    stranded.extend(g.live(long))
        if self._retries:
            stranded.extend(w for w in self._retries_of(tuple(groups)) if not _could_run(w._candidates, w.long))
        stranded.sort(key=lambda w: w.seq)
        decisions: list[Decision] = []
        for w in stranded:
            self._remove(w, FAILED)
            w.error = Unavailable(w.model, w.long)
            decisions.append(Failed(w, w.error))
        return decisions

    def __repr__(self) -> str:
        busy = sum(p.in_flight for p in self._configured)
        cap = sum(p.capacity for p in self._configured if p.eligible)
        return f"<AdmissionState {busy}/{cap} in flight with {len(self._waiters)} waiting>"


def _groups_of(providers: Iterable[_Provider], also: Iterable[_Group] = ()) -> list[_Group]:
    """The model groups listing any of ``providers``, each once (and ``also`` these)."""
    seen: dict[int, _Group] = {id(g): g for g in also}
    for p in providers:
        for g, _ in p.groups:
            seen.setdefault(id(g), g)
    return list(seen.values())


def _choose(candidates: tuple[_Provider, ...], long: bool, panic: bool) -> _Provider | None:
    """The rule by a scan (panic mode, retries): highest priority, then lowest load, then order.

    Only admitting candidates count unless ``panic``.
    """
    best = None
    best_prio = 0
    best_load = 0.0
    for p in candidates:
        if not p.eligible or p.in_flight >= p.capacity or not (p.admitting or panic):
            continue
        if long and p.long_in_flight >= p.long_capacity:
            continue
        prio = p.priority
        load = p.in_flight / p.capacity
        if best is None or prio > best_prio or (prio == best_prio and load < best_load):
            best, best_prio, best_load = p, prio, load
    return best


def _panic(candidates: tuple[_Provider, ...], long: bool) -> bool:
    """Panic mode: some candidate could run the request, and every such one is non-admitting."""
    found = False
    for p in candidates:
        if not p.eligible or (long and p.long_capacity < 1):
            continue
        if p.admitting:
            return False
        found = True
    return found


def _best_of(candidates: tuple[_Provider, ...], long: bool) -> _Provider | None:
    """A retry's choice among its own (untried) candidates, panic mode included."""
    best = _choose(candidates, long, False)
    if best is None and _panic(candidates, long):
        best = _choose(candidates, long, True)
    return best


def _could_run(candidates: tuple[_Provider, ...], long: bool) -> bool:
    """Whether some candidate could ever run the request without a config change."""
    return any(p.eligible and (not long or p.long_capacity >= 1) for p in candidates)


def _reasons(candidates: tuple[_Provider, ...], long: bool, tried: tuple[ProviderKey, ...]) -> tuple[str, ...]:
    """Why each candidate cannot take the request: the detail of an ``Unavailable``."""
    out = []
    for p in candidates:
        if p.key in tried:
            why = "already tried by this request"
        elif not p.configured:
            why = "removed from the configuration"
        elif not p.spec.enabled:
            why = "disabled (enabled=False)"
        elif not p.node.connected:
            why = f"node {p.node.node_id!r} is not connected (call connect({p.node.node_id!r}))"
        elif long and p.long_capacity < 1:
            why = "runs no long requests (long_context_capacity=0)"
        else:
            why = "eligible"
        out.append(f"{p.key}: {why}")
    return tuple(out)


def _untried(candidates: tuple[_Provider, ...], tried: tuple[ProviderKey, ...]) -> tuple[_Provider, ...]:
    return tuple(p for p in candidates if p.key not in tried)


def _seq(waiter: Waiter) -> int:
    return waiter.seq
