"""Provider lease states, node generations and model groups: the indexed side of the core.

A :class:`ProviderSlot` holds one provider's capacity, in-flight counters and
health, shared by every :class:`ModelGroup` listing it; a group keeps the
choice index of its candidates and its queued waiters (see the module
docstring of ``_state.py`` for why it is built this way).
"""

from __future__ import annotations

import enum
import itertools
import struct
from collections import deque
from heapq import heapify, heappop, heappush, heapreplace
from typing import final

from iop_admission._config import ProviderKey, ProviderSpec
from iop_admission._errors import Unavailable
from iop_admission._ledger import TokenLedger

from .choice import choose, could_run, reasons
from .records import QUEUED, Lease, Waiter


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
COMPACT_MIN = 64

# Stamps of provider changes; an index entry is fresh while its stamp is the provider's.
STAMPS = itertools.count(1)

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


class NodeState:
    __slots__ = ("node_id", "generation", "connected", "providers")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.generation = 0
        self.connected = False
        self.providers: list[ProviderSlot] = []  # configured and retired-with-leases


class ModelGroup:
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

    A group of one candidate (``single``) keeps no heap: its choice is that
    candidate when it has room, read from the candidate itself -- the entry the
    heap would hold, without the pushes.

    Waiters of a group share its candidates, so they wait in two FIFO deques
    (normal, long) in arrival order, with lazy deletion like the heaps.
    """

    __slots__ = (
        "name",
        "providers",
        "single",
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
        "budgeted",
    )

    def __init__(self, name: str, providers: tuple[ProviderSlot, ...]) -> None:
        self.name = name
        self.providers = providers
        self.single = providers[0] if len(providers) == 1 else None  # the one candidate: no heap
        self.budgeted = sum(p.budgeted for p in providers)  # candidates admitting by a token budget
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

    def best(self, long: bool, tokens: int | None = None, seq: int | None = None) -> ProviderSlot | None:
        """The candidate the rule picks for a request of this kind; None if none is dispatchable.

        The heap holds admitting candidates only; in panic mode (every eligible
        candidate is ejected or probing) the choice scans the candidates instead.
        With candidates that admit by a token budget ([token-ledger]), the top
        is taken when the request's ``tokens`` fit it (beside the headroom held
        for a waiter other than ``seq``), else the rule scans the candidates
        they fit.
        """
        p = self.single
        if p is not None:
            # Admitting or not, its one candidate is chosen when it has room: not admitting, it
            # puts the group in panic mode, which chooses among the non-admitting ones.
            room = p.eligible and p.in_flight < p.capacity and (not long or p.long_in_flight < p.long_capacity)
            return p if room and (not self.budgeted or p.fits(tokens, long, seq)) else None
        p = self.top(long)
        if p is not None:
            if not self.budgeted or p.fits(tokens, long, seq):
                return p
            return choose(self.providers, long, False, tokens, seq)
        if self.in_panic(long):
            return choose(self.providers, long, True, tokens, seq)
        return None

    def slot_free(self, long: bool) -> bool:
        """Whether a candidate has a slot for this kind, tokens aside (an admitting one, or any in panic)."""
        return self.top(long) is not None or (self.single is None and self.in_panic(long))

    def top(self, long: bool) -> ProviderSlot | None:
        """The top of the choice index for this kind (tokens aside): None when no admitting candidate
        has room (a group of one candidate: that one if it has room)."""
        p = self.single
        if p is not None:
            if p.eligible and p.in_flight < p.capacity and (not long or p.long_in_flight < p.long_capacity):
                return p
            return None
        heap = self.long_heap if long else self.heap
        providers = self.providers
        while heap:
            entry = heap[0]
            p = providers[(entry >> _STAMP_BITS) & _POSITION_MASK]
            if entry & _STAMP_MASK == p.stamp:
                return p
            heappop(heap)
        return None

    def first_fitting(self, long: bool, before: int | None) -> tuple[Waiter, ProviderSlot] | None:
        """The earliest live waiter of one kind (arrived before ``before``) with a candidate its tokens fit.

        For a group with token budgets, where a waiter that does not fit does not
        stop a smaller one behind it (no head-of-line blocking): a scan of the
        deque, up to the first that fits.
        """
        if not self.slot_free(long):
            return None
        for w in self.long if long else self.normal:
            if before is not None and w.seq > before:
                return None
            if w.state is QUEUED:
                p = self.best(long, w.tokens, w.seq)
                if p is not None:
                    return w, p
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
        if len(heap) > 2 * len(self.providers) + COMPACT_MIN:
            providers = self.providers
            heap[:] = [e for e in heap if e & _STAMP_MASK == providers[(e >> _STAMP_BITS) & _POSITION_MASK].stamp]
            heapify(heap)

    def link(self, p: ProviderSlot, position: int) -> None:
        """Take in ``p``, just listed at ``position`` of a new group, as its other groups count and index it.

        Its ``reindex`` afterwards (if it changed) moves every group's counts
        together. Entries are appended unsorted: call :meth:`heapify` once all are in.
        """
        p.groups.append((self, position))
        p.indexed = p.indexed or self.single is None
        self.budgeted += p.budgeted
        self.eligible += p.counted
        self.long_eligible += p.long_counted
        self.admitting += p.admit_counted
        self.long_admitting += p.long_admit_counted
        if self.single is None and p.eligible and p.admitting and p.in_flight < p.capacity:
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

    def could_take(self, long: bool, tokens: int | None) -> bool:
        """:meth:`could_run`, the request's ``tokens`` too (some candidate's budget could hold them)."""
        if not self.could_run(long):
            return False
        return not self.budgeted or could_run(self.providers, long, tokens)

    def check_take(self, model: str, long: bool, tokens: int | None) -> None:
        """Raise :class:`Unavailable`, with each candidate's reason, unless :meth:`could_take`."""
        if not self.budgeted and (self.long_eligible if long else self.eligible) > 0:
            return  # could_run, and no budget to ask: could_take
        if not self.could_take(long, tokens):
            raise Unavailable(model, long, reasons(self.providers, long, (), tokens))

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
            if self.long_dead > COMPACT_MIN and self.long_dead > self.long_live:
                self.long = deque(self.live(True))
                self.long_dead = 0
        else:
            self.normal_live -= 1
            self.normal_dead += 1
            if self.normal_dead > COMPACT_MIN and self.normal_dead > self.normal_live:
                self.normal = deque(self.live(False))
                self.normal_dead = 0


