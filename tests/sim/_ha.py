"""The seeded simulation with Edge replicas (issue 29): an HA group of Edges, one in-memory election.

:class:`HaWorld` is :class:`~tests.sim._world.World` with two or three
:class:`iop_edge.EdgeService` replicas, each with ``ha:`` and its real election
task (:meth:`iop_edge.ha.EdgeHa.campaign`) on :class:`SimEtcd`, an in-memory
stand-in for the etcd calls the election makes (leases with a TTL on the
virtual clock, the create-if-absent election key, its create revision as the
epoch). Each Node keeps one :class:`iop_node.EdgeClient` per Edge over its own
:class:`~tests.sim._wire.Wire`, all on the node's one runtime (its gate and
epoch fence), as ``edge_urls`` does. Clients go through a load balancer that
sends to the Edge that admits (``/readyz`` 200), sometimes to another one.

Fault sites, on top of every site of the one-Edge world:

- ``leader_step_down``: the leader resigns (its election task is cancelled: it
  steps down and revokes its lease; it campaigns again a little later), or
  etcd loses its lease (as ``etcdctl lease revoke``): a standby wins at the
  next poll, while the old leader admits until its next renewal answers
  "gone" -- two Edges believe they lead for a moment, the node's fence and
  gate decide;
- ``leader_pause``: the leader is stopped past its TTL (its node connections
  neither send nor read, its calls to etcd hang), then resumes; a successor
  is elected meanwhile. Its own timers still fire in the pause (a stopped
  process runs them at once when it wakes): what it must not do is dispatch;
- ``etcd_partition``: an Edge cannot reach etcd for a while (each call times
  out after a third of the TTL): as leader it steps down before its lease
  can expire in etcd.

Invariants, on top of the one-Edge world's (checked on every Edge, each with
its own lease ledger): no run of a fenced epoch is dispatched on a node (a run
of epoch e admitted by a node after it saw a newer epoch, in a leader message
or a run); no Edge admits after its lease could have expired in etcd
([ha-step-down]); the backend's concurrency stays within each provider's
capacity even when two Edges grant at once (the node's gate is the backstop:
steps where the Edges' grants together exceeded a capacity are counted).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from functools import partial
from typing import Any

import attrs
import trio
import trio.testing

from iop_admission import ProviderKey
from iop_edge import EdgeService
from iop_edge.config import EdgeConfig, HaConfig
from iop_edge.ha import EtcdUnavailable, KeyHolder
from iop_node import EdgeClient, StaleEpoch
from iop_node.edges.fence import EpochFence
from iop_node.edges.websocket import EdgeSocket

from . import _world
from ._report import Summary
from ._wire import Wire, node_socket, serve_edge_end
from ._world import NODES, PROVIDERS, SITES, Overrides, SeedResult, World, node_config

HA_SITES = ("leader_step_down", "leader_pause", "etcd_partition")
ALL_SITES = SITES + HA_SITES
TTL_S = 2
POLL_MS = 100
PAUSE_BOUND_S = 30.0
"""A paused Edge's hung etcd call gives up after this long even if never resumed (never reached)."""
PER_EDGE = (
    "service",
    "_ledger",
    "ledger_granted",
    "ledger_released",
    "ledger_revoked",
    "max_lease_id",
    "refresh_watermark",
    "seen_links",
    "probe_reports",
)
"""The :class:`World` attributes that are one Edge's; edge 0's live on the world, the others' in slots."""


@attrs.define(eq=False)
class SimEtcd:
    """The etcd of the group: leases expiring on the virtual clock, one election key."""

    revision: int = 1
    leases: dict[int, float] = attrs.field(factory=dict)
    """Lease id -> when it expires."""
    holder: tuple[KeyHolder, int] | None = None
    """The election key's holder and the lease it lives under."""
    revoked_by_fault: set[int] = attrs.field(factory=set)
    next_lease: int = 100

    def expire(self, now: float) -> None:
        for lease, expires in list(self.leases.items()):
            if expires <= now:
                self.drop(lease)

    def drop(self, lease: int) -> None:
        self.leases.pop(lease, None)
        if self.holder is not None and self.holder[1] == lease:
            self.holder = None
            self.revision += 1


