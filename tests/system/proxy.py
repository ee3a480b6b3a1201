"""The whole-system check's link faults: a loopback TCP proxy per Edge between the Nodes and its node socket.

Each Node dials the proxy's port, which forwards the bytes both ways to the Edge's node socket.
The nemesis sets its :class:`Mode`:

- ``pass``: bytes flow;
- ``delay``: every chunk waits ``delay`` seconds before it is forwarded (a slow link);
- ``blackhole``: nothing is forwarded either way, the connections stay open (a partition: neither
  side sees a close, only silence);
- ``half_open``: the Edge's bytes no longer reach the Node, the Node's still reach the Edge;
- ``drop``: every connection is closed at once and new ones are closed on arrival (a link that
  resets).

Runs in the check's own trio loop; :meth:`LinkProxy.serve` is started in a nursery and lives
until it is cancelled.
"""

from __future__ import annotations

from typing import Literal

import attrs
import trio

Mode = Literal["pass", "delay", "blackhole", "half_open", "drop"]


@attrs.define(eq=False)
class LinkProxy:
    """Forwards ``port`` to ``target``'s port on loopback, as :attr:`mode` says."""

    target: int
    mode: Mode = "pass"
    delay: float = 0.0
    port: int = 0
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _open: set[trio.SocketStream] = attrs.field(factory=set)

    def set(self, mode: Mode, delay: float = 0.0) -> None:
        """Switch the mode for every connection, open or new."""
        self.mode, self.delay = mode, delay
        self._changed.set()
        self._changed = trio.Event()
        if mode == "drop":
            for stream in list(self._open):
                stream.socket.close()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, client: trio.SocketStream) -> None:
        if self.mode == "drop":
            await client.aclose()
            return
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.target)
        except OSError:
            await client.aclose()
            return
        self._open.update((client, upstream))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, client, upstream, False, nursery.cancel_scope)
                nursery.start_soon(self._pump, upstream, client, True, nursery.cancel_scope)
        finally:
            self._open.difference_update((client, upstream))
            for stream in (client, upstream):
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    async def _pump(
        self, source: trio.SocketStream, sink: trio.SocketStream, to_node: bool, done: trio.CancelScope
    ) -> None:
        """Copy ``source`` to ``sink`` under the current mode; the pair ends when either side does."""
        try:
            while True:
                data = await source.receive_some(65536)
                if not data:
                    break
                while self.mode == "blackhole" or (self.mode == "half_open" and to_node):
                    await self._changed.wait()  # held, not dropped: the stream stays whole
                if self.mode == "delay":
                    await trio.sleep(self.delay)
                if self.mode == "drop":
                    break
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        done.cancel()