class ProviderSlot:
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
        "held",
        "held_long",
        "leases",
        "revoked",
        "revoked_long",
        "groups",
        "stamp",
        "indexed",
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
        "ledger",
        "budgeted",
        "window",
        "reported",
        "report_reason",
        "reported_capacity",
        "reported_kv_use",
        "reported_preemptions",
    )

    def __init__(self, key: ProviderKey, node: NodeState, spec: ProviderSpec) -> None:
        self.key = key
        self.node = node
        self.in_flight = 0  # live leases + held + revoked leases still running
        self.long_in_flight = 0
        self.held = 0  # runs held elsewhere (AdmissionState.hold), counted in in_flight
        self.held_long = 0  # the long ones among them, counted in long_in_flight
        self.leases: dict[int, Lease] = {}  # live leases
        # Revoked leases whose body has not left yet ([revoked-in-flight]): counted in in_flight
        # (and the long ones in long_in_flight) until released.
        self.revoked: dict[int, Lease] = {}
        self.revoked_long = 0
        self.groups: list[tuple[ModelGroup, int]] = []  # (model group, position among its candidates)
        self.stamp = 0
        # In a group of several candidates (set by reindex and link). A grant or a release that
        # changes only the load of a provider that is not needs no reindex: a group of one reads
        # its candidate's load itself (ModelGroup.best), and the counts do not change.
        self.indexed = False
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
        self.reported = ""  # the node's last health report of this connection ([health-probe]), "" none
        self.report_reason = ""
        self.reported_capacity: int | None = None  # the backend's own parallelism, when below the spec's
        self.reported_kv_use: float | None = None  # the engine's own KV-cache use (0..1), when it says
        self.reported_preemptions: int | None = None  # the engine's count of preemptions, when it says
        self.configured = True
        self.eligible = False
        self.ledger: TokenLedger | None = None  # kept once made: its leases' reservations outlive a refresh
        self.budgeted = False
        self.set_spec(spec)

    def set_spec(self, spec: ProviderSpec) -> None:
        self.spec = spec
        self.capacity = spec.capacity if self.reported_capacity is None else min(spec.capacity, self.reported_capacity)
        # Admitting by tokens alone, a long request needs no long slot: never the bound.
        self.long_capacity = spec.capacity if spec.admit_by == "tokens" else spec.long_context_capacity
        self.priority = spec.priority
        self.window = spec.context_window_tokens
        budget = spec.budget
        if budget is not None:
            if self.ledger is None:
                self.ledger = TokenLedger(budget)
            else:
                self.ledger.set_budget(budget)
            self.ledger.window = self.window
        budgeted = budget is not None
        if budgeted != self.budgeted:
            for g, _ in self.groups:
                g.budgeted += 1 if budgeted else -1
            self.budgeted = budgeted

    # ------------------------------------------------------------ token budget

    def need(self, tokens: int | None, long: bool) -> int:
        """Tokens a request reserves here (:meth:`TokenLedger.need`, a budget's only)."""
        assert self.ledger is not None
        return self.ledger.need(tokens, long)

    def fits(self, tokens: int | None, long: bool, seq: int | None = None) -> bool:
        """Whether a request of ``tokens`` fits the budget now (always, without one), beside the
        headroom held for a waiter other than ``seq``."""
        ledger = self.ledger
        return not self.budgeted or ledger is None or ledger.fits_request(tokens, long, seq)

    def could_fit(self, tokens: int | None, long: bool) -> bool:
        """Whether a request of ``tokens`` could ever run here by its budget (always, without one)."""
        ledger = self.ledger
        return not self.budgeted or ledger is None or ledger.could_fit(self.need(tokens, long))

    def forget_held(self) -> None:
        """Drop the runs held elsewhere from the counters (the provider left the config)."""
        self.in_flight -= self.held
        self.long_in_flight -= self.held_long
        self.held = self.held_long = 0

    @property
    def busy(self) -> bool:
        """Whether a lease on it is not released yet (live, or revoked with its body still running)."""
        return bool(self.leases or self.revoked)

    def update_eligibility(self) -> None:
        self.eligible = self.configured and self.spec.enabled and self.node.connected
        self.reindex()

    def reindex(self) -> None:
        """Re-enter the choice index of every group listing this provider, after any change of its load,
        eligibility, health or spec: O(groups x log n); one not admitting (ejected, probe out) is left out like a full one."""
        self.stamp = next(STAMPS)
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
        indexed = False  # listed in a group of several candidates, which keeps a heap
        if not admit or self.in_flight >= self.capacity:
            for g, position in self.groups:
                if g.single is None:
                    indexed = True
                    g.drop_top(position, False)
            self.indexed = indexed
            return
        rank = 0
        long_room = self.long_in_flight < self.long_capacity
        for g, position in self.groups:
            if g.single is not None:  # chosen without a heap (ModelGroup.best)
                continue
            if not indexed:
                indexed = True
                rank = self.rank()
            entry = rank + (position << _STAMP_BITS)
            g.push(entry, position, False)
            if long_room:
                g.push(entry, position, True)
            else:
                g.drop_top(position, True)
        self.indexed = indexed

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
