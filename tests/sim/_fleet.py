"""A fleet at size in the simulation: many nodes on one Edge, dropped and reconnected at once.

[reconnect-storm] ``nodes`` real node clients (iop-node's :class:`EdgeClient`,
default reconnect policy) register over in-memory wires with a real
:class:`EdgeService`, on a mock clock; both ends speak the production WebSocket
code (see :mod:`tests.sim._wire`). Then, ``waves`` times, every wire is cut
at the same instant (an Edge restart, as the nodes see it) and the fleet comes
back. After each wave these must hold:

- every node is registered again, in a new generation, with exactly one live link;
- admission agrees: every provider available, nothing in flight, nothing queued;
- the node socket counts no connection pending (each was released when it registered);
- the dials were spread: no 100 ms window after the drop holds more than
  ``SPREAD_LIMIT`` of the fleet's reconnects (iop-node waits uniform(0, 1 s)
  before its first attempt).

Seeded: the nodes' jitter comes from ``random.Random(f"fleet:{seed}:{node}")``.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio
import trio.testing

from iop_admission import LocalGate
from iop_edge import EdgeService
from iop_edge.config import EdgeCandidate, EdgeConfig, EdgeModel, EdgeNode, EdgeProvider
from iop_node import EdgeClient, NodeConfig, NodeRuntime, ProviderConfig
from iop_node.edges.websocket import EdgeSocket

from ._wire import Wire, node_socket, one_source, serve_edge_end

TOKEN = "fleet-token"
SPREAD_LIMIT = 0.25
"""Largest share of the fleet's reconnects allowed in one 100 ms window after a mass drop."""


@attrs.define
class FleetResult:
    """What one fleet run saw; ``violations`` empty means every invariant held."""

    nodes: int
    waves: int
    registrations: int = 0
    violations: list[str] = attrs.Factory(list)
    busiest_window: float = 0.0


def _edge_config(nodes: int) -> EdgeConfig:
    ids = [f"node-{i}" for i in range(nodes)]
    config = EdgeConfig(
        nodes=tuple(EdgeNode(id=i, providers=(EdgeProvider(id="p0", capacity=1),), token=TOKEN) for i in ids),
        models=(EdgeModel(id="all", candidates=tuple(EdgeCandidate(node=i, provider="p0") for i in ids)),),
    )
    return one_source(config)


class Fleet:
    """The Edge, the nodes and their wires."""

    def __init__(self, nodes: int, seed: int) -> None:
        self.ids = [f"node-{i}" for i in range(nodes)]
        self.seed = seed
        self.service = EdgeService(_edge_config(nodes))
        self.wires: dict[str, Wire] = {}
        self.dials: list[float] = []
        self.nursery: trio.Nursery | None = None

    @asynccontextmanager
    async def connector(self, node_id: str, nursery: trio.Nursery) -> AsyncIterator[EdgeSocket]:
        wire = self.wires[node_id] = Wire(node_id, len(self.dials))
        self.dials.append(trio.current_time())
        assert self.nursery is not None
        self.nursery.start_soon(serve_edge_end, self.service, wire)
        async with node_socket(wire) as ws:
            yield ws

    async def node(self, node_id: str) -> None:
        config = NodeConfig(
            node_id=node_id,
            edge_url="ws://edge.sim.invalid",
            providers=(ProviderConfig(id="p0", adapter="mock", capacity=1),),
            token=TOKEN,
        )
        runtime = NodeRuntime(gate=LocalGate(limits={"p0": 1}, global_limit=1), adapters={})
        client = EdgeClient(
            config,
            runtime,
            connect=lambda nursery: self.connector(node_id, nursery),
            rng=random.Random(f"fleet:{self.seed}:{node_id}"),
        )
        await client.run()

    def all_registered(self, generation: int) -> bool:
        admission = self.service.admission
        return all(admission.is_connected(i) and admission.generation(i) == generation for i in self.ids)

    def check(self, wave: int, result: FleetResult) -> None:
        links = {link.node_id: link for link in self.service.registry.links()}
        if sorted(links) != sorted(self.ids):
            result.violations.append(f"wave {wave}: {len(links)} live links for {len(self.ids)} nodes")
        snap = self.service.admission.snapshot()
        for p in snap.providers:
            if p.status != "available" or p.in_flight or p.queued or p.generation != wave + 1:
                result.violations.append(f"wave {wave}: {p.node_id} {p.status} gen {p.generation} {p.in_flight}")
        if snap.queue_depth:
            result.violations.append(f"wave {wave}: queue depth {snap.queue_depth}")
        if pending := self.service.registry.limits.pending:
            result.violations.append(f"wave {wave}: {pending} node connections still counted pending")


async def _run(nodes: int, waves: int, seed: int) -> FleetResult:
    fleet = Fleet(nodes, seed)
    result = FleetResult(nodes, waves)
    async with trio.open_nursery() as nursery:
        fleet.nursery = nursery
        for node_id in fleet.ids:
            nursery.start_soon(fleet.node, node_id)
        for wave in range(waves + 1):
            with trio.move_on_after(60) as wait:
                while not fleet.all_registered(wave + 1):
                    await trio.sleep(0.05)
            if wait.cancelled_caught:
                result.violations.append(f"wave {wave}: not every node registered again within 60 s")
                break
            await trio.testing.wait_all_tasks_blocked()
            fleet.check(wave, result)
            if wave == waves:
                break
            dropped_at = trio.current_time()
            first = len(fleet.dials)
            for wire in fleet.wires.values():
                wire.cut()
            with trio.move_on_after(60):
                while len(fleet.dials) < first + nodes:
                    await trio.sleep(0.05)
            after = sorted(t - dropped_at for t in fleet.dials[first:])
            busiest = max((sum(1 for t in after if w / 10 <= t < (w + 1) / 10) for w in range(20)), default=0)
            result.busiest_window = max(result.busiest_window, busiest / nodes)
            if busiest > SPREAD_LIMIT * nodes:
                result.violations.append(f"wave {wave}: {busiest} of {nodes} reconnects in one 100 ms window")
        result.registrations = len(fleet.dials)
        nursery.cancel_scope.cancel()
    return result


def run_fleet(nodes: int = 1_000, waves: int = 2, seed: int = 0) -> FleetResult:
    """Run the fleet profile on a mock clock; see the module docstring."""
    return trio.run(_run, nodes, waves, seed, clock=trio.testing.MockClock(autojump_threshold=0))