@attrs.define(eq=False)
class SimStore:
    """One Edge's view of :class:`SimEtcd`: the :class:`iop_edge.ha.ElectionStore` it campaigns on."""

    etcd: SimEtcd
    name: str
    lease: int | None = None
    """The last lease granted to this Edge (the checker's view of its term)."""
    paused: trio.Event | None = None
    partitioned_until: float = 0.0

    async def _reach(self) -> float:
        """Wait out a pause, fail after a timeout in a partition; the time the call reaches etcd."""
        if self.paused is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(PAUSE_BOUND_S):
                await self.paused.wait()
        await trio.lowlevel.checkpoint()
        if trio.current_time() < self.partitioned_until:
            await trio.sleep(TTL_S / 3)  # the HTTP client's timeout
            raise EtcdUnavailable(f"sim: {self.name} cannot reach etcd")
        now = trio.current_time()
        self.etcd.expire(now)
        return now

    async def grant(self, ttl: int) -> int:
        now = await self._reach()
        self.etcd.next_lease += 1
        self.lease = self.etcd.next_lease
        self.etcd.leases[self.lease] = now + ttl
        return self.lease

    async def keepalive(self, lease: int) -> int:
        now = await self._reach()
        if lease not in self.etcd.leases:
            return 0
        self.etcd.leases[lease] = now + TTL_S
        return TTL_S

    async def revoke(self, lease: int) -> None:
        await self._reach()
        self.etcd.drop(lease)

    async def create(self, key: str, value: str, lease: int) -> tuple[bool, KeyHolder | None]:
        await self._reach()
        etcd = self.etcd
        if etcd.holder is None and lease in etcd.leases:
            etcd.revision += 1
            etcd.holder = (KeyHolder(value, etcd.revision), lease)
            return True, etcd.holder[0]
        return False, etcd.holder[0] if etcd.holder else None


class SimFence:
    """The node's :class:`~iop_node.edges.fence.EpochFence`, with the world's own record of what it let through.

    The record is independent of the fence's rule: the highest epoch the node
    was told of or ran, and a violation for any run of an older one admitted.
    Only the calls the node makes of its fence (``check``, ``raise_to``).
    """

    def __init__(self, world: HaWorld, node_id: str) -> None:
        self.inner = EpochFence()
        self.world = world
        self.node_id = node_id
        self.high = 0

    def raise_to(self, epoch: int) -> None:
        """A ``leader`` message (the session calls it)."""
        self.inner.raise_to(epoch)
        self.high = max(self.high, epoch)

    def check(self, epoch: int | None) -> None:
        """A run arrives (the runtime calls it before taking a permit)."""
        world = self.world
        try:
            self.inner.check(epoch)
        except StaleEpoch:
            world.result.fired["runs refused stale"] += 1
            world.trace(f"{self.node_id} refused a run of epoch {epoch} (seen {self.high})")
            raise
        if epoch is None:
            world.violation(f"{self.node_id}: a run without an epoch from an Edge with ha:")
            return
        if epoch < self.high:
            world.violation(f"{self.node_id}: a run of fenced epoch {epoch} dispatched after epoch {self.high}")
        self.high = max(self.high, epoch)
        world.result.fired["runs past the node fence"] += 1


