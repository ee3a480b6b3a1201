"""[edge-liveness] A dead Edge is noticed within the heartbeat interval, and dialled again.

MockClock over in-memory streams (exact timing, no sockets): the node's own
WebSocket (``open_edge_socket``) against the Edge's (``NodeSocket``), which
answers pings only while its reader reads -- as a paused (SIGSTOP) or wedged
Edge process does not, while its TCP connection stays open.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing

from iop_edge.nodes.connection import NodeSocket
from iop_node import EdgeClient, NodeConfig, NodeRuntime, ProviderConfig
from iop_node.edges.websocket import EdgeWebSocket, open_edge_socket
from iop_wire import Heartbeat, Register, Registered, decode, encode
from node.harness import node_config

pytestmark = pytest.mark.req("edge-liveness")

MOCK = ProviderConfig(id="m0", adapter="mock", capacity=1)
INTERVAL = 1.0
"""The node's heartbeat interval, seconds."""


@attrs.define(eq=False)
class FreezableEdge:
    """Edge ends over memory streams: each registers the node, then reads until :attr:`frozen` is set."""

    frozen: trio.Event = attrs.field(factory=trio.Event)
    connections: int = 0
    heartbeats: int = 0
    dropped_at: list[float] = attrs.field(factory=list)
    frozen_at: float = 0.0

    @asynccontextmanager
    async def connect(self, nursery: trio.Nursery) -> AsyncIterator[EdgeWebSocket]:
        client, server = trio.testing.memory_stream_pair()
        self.connections += 1
        nursery.start_soon(self._serve, server)
        async with open_edge_socket(
            client, "edge", "/", max_message_size=1 << 20, handshake_timeout=5, close_timeout=1
        ) as ws:
            try:
                yield ws
            finally:
                self.dropped_at.append(trio.current_time())

    async def _serve(self, stream: trio.abc.Stream) -> None:
        ws = NodeSocket(stream, 1 << 20)
        assert await ws.handshake()
        register = decode(await ws.get_message())
        assert isinstance(register, Register)
        await ws.send_message(encode(Registered(register.node_id, self.connections, int(INTERVAL * 1000))))
        if self.frozen.is_set():
            await trio.sleep_forever()  # not reached in the test: the second connection stays served
        async with trio.open_nursery() as nursery:

            async def freeze() -> None:
                await self.frozen.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(freeze)
            while True:  # reading answers the node's pings
                if isinstance(decode(await ws.get_message()), Heartbeat):
                    self.heartbeats += 1
        await trio.sleep_forever()  # frozen: the connection stays open, nothing is read or answered


async def test_a_paused_edge_is_dropped_within_the_heartbeat_interval_and_dialled_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge = FreezableEdge()
    config = node_config("ws://edge.invalid", MOCK, heartbeat_interval_ms=int(INTERVAL * 1000))
    with trio.fail_after(20 * INTERVAL):  # virtual time
        await _serve_and_freeze(edge, config)
    (dropped_at, _) = edge.dropped_at
    # Noticed after more than an interval of silence, within a quarter interval (one ping period) more.
    assert INTERVAL - INTERVAL / 4 < dropped_at - edge.frozen_at <= INTERVAL + INTERVAL / 4


async def _serve_and_freeze(edge: FreezableEdge, config: NodeConfig) -> None:
    async with trio.open_nursery() as nursery, NodeRuntime.from_config(config) as runtime:
        client = EdgeClient(config, runtime, connect=edge.connect, rng=random.Random(0))
        nursery.start_soon(client.run)
        while edge.heartbeats < 5:  # alive for 5 intervals: pings answered, the connection kept
            await trio.sleep(INTERVAL / 10)
        assert (edge.connections, edge.dropped_at) == (1, [])
        edge.frozen_at = trio.current_time()
        edge.frozen.set()
        while edge.connections < 2:
            await trio.sleep(INTERVAL / 10)
        client.shutdown()
