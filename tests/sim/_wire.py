"""An in-memory network link with fault knobs, for the simulation.

A :class:`Wire` is one ``trio.testing.memory_stream_pair`` connection between a
node and the Edge, each end wrapped in a :class:`SimStream`. Faults act on the
wire, below trio-websocket, the way a real network misbehaves:

- ``fail_next_send(side)``: the next ``send_all`` on that end raises
  ``trio.BrokenResourceError`` (a send on a reset socket) -- trio-websocket turns
  it into ``ConnectionClosed`` for the sender.
- ``blackhole()``: the peer vanishes without a close: bytes sent either way are
  silently lost, a local ``aclose`` sends no FIN either. Only a later
  :meth:`cut` (the sim's "TCP timeout") makes both ends see the end of stream.
- ``cut()``: both ends see EOF at once (no WebSocket close frame): an abrupt drop.
"""

from __future__ import annotations

from typing import final

import trio
import trio.testing
import trio_websocket

from iop_edge import EdgeService

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
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        if self.wire.blackholed:
            # The FIN is lost too; the peer learns only from the later cut.
            self.inner.receive_stream.close()
            await trio.lowlevel.checkpoint()
            return
        await self.inner.aclose()


async def serve_edge_end(service: EdgeService, wire: Wire) -> None:
    """Serve the Edge end of ``wire`` with the service's node registry, as its listener would."""
    try:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(10):
                    request = await trio_websocket.wrap_server_stream(nursery, wire.edge_end)
            except (trio_websocket.ConnectionClosed, trio.TooSlowError):
                nursery.cancel_scope.cancel()
                return
            await service.registry.serve(request)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await wire.edge_end.aclose()
