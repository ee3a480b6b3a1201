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

* **Global arrival order without scanning.** Each provider indexes the waiters
  that list it, normal and long separately, in arrival order. Arrival numbers
  only grow, so each index is a FIFO deque with lazy deletion; a waiter that
  leaves (granted elsewhere, cancelled, failed) is skipped when it reaches the
  front, and a deque is compacted when its dead entries outnumber its live
  ones. After a release on provider P the earliest waiter that can use P is
  the earlier of P's two index heads (the long head only when P has a free long
  slot), so one release costs O(1) amortised, independent of queue length.
  A long waiter blocked on long slots is simply not looked at: the normal
  waiter behind it runs (no head-of-line blocking) [cross-group-wakeup].

* **Generations fence.** ``connect`` starts a new generation of a node;
  ``disconnect`` with the current generation takes the node offline and
  revokes every live lease on its providers (counters drop at once; each lease
  is released exactly once -- the holder's later release finds it done).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import final

from ._config import PoolConfig, ProviderKey, ProviderSpec, validate_pool
from ._errors import AdmissionError, ModelNotFound, QueueFull, Unavailable
from ._snapshot import ProviderSnapshot

# Waiter states.
QUEUED = "queued"
GRANTED = "granted"
FAILED = "failed"
WITHDRAWN = "withdrawn"  # cancelled or timed out by its own task
TIMED_OUT = "timed_out"  # expired by AdmissionState.expire()

# A deque is compacted once it holds more than this many dead entries and more
# dead than live ones; the rebuild is paid for by the removals that made them.
_COMPACT_MIN = 64


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
    """

    __slots__ = (
        "id",
        "provider",
        "generation",
        "long",
        "model",
        "queue_wait",
        "_slot",
        "_released",
        "_revoked",
        "_scope",
    )

    def __init__(self, id: int, slot: _Provider, generation: int, long: bool, model: str) -> None:
        self.id = id
        self.provider: ProviderKey = slot.key
        self.generation = generation
        self.long = long
        self.model = model
        self.queue_wait = 0.0
        self._slot = slot
        self._released = False
        self._revoked = False
        self._scope: object = None  # the trio layer's cancel scope for the body

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
        state: ``queued``, ``granted``, ``failed``, ``withdrawn`` or ``timed_out``.
        lease: the granted lease, once ``state == "granted"``.
        error: the failure, once ``state == "failed"``.
        token: opaque slot for the I/O layer (the parked task).
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
        "token",
        "_candidates",
        "_indexed",
    )

    def __init__(self, seq: int, model: str, long: bool, now: float, deadline: float) -> None:
        self.seq = seq
        self.model = model
        self.long = long
        self.enqueue_time = now
        self.deadline = deadline
        self.state = QUEUED
        self.lease: Lease | None = None
        self.error: AdmissionError | None = None
        self.token: object = None
        self._candidates: tuple[_Provider, ...] = ()
        self._indexed: tuple[_Provider, ...] = ()  # providers whose index holds us

    @property
    def candidates(self) -> tuple[ProviderKey, ...]:
        """The waiter's candidate providers, in preference order."""
        return tuple(p.key for p in self._candidates)

    def __repr__(self) -> str:
        kind = " long" if self.long else ""
        return f"<Waiter {self.seq} {self.model!r}{kind} {self.state}>"


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


Decision = Granted | Failed | Revoked


class _Node:
    __slots__ = ("node_id", "generation", "connected", "providers")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.generation = 0
        self.connected = False
        self.providers: list[_Provider] = []  # configured and retired-with-leases


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
        "normal",
        "long",
        "normal_dead",
        "long_dead",
        "queued",
        "long_queued",
    )

    def __init__(self, key: ProviderKey, node: _Node, spec: ProviderSpec) -> None:
        self.key = key
        self.node = node
        self.in_flight = 0
        self.long_in_flight = 0
        self.leases: dict[int, Lease] = {}
        self.normal: deque[Waiter] = deque()
        self.long: deque[Waiter] = deque()
        self.normal_dead = 0
        self.long_dead = 0
        self.queued = 0  # live waiters indexed here (normal + long)
        self.long_queued = 0
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

    def head(self, long: bool) -> Waiter | None:
        """Earliest live waiter of one index, dropping dead entries from the front."""
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

    def forget(self, waiter: Waiter) -> None:
        """Account for a waiter that left; compact the index if mostly dead."""
        self.queued -= 1
        if waiter.long:
            self.long_queued -= 1
            self.long_dead += 1
            if self.long_dead > _COMPACT_MIN and self.long_dead > self.long_queued:
                self.long = deque(w for w in self.long if w.state is QUEUED)
                self.long_dead = 0
        else:
            self.normal_dead += 1
            live = self.queued - self.long_queued
            if self.normal_dead > _COMPACT_MIN and self.normal_dead > live:
                self.normal = deque(w for w in self.normal if w.state is QUEUED)
                self.normal_dead = 0

    def clear_index(self) -> None:
        self.normal.clear()
        self.long.clear()
        self.normal_dead = self.long_dead = 0
        self.queued = self.long_queued = 0


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
        self._models: dict[str, tuple[_Provider, ...]] = {}
        self._waiters: dict[int, Waiter] = {}  # queued only, in arrival order
        self._seq = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._max_queue = config.policy.max_queue
        self._timeout = config.policy.queue_timeout
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

    def is_connected(self, node_id: str) -> bool:
        """Whether the node is connected in its current generation."""
        node = self._nodes.get(node_id)
        return bool(node and node.connected)

    def provider_snapshots(self) -> tuple[ProviderSnapshot, ...]:
        """Per configured provider, in configuration order (see ProviderSnapshot)."""
        out = []
        for p in self._configured:
            spec = p.spec
            connected = p.node.connected
            eligible = p.eligible
            if not spec.enabled:
                status = "disabled"
            else:
                status = "available" if connected else "unavailable"
            out.append(
                ProviderSnapshot(
                    node_id=p.key.node_id,
                    provider_id=p.key.provider_id,
                    connected=connected,
                    status=status,
                    health="online" if connected else "offline",
                    generation=p.node.generation,
                    capacity=spec.capacity,
                    long_context_capacity=spec.long_context_capacity,
                    effective_capacity=spec.capacity if eligible else 0,
                    effective_long_capacity=spec.long_context_capacity if eligible else 0,
                    in_flight=p.in_flight,
                    long_in_flight=p.long_in_flight,
                    queued=p.queued if eligible else 0,
                    long_queued=p.long_queued if eligible else 0,
                    priority=spec.priority,
                )
            )
        return tuple(out)

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
        candidates = self._models.get(model)
        if candidates is None:
            raise ModelNotFound(model)
        best = _best(candidates, long)
        if best is not None:
            return self._grant(best, model, long)
        if not _any_eligible(candidates, long):
            raise Unavailable(model, long)
        if len(self._waiters) >= self._max_queue:
            raise QueueFull(model, self._max_queue)
        waiter = Waiter(next(self._seq), model, long, now, now + self._timeout)
        waiter._candidates = candidates
        self._index(waiter)
        self._waiters[waiter.seq] = waiter
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
        waiters, so they grow with arrival order and the scan stops at the first
        waiter still in time.
        """
        out = []
        for waiter in tuple(self._waiters.values()):
            if waiter.deadline > now:
                break
            self._remove(waiter, TIMED_OUT)
            out.append(waiter)
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
        if not slot.configured and not slot.leases:
            self._drop_retired(slot)
            return []
        if slot.queued:
            return self._dispatch((slot,))
        return []

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
        decisions.extend(self._dispatch(tuple(node.providers)))
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
        decisions.extend(self._fail_stranded(node.providers))
        return True, decisions

    # ------------------------------------------------------------------ refresh

    def refresh(self, config: PoolConfig) -> list[Decision]:
        """Apply a new configuration atomically; leases are kept.

        Validates first (on error nothing changes). Then: provider specs are
        replaced (a provider dropped from the config keeps its live leases
        until they end, but takes no new work); model groups are replaced;
        every queued waiter gets its model's new candidates and the deadline
        ``enqueue_time + new queue_timeout``; a waiter whose model is gone
        fails with :class:`ModelNotFound`, one with no eligible candidate left
        with :class:`Unavailable`; finally waiters are re-evaluated in arrival
        order against every provider.

        Raises:
            ConfigError: listing every problem; the state is unchanged.
        """
        validate_pool(config)
        self._config = config
        self._max_queue = config.policy.max_queue
        self._timeout = config.policy.queue_timeout
        for p in self._providers.values():
            p.configured = False
        self._install(config)
        for p in tuple(self._providers.values()):
            if not p.configured and not p.leases:
                self._drop_retired(p)

        decisions: list[Decision] = []
        waiters = tuple(self._waiters.values())
        for p in self._providers.values():
            p.clear_index()
        for w in waiters:
            w._indexed = ()  # every index was just cleared
            candidates = self._models.get(w.model)
            if candidates is None:
                decisions.append(self._fail_unindexed(w, ModelNotFound(w.model)))
                continue
            w._candidates = candidates
            w.deadline = w.enqueue_time + self._timeout
            if _any_eligible(candidates, w.long):
                self._index(w)
            else:
                decisions.append(self._fail_unindexed(w, Unavailable(w.model, w.long)))
        decisions.extend(self._dispatch(self._configured))
        return decisions

    # ----------------------------------------------------------------- internals

    def _install(self, config: PoolConfig) -> None:
        configured = []
        for key, spec in config.providers.items():
            p = self._providers.get(key)
            if p is None:
                node = self._node(key.node_id)
                p = _Provider(key, node, spec)
                self._providers[key] = p
                node.providers.append(p)
            else:
                p.set_spec(spec)
                p.configured = True
            configured.append(p)
        self._configured = tuple(configured)
        for p in self._providers.values():
            p.update_eligibility()
        self._models = {
            name: tuple(self._providers[k] for k in group.candidates) for name, group in config.models.items()
        }

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node(node_id)
        return node

    def _drop_retired(self, p: _Provider) -> None:
        del self._providers[p.key]
        p.node.providers.remove(p)

    def _index(self, waiter: Waiter) -> None:
        """Add a waiter to the index of each candidate that could ever run it."""
        long = waiter.long
        indexed = []
        for p in waiter._candidates:
            if long:
                if p.long_capacity < 1:
                    continue
                p.long.append(waiter)
                p.long_queued += 1
            else:
                p.normal.append(waiter)
            p.queued += 1
            indexed.append(p)
        waiter._indexed = tuple(indexed)

    def _remove(self, waiter: Waiter, state: str) -> None:
        waiter.state = state
        del self._waiters[waiter.seq]
        for p in waiter._indexed:
            p.forget(waiter)

    def _fail_unindexed(self, waiter: Waiter, error: AdmissionError) -> Failed:
        waiter.state = FAILED
        waiter.error = error
        del self._waiters[waiter.seq]
        return Failed(waiter, error)

    def _grant(self, p: _Provider, model: str, long: bool) -> Lease:
        lease = Lease(next(self._lease_ids), p, p.node.generation, long, model)
        p.in_flight += 1
        if long:
            p.long_in_flight += 1
        p.leases[lease.id] = lease
        return lease

    def _dispatch(self, providers: Iterable[_Provider]) -> list[Decision]:
        """Grant waiters, earliest first, while one of ``providers`` can take one.

        The earliest waiter that can use a provider with room is the earlier of
        that provider's index heads (the long head only with a free long slot);
        the earliest over all such heads is the next waiter to grant. It goes to
        its best dispatchable candidate (by priority, load, candidate order).
        """
        providers = tuple(providers)
        decisions: list[Decision] = []
        while True:
            first: Waiter | None = None
            for p in providers:
                if not p.eligible or p.in_flight >= p.capacity or not p.queued:
                    continue
                w = p.head(False)
                if p.long_in_flight < p.long_capacity:
                    lw = p.head(True)
                    if lw is not None and (w is None or lw.seq < w.seq):
                        w = lw
                if w is not None and (first is None or w.seq < first.seq):
                    first = w
            if first is None:
                return decisions
            best = _best(first._candidates, first.long)
            assert best is not None, "index head must be dispatchable"
            self._remove(first, GRANTED)
            lease = self._grant(best, first.model, first.long)
            first.lease = lease
            decisions.append(Granted(first, lease))

    def _fence(self, node: _Node) -> Iterator[Revoked]:
        for p in tuple(node.providers):
            if not p.leases:
                continue
            for lease in tuple(p.leases.values()):
                lease._released = True
                lease._revoked = True
                yield Revoked(lease)
            p.leases.clear()
            p.in_flight = 0
            p.long_in_flight = 0
            if not p.configured:
                self._drop_retired(p)

    def _fail_stranded(self, providers: Iterable[_Provider]) -> list[Decision]:
        """Fail, with Unavailable, queued waiters of ``providers`` with no eligible candidate."""
        seen: dict[int, Waiter] = {}
        for p in providers:
            for q in (p.normal, p.long):
                for w in q:
                    if w.state is QUEUED:
                        seen[w.seq] = w
        decisions: list[Decision] = []
        for seq in sorted(seen):
            w = seen[seq]
            if not _any_eligible(w._candidates, w.long):
                self._remove(w, FAILED)
                w.error = Unavailable(w.model, w.long)
                decisions.append(Failed(w, w.error))
        return decisions

    def __repr__(self) -> str:
        busy = sum(p.in_flight for p in self._configured)
        cap = sum(p.capacity for p in self._configured if p.eligible)
        return f"<AdmissionState {busy}/{cap} in flight with {len(self._waiters)} waiting>"


def _best(candidates: tuple[_Provider, ...], long: bool) -> _Provider | None:
    """The dispatchable candidate to use: highest priority, then lowest load, then order."""
    best = None
    best_prio = 0
    best_load = 0.0
    for p in candidates:
        if not p.eligible or p.in_flight >= p.capacity:
            continue
        if long and p.long_in_flight >= p.long_capacity:
            continue
        if best is None:
            best, best_prio, best_load = p, p.priority, p.in_flight / p.capacity
            continue
        prio = p.priority
        if prio < best_prio:
            continue
        load = p.in_flight / p.capacity
        if prio > best_prio or load < best_load:
            best, best_prio, best_load = p, prio, load
    return best


def _any_eligible(candidates: tuple[_Provider, ...], long: bool) -> bool:
    """Whether some candidate could ever run the request without a config change."""
    for p in candidates:
        if p.eligible and (not long or p.long_capacity >= 1):
            return True
    return False
