"""An in-memory network link with fault knobs, for the simulation.

A :class:`Wire` is one ``trio.testing.memory_stream_pair`` connection between a
node and the Edge, each end wrapped in a :class:`SimStream`. Both ends speak
the production WebSocket code over it: the node's :class:`iop_node.edges.websocket.EdgeSocket`
(:func:`node_socket`) and the Edge's :class:`iop_edge.nodes.connection.NodeSocket`,
entered through ``NodeRegistry.serve_stream`` (:func:`serve_edge_end`). Faults
act on the wire, below the WebSocket, the way a real network misbehaves:

- ``fail_next_send(side)``: the next ``send_all`` on that end raises
  ``trio.BrokenResourceError`` (a send on a reset socket) -- either socket turns
  it into ``ConnectionClosed`` (1006) for the sender.
- ``blackhole()``: the peer vanishes without a close: bytes sent either way are
  silently lost, a local ``aclose`` sends no FIN either. Only a later
  :meth:`cut` (the sim's "TCP timeout") makes both ends see the end of stream.
- ``cut()``: both ends see EOF at once (no WebSocket close frame): an abrupt drop.
- ``paused`` (an event, set by the HA world): the Edge end neither sends nor
  reads until the event fires, as a stopped Edge process (``tests/sim/_ha.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import final

import attrs
import trio
import trio.testing

from iop_edge import EdgeService
from iop_edge.config import EdgeConfig
from iop_node.edges.session import CLOSE_TIMEOUT
from iop_node.edges.websocket import EdgeSocket, open_edge_socket
from iop_wire import MAX_MESSAGE_BYTES

EDGE = "edge"
NODE = "node"


@final
class Wire:
    """One connection; ``node_end`` and ``edge_end`` are its two streams."""

    def __init__(self, node_id: str, number: int) -> None:
        self.node_id = node_id
        self.number = number
        node_inner, edge_inner = trio.testing.memory_stream_pair()
        self._inner = (node_inner, edge_inner)
        self.node_end = SimStream(self, NODE, node_inner)
        self.edge_end = SimStream(self, EDGE, edge_inner)
        self.blackholed = False
        self.dead = False
        self.fail_next: dict[str, bool] = {EDGE: False, NODE: False}
        self.send_failures = 0
        self.edge_index = 0
        """Which Edge replica the wire reaches (:mod:`tests.sim._ha`)."""
        self.paused: trio.Event | None = None
        """Set while that Edge is paused: its end neither sends nor reads until the event fires."""

    async def edge_unpaused(self, side: str) -> None:
        """Wait while the Edge end is paused (a stopped process); no checkpoint otherwise."""
        if side == EDGE and self.paused is not None:
            await self.paused.wait()

    def fail_next_send(self, side: str) -> None:
        self.fail_next[side] = True

    def blackhole(self) -> None:
        self.blackholed = True

    def cut(self) -> None:
        """Both ends see end-of-stream now; later sends fail. Idempotent, synchronous."""
        if self.dead:
            return
        self.dead = True
        self.blackholed = False
        for inner in self._inner:
            inner.send_stream.close()  # the pump puts EOF into the peer's receive side

    def __repr__(self) -> str:
        state = "dead" if self.dead else "blackholed" if self.blackholed else "up"
        return f"<Wire {self.node_id}#{self.number} {state}>"


@final
class SimStream(trio.abc.Stream):
    """One end of a :class:`Wire`."""

    def __init__(
        self,
        wire: Wire,
        side: str,
        inner: trio.StapledStream[trio.testing.MemorySendStream, trio.testing.MemoryReceiveStream],
    ) -> None:
        self.wire = wire
        self.side = side
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        wire = self.wire
        await wire.edge_unpaused(self.side)
        if wire.fail_next[self.side]:
            wire.fail_next[self.side] = False
            wire.send_failures += 1
            await trio.lowlevel.checkpoint()
            raise trio.BrokenResourceError(f"sim: send failure on the {self.side} end of {wire!r}")
        if wire.dead:
            await trio.lowlevel.checkpoint()
            raise trio.BrokenResourceError(f"sim: {wire!r} is dead")
        if wire.blackholed:
            await trio.lowlevel.checkpoint()
            return
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        await self.wire.edge_unpaused(self.side)
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        if self.wire.blackholed:
            # The FIN is lost too; the peer learns only from the later cut.
            self.inner.receive_stream.close()
            await trio.lowlevel.checkpoint()
            return
        await self.inner.aclose()


HANDSHAKE_TIMEOUT = 10.0
"""Seconds a node waits for the Edge's answer to its WebSocket handshake (the production connect timeout)."""


async def serve_edge_end(service: EdgeService, wire: Wire) -> None:
    """Serve the Edge end of ``wire`` as the node socket's listener serves an accepted connection.

    ``NodeRegistry.serve_stream`` runs it: the pending caps (every in-memory
    stream is one ``unknown`` source, see :func:`one_source`), the handshake
    deadline, the Edge's :class:`~iop_edge.nodes.connection.NodeSocket`; it closes the stream.
    """
    await service.registry.serve_stream(wire.edge_end)


@asynccontextmanager
async def node_socket(wire: Wire) -> AsyncIterator[EdgeSocket]:
    """The node's end of ``wire``: its own WebSocket client, as ``websocket_connector`` opens it."""
    edge_socket = open_edge_socket(
        wire.node_end,
        "edge",
        "/",
        max_message_size=MAX_MESSAGE_BYTES,
        handshake_timeout=HANDSHAKE_TIMEOUT,
        close_timeout=CLOSE_TIMEOUT,
    )
    async with edge_socket as ws:
        yield ws


def one_source(config: EdgeConfig) -> EdgeConfig:
    """``config`` with its per-address pending cap raised to the overall one (``node_max_pending``).

    Every in-memory wire comes from the one ``unknown`` source, so the
    per-address cap (8 by default) would refuse a fleet's reconnect storm that
    real nodes, each from its own address, never meet. The overall cap and the
    counting of every connection in and out stay as in production.
    """
    return attrs.evolve(config, node_max_pending_per_address=config.node_max_pending)