class HaWorld(World):
    """One seed's HA group: :data:`World` with Edge replicas, an election and its faults."""

    sites = ALL_SITES
    expected_errors = _world.EXPECTED_ERRORS | {"503:not_leader", "503:leader_stepped_down"}

    def __init__(self, seed: int, clock: trio.testing.MockClock) -> None:
        self.edge_count = 2 + seed % 2
        self.etcd = SimEtcd()
        self.stores = [SimStore(self.etcd, f"edge-{i}.sim:8080") for i in range(self.edge_count)]
        super().__init__(seed, clock)
        if not self.enabled & set(HA_SITES):  # every HA seed exercises at least one HA fault
            self.enabled |= {HA_SITES[seed % len(HA_SITES)]}
            self.result.enabled = tuple(s for s in self.sites if s in self.enabled)
        self.lb = random.Random(f"sim:{seed}:lb")
        self.slots: list[dict[str, Any]] = [{}]
        self.services = [self.service]
        for i in range(1, self.edge_count):
            service = EdgeService(self._ha_config(self.edge_config(self.overrides), i))
            reports: Counter[tuple[ProviderKey, int]] = Counter()
            self._wrap_reports(service, reports)
            slot: dict[str, Any] = {
                "service": service,
                "_ledger": None,
                "ledger_granted": set(),
                "ledger_released": set(),
                "ledger_revoked": set(),
                "max_lease_id": 0,
                "refresh_watermark": 0,
                "seen_links": {n: {} for n in NODES},
                "probe_reports": reports,
            }
            self.slots.append(slot)
            self.services.append(service)
        self.node_clients: dict[str, list[EdgeClient]] = {}
        self.campaigns: list[trio.CancelScope | None] = [None] * self.edge_count
        self.pausing = False

    # ------------------------------------------------------------ replicas

    def _ha_config(self, config: EdgeConfig, index: int) -> EdgeConfig:
        ha = HaConfig(
            endpoints=("http://etcd.sim.invalid:2379",),
            advertise=self.stores[index].name,
            ttl_s=TTL_S,
            poll_interval_ms=POLL_MS,
        )
        return attrs.evolve(config, ha=ha)

    def edge_config(self, overrides: Overrides) -> EdgeConfig:
        config = _world.edge_config(overrides)
        services: list[EdgeService] = getattr(self, "services", [])
        index = services.index(self.service) if services else 0  # the Edge in focus (see apply)
        return self._ha_config(config, index)

    def _swap(self, index: int) -> None:
        if index == 0:
            return
        slot = self.slots[index]
        for name in PER_EDGE:
            mine = getattr(self, name)
            setattr(self, name, slot[name])
            slot[name] = mine

    @contextmanager
    def focus(self, index: int) -> Iterator[None]:
        """Within the block, the world's per-Edge attributes are Edge ``index``'s (no checkpoint inside)."""
        self._swap(index)
        try:
            yield
        finally:
            self._swap(index)

    def focus_each(self) -> Iterator[int]:
        """Each Edge's index, that Edge in :meth:`focus` while the loop's body runs (consume it whole)."""
        for index in range(self.edge_count):
            with self.focus(index):
                yield index

    def front(self) -> EdgeService:
        """The load balancer: the Edge whose readiness says it admits; 1 in 10 requests anywhere."""
        services = self.services
        if self.lb.random() < 0.1:
            return self.lb.choice(services)
        leading = [s for s in services if s.ha is not None and s.ha.admits()]
        return leading[0] if leading else services[0]

    def leader(self) -> int | None:
        for index, service in enumerate(self.services):
            if service.ha is not None and service.ha.leadership.leading:
                return index
        return None

    @asynccontextmanager
    async def watching(self, nursery: trio.Nursery) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for index in range(self.edge_count):
                with self.focus(index):
                    admission = self.service.admission
                    ledger = await stack.enter_async_context(admission.subscribe(buffer=1_000_000))
                    self._ledger = ledger
                    nursery.start_soon(admission.watch_ejections)
                    nursery.start_soon(self._campaign, index)
            yield

    async def _campaign(self, index: int) -> None:
        """Edge ``index``'s election task; after a resignation (:meth:`fault_leader_step_down`) it campaigns again."""
        ha = self.services[index].ha
        assert ha is not None
        while True:
            with trio.CancelScope() as scope:
                self.campaigns[index] = scope
                await ha.campaign(self.stores[index])
            await trio.sleep(self.frng.uniform(0.2, 1.5))
            self.trace(f"edge {index} campaigns again")

    def connected(self) -> bool:
        every = all(s.admission.is_connected(n) for s in self.services for n in NODES)
        return every and self.leader() is not None

    # ---------------------------------------------------------------- nodes

    @asynccontextmanager
    async def connector_to(self, index: int, node_id: str, nursery: trio.Nursery) -> AsyncIterator[EdgeSocket]:
        """A fresh wire to Edge ``index`` (paused with it while it is paused)."""
        wires = self.wires[node_id]
        wire = Wire(node_id, len(wires) + 1)
        wire.edge_index = index
        wire.paused = self.stores[index].paused
        wires.append(wire)
        assert self.nursery is not None
        self.nursery.start_soon(serve_edge_end, self.services[index], wire)
        async with node_socket(wire) as ws:
            yield ws

    async def node_process(self, node_id: str, restart: trio.Event | None = None) -> None:
        """One node 'process' after another, each connected to every Edge on one runtime (``edge_urls``)."""
        config = node_config(node_id)
        incarnation = 0
        while not self.stopping:
            incarnation += 1
            async with self.new_runtime(node_id, config, fence=SimFence(self, node_id)) as runtime:
                clients = [
                    EdgeClient(
                        config,
                        runtime,
                        connect=partial(self.connector_to, i, node_id),
                        rng=random.Random(f"sim:{self.seed}:{node_id}:{incarnation}:{i}"),
                        url=f"ws://{self.stores[i].name}",
                    )
                    for i in range(self.edge_count)
                ]
                self.node_clients[node_id] = clients
                for i, client in enumerate(clients):
                    self.clients[f"{node_id}@{i}"] = client
                self.runtimes[node_id] = runtime

                async with trio.open_nursery() as nursery:
                    for client in clients:
                        nursery.start_soon(_run_then_stop_all, client, clients)
            if self.stopping:
                return
            await trio.sleep(self.frng.uniform(0.05, 1.0))
            self.trace(f"node {node_id} restarted")

    async def fault_graceful_close(self) -> None:
        node_id = self.frng.choice(NODES)
        clients = self.node_clients.get(node_id, [])
        if clients and all(c.session is not None for c in clients):
            self.frng.choice(clients).shutdown()
            self.fired("graceful_close", node_id)

    # --------------------------------------------------------------- faults

    async def fault_leader_step_down(self) -> None:
        """A leader change: the leader resigns (its election task ends: it steps down, revokes its
        lease), or etcd loses its lease (the leader learns at its next renewal)."""
        index = self.leader()
        store = self.stores[index] if index is not None else None
        if store is None or store.lease is None or store.lease not in self.etcd.leases:
            return
        scope = self.campaigns[index] if index is not None else None
        if scope is not None and self.frng.random() < 0.5:
            scope.cancel()
            self.fired("leader_step_down", f"edge {index} resigns")
        else:
            self.etcd.revoked_by_fault.add(store.lease)
            self.etcd.drop(store.lease)
            self.fired("leader_step_down", f"edge {index} lost lease {store.lease}")
        await trio.lowlevel.checkpoint()

    async def fault_leader_pause(self) -> None:
        index = self.leader()
        if index is None or self.pausing:
            return
        duration = TTL_S + self.frng.uniform(0.1, 1.5)
        self.fired("leader_pause", f"edge {index} for {duration:.3f} s")
        self.pausing = True
        assert self.nursery is not None
        self.nursery.start_soon(self._pause, index, duration)

    async def _pause(self, index: int, duration: float) -> None:
        resumed = trio.Event()
        self.stores[index].paused = resumed
        wires = [w for ws in self.wires.values() for w in ws if w.edge_index == index]
        for wire in wires:
            wire.paused = resumed
        try:
            await trio.sleep(duration)
        finally:
            self.stores[index].paused = None
            for wire in (w for ws in self.wires.values() for w in ws if w.edge_index == index):
                wire.paused = None
            resumed.set()
            self.pausing = False
            self.trace(f"edge {index} resumed")

    async def fault_etcd_partition(self) -> None:
        index = self.leader()
        if index is None or self.frng.random() < 0.3:
            index = self.frng.randrange(self.edge_count)
        until = trio.current_time() + self.frng.uniform(0.3, 2.5 * TTL_S)
        self.stores[index].partitioned_until = until
        self.fired("etcd_partition", f"edge {index} until {until:.3f}")
        await trio.lowlevel.checkpoint()

    async def heal(self) -> None:
        for store in self.stores:
            store.partitioned_until = 0.0
        await super().heal()

    def apply(self, overrides: Overrides, why: str) -> None:
        """A reload of every Edge (they share one config but for ``ha.advertise``)."""
        for _ in self.focus_each():
            super().apply(overrides, why)

    # ---------------------------------------------------------------- checks

    def check(self) -> None:
        for _ in self.focus_each():
            super().check()
        self.check_ha()

    def check_ha(self) -> None:
        """[ha-step-down] no Edge admits past its lease; count steps where the Edges' grants exceed a capacity."""
        now = trio.current_time()
        granted: Counter[ProviderKey] = Counter()
        for index, service in enumerate(self.services):
            assert service.ha is not None
            lease = self.stores[index].lease
            if service.ha.admits() and lease is not None and lease not in self.etcd.revoked_by_fault:
                expires = self.etcd.leases.get(lease)
                if expires is None or expires <= now:
                    self.violation(f"edge {index} admits with its lease {lease} expired in etcd")
            for s in service.admission.snapshot().providers:
                granted[ProviderKey(s.node_id, s.provider_id)] += s.in_flight
        for key, n in granted.items():
            if n > PROVIDERS[key].capacity:
                self.result.fired["edges granted past a capacity together"] += 1

    def final_check(self) -> None:
        for _ in self.focus_each():
            super().final_check()
        if self.leader() is None:
            self.violation("no Edge leads after healing")


async def _run_then_stop_all(client: EdgeClient, clients: list[EdgeClient]) -> None:
    """One connection of a node shut down (a graceful close): the node process stops, then restarts."""
    await client.run()
    for other in clients:
        other.shutdown()


HA_COUNTS = ("runs past the node fence", "runs refused stale", "edges granted past a capacity together")
"""What :func:`ha_summary` prints after the table: runs the nodes ran and refused as stale, and the
steps where the Edges' grants together exceeded a capacity (the node's gate held)."""


def run_ha_seed(seed: int) -> SeedResult:
    """:func:`tests.sim._world.run_seed` for the HA world."""
    return _world.run_seed(seed, HaWorld)


def ha_summary() -> Summary:
    """An empty summary with the HA world's sites and counters (``run_and_summarize(..., summary=)``)."""
    return Summary(sites=ALL_SITES, extra=HA_COUNTS)
