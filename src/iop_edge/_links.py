"""The node socket: registration, heartbeats, and runs multiplexed per connection.

:class:`NodeRegistry` serves each node WebSocket from ``trio-websocket``'s
server (or from an in-memory stream in the simulation: it takes a
``WebSocketRequest``, whatever carries it). It owns no admission state: an
accepted registration calls ``admission.connect(node_id)``; the end of that
connection -- close, drop, heartbeat timeout, protocol error -- calls
``admission.disconnect(node_id, generation)`` at once, and a stale or rejected
connection never does. Admission then fences the generation's leases, which
cancels their request handlers.

Design notes:

- One nursery per connection, with one reader and one writer task. Only the
  writer touches the socket for sending; everything else queues frames in the
  connection's *outbox* without waiting (``send_nowait``), so a request
  handler being cancelled can never leave half a frame on the socket, and a
  node that stops reading its socket stalls only its own writer. A full outbox
  means the node is not keeping up: the connection is dropped.
- The reader never blocks on a consumer either: events for a run go into that
  run's bounded channel with ``send_nowait``. A run whose client cannot keep
  up overflows its channel and is cancelled (the handler answers
  ``client_too_slow``); heartbeats and other runs keep flowing.
- Every message from the node counts as liveness. No message for
  ``heartbeat_timeout`` seconds and the Edge drops the connection itself: the
  fallback for a peer that vanished without a close.
"""

from __future__ import annotations

import hmac
import itertools
import logging
from collections.abc import Callable
from types import TracebackType
from typing import final

import trio
from iop_admission import Admission
from iop_wire import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY,
    CLOSE_PROTOCOL_ERROR,
    PROTOCOL_VERSION,
    Cancel,
    Heartbeat,
    ProtocolError,
    Register,
    Registered,
    Rejected,
    Run,
    RunEnd,
    RunEvent,
    TunnelChunk,
    TunnelEnd,
    TunnelRequest,
    TunnelStart,
    decode,
    encode,
)
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

logger = logging.getLogger("iop_edge.nodes")

REGISTER_TIMEOUT = 10.0
"""Seconds a new connection has to send ``register``."""
OUTBOX_SIZE = 1024
"""Frames queued for one node before it counts as stalled and is dropped."""
RUN_BUFFER = 1024
"""Messages buffered for one run before its client counts as too slow."""
CANCEL_SETTLE_TIMEOUT = 2.0
"""Seconds a run left before its end waits for the node to confirm the cancel."""

RunMessage = RunEvent | RunEnd | TunnelStart | TunnelChunk | TunnelEnd


class NodeGone(Exception):
    """The node connection that should carry a run is gone (or not there)."""


@final
class RunChannel:
    """One run's messages from its node, and its cancellation.

    Use as ``async with``: leaving it before the end message arrived sends
    ``cancel`` to the node and waits, bounded, for the node to confirm it, so a
    lease held around it is released only once the node has freed the provider
    (see :meth:`__aexit__`).
    """

    __slots__ = ("run_id", "link", "receive", "ended", "overflowed")

    def __init__(self, run_id: str, link: NodeLink, receive: trio.MemoryReceiveChannel[RunMessage]) -> None:
        self.run_id = run_id
        self.link = link
        self.receive = receive
        self.ended = False
        self.overflowed = False

    async def __aenter__(self) -> RunChannel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave the run; a run left before its end is cancelled and its end awaited.

        The node frees a provider slot (its local permit, its upstream request)
        only when a cancelled run has unwound. A lease released as soon as
        ``cancel`` is queued lets the next waiter's run reach the node first,
        where it is refused with ``concurrency_limit`` (503 provider_busy). So
        this sends ``cancel`` and waits for the node's ``run_end`` or the end
        of the connection, then forgets the run.

        Checkpoints only for a run that had not ended. The wait is shielded
        from the caller's cancellation (a client that went away is the usual
        reason to be here) and bounded by :data:`CANCEL_SETTLE_TIMEOUT`.
        """
        if not self.ended and self.run_id in self.link._runs:
            try:
                self.link._queue(encode(Cancel(self.run_id)))
            except NodeGone:
                pass  # the connection is ending; the node cancels every run itself
            else:
                with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_SETTLE_TIMEOUT):
                    while not self.ended:
                        try:
                            await self.next()
                        except NodeGone:
                            break
                self.receive.close()
                if not self.ended:
                    self.link._forget_run(self.run_id, cancel=False)
                return
        self.receive.close()
        if not self.ended:
            self.link._forget_run(self.run_id, cancel=True)

    async def next(self) -> RunMessage:
        """The next message of this run.

        Checkpoints; cancellation leaves the run open (leave the ``with`` block
        to cancel it).

        Raises:
            NodeGone: the connection ended (or the run overflowed) before the end message.
        """
        try:
            message = await self.receive.receive()
        except trio.EndOfChannel:
            raise NodeGone("run dropped: client too slow" if self.overflowed else "node connection lost") from None
        if type(message) is RunEnd or type(message) is TunnelEnd:
            self.ended = True
        return message

    def buffered(self) -> list[RunMessage]:
        """The messages of this run that have arrived already, up to its end (never waits).

        Lets a relay write a burst of stream events to its client in one send.
        A lost connection is left for the next :meth:`next` to raise.
        """
        messages: list[RunMessage] = []
        while not self.ended:
            try:
                message = self.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if type(message) is RunEnd or type(message) is TunnelEnd:
                self.ended = True
            messages.append(message)
        return messages


@final
class NodeLink:
    """One registered node connection: one node, one generation."""

    def __init__(
        self,
        registry: NodeRegistry,
        node_id: str,
        generation: int,
        ws: WebSocketConnection,
    ) -> None:
        self.registry = registry
        self.node_id = node_id
        self.generation = generation
        self.ws = ws
        self.providers: tuple[str, ...] = ()
        self.last_seen = trio.current_time()
        self.cause = "error"
        self._outbox_send, self._outbox_receive = trio.open_memory_channel[str](OUTBOX_SIZE)
        self._runs: dict[str, trio.MemorySendChannel[RunMessage]] = {}
        self._channels: dict[str, RunChannel] = {}
        self._cancel_scope: trio.CancelScope | None = None

    # ----------------------------------------------------------------- runs

    def open_run(self, message: Run | TunnelRequest) -> RunChannel:
        """Register a run and queue its request frame for the node (never waits).

        Raises:
            NodeGone: the connection is closing or its outbox is full.
        """
        run_id = message.run_id
        send, receive = trio.open_memory_channel[RunMessage](RUN_BUFFER)
        self._runs[run_id] = send
        channel = RunChannel(run_id, self, receive)
        self._channels[run_id] = channel
        try:
            self._queue(encode(message))
        except NodeGone:
            self._forget_run(run_id, cancel=False)
            raise
        return channel

    def _queue(self, frame: str) -> None:
        try:
            self._outbox_send.send_nowait(frame)
        except trio.WouldBlock:
            logger.warning("node %s is not reading its socket; dropping it", self.node_id)
            self.cause = "error"
            self.abort()
            raise NodeGone(f"node {self.node_id} is stalled") from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise NodeGone(f"node {self.node_id} is disconnecting") from None

    def _forget_run(self, run_id: str, *, cancel: bool) -> None:
        send = self._runs.pop(run_id, None)
        self._channels.pop(run_id, None)
        if send is not None:
            send.close()
            if cancel:
                try:
                    self._queue(encode(Cancel(run_id)))
                except NodeGone:
                    pass  # the connection is ending; the node cancels every run itself

    def _deliver(self, run_id: str, message: RunMessage) -> None:
        send = self._runs.get(run_id)
        if send is None:
            return  # a late message for a run we already gave up on
        try:
            send.send_nowait(message)
        except trio.WouldBlock:
            channel = self._channels.get(run_id)
            if channel is not None:
                channel.overflowed = True
            self._forget_run(run_id, cancel=True)
            return
        except trio.BrokenResourceError:
            self._forget_run(run_id, cancel=True)
            return
        if type(message) is RunEnd or type(message) is TunnelEnd:
            self._runs.pop(run_id, None)
            self._channels.pop(run_id, None)
            send.close()

    @property
    def active_runs(self) -> int:
        """Runs this connection carries right now."""
        return len(self._runs)

    # ------------------------------------------------------------ lifecycle

    def abort(self) -> None:
        """Drop the connection now (its serve loop ends and disconnects the node)."""
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    async def _serve(self, heartbeat_timeout: float) -> None:
        async with trio.open_nursery() as nursery:
            self._cancel_scope = nursery.cancel_scope
            nursery.start_soon(self._write)
            await self._read(heartbeat_timeout)
            nursery.cancel_scope.cancel()

    async def _write(self) -> None:
        try:
            async for frame in self._outbox_receive:
                await self.ws.send_message(frame)
        except ConnectionClosed:
            self.abort()

    async def _read(self, heartbeat_timeout: float) -> None:
        ws = self.ws
        while True:
            with trio.move_on_after(heartbeat_timeout) as timer:
                try:
                    text = await ws.get_message()
                except ConnectionClosed as exc:
                    code = exc.reason.code if exc.reason else None
                    self.cause = "graceful" if code in (1000, 1001) else "error"
                    return
            if timer.cancelled_caught:
                self.cause = "heartbeat_timeout"
                logger.warning("node %s sent nothing for %.1fs: dropping it", self.node_id, heartbeat_timeout)
                return
            self.last_seen = trio.current_time()
            try:
                message = decode(text, max_bytes=self.registry.max_message_bytes)
            except ProtocolError as exc:
                logger.warning("node %s: protocol error: %s", self.node_id, exc.reason)
                self.cause = "error"
                await _close(ws, exc.close_code, exc.close_reason)
                return
            kind = type(message)
            if kind is Heartbeat:
                continue
            if kind in _RUN_MESSAGES:
                self._deliver(message.run_id, message)  # type: ignore[union-attr]
                continue
            logger.warning("node %s sent an unexpected %s", self.node_id, kind.__name__)
            self.cause = "error"
            await _close(ws, CLOSE_PROTOCOL_ERROR, f"unexpected {kind.__name__} message")
            return

    def _end_runs(self) -> None:
        self._outbox_send.close()
        for send in self._runs.values():
            send.close()
        self._runs.clear()
        self._channels.clear()

    def __repr__(self) -> str:
        return f"<NodeLink {self.node_id} gen {self.generation} runs {len(self._runs)}>"


_RUN_MESSAGES = frozenset((RunEvent, RunEnd, TunnelStart, TunnelChunk, TunnelEnd))


async def _close(ws: WebSocketConnection, code: int, reason: str) -> None:
    with trio.move_on_after(1.0) as scope:
        scope.shield = True
        try:
            await ws.aclose(code, reason)
        except ConnectionClosed:
            pass


@final
class NodeRegistry:
    """Accepts node connections and tracks the one live link per node.

    Args:
        admission: the pool; connect/disconnect are the only calls made on it.
        token_for: returns the token a node must present (None: unknown node).
            Read at each registration, so a refreshed config applies to new ones.
        heartbeat_timeout: seconds without any message before a node is dropped.
        max_message_bytes: limit for one frame from a node.
        on_connect, on_disconnect: observers (metrics, logs); never used for state.
    """

    def __init__(
        self,
        admission: Admission,
        *,
        token_for: Callable[[str], str | None],
        heartbeat_timeout: float,
        max_message_bytes: int,
        on_connect: Callable[[str, int], None] | None = None,
        on_disconnect: Callable[[str, int, str], None] | None = None,
    ) -> None:
        self.admission = admission
        self.token_for = token_for
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._links: dict[str, NodeLink] = {}
        self._run_ids = itertools.count(1)

    def link(self, node_id: str, generation: int) -> NodeLink:
        """The live connection of ``node_id`` in ``generation``.

        Raises:
            NodeGone: no such live connection.
        """
        link = self._links.get(node_id)
        if link is None or link.generation != generation:
            raise NodeGone(f"node {node_id} generation {generation} is not connected")
        return link

    def links(self) -> tuple[NodeLink, ...]:
        """Every live connection."""
        return tuple(self._links.values())

    def new_run_id(self) -> str:
        """A run id unique for the life of this Edge."""
        return f"r{next(self._run_ids)}"

    async def serve(self, request: WebSocketRequest) -> None:
        """Serve one node connection from accept to close.

        Checkpoints (it runs for the life of the connection). Cancellation
        closes the connection (going away) and disconnects the node.
        """
        try:
            ws = await request.accept()
        except ConnectionClosed:
            return
        link: NodeLink | None = None
        try:
            link = await self._register(ws)
            if link is None:
                return
            await link._serve(self.heartbeat_timeout)
        finally:
            if link is not None:
                self._release(link)
            if not ws.closed:
                await _close(ws, CLOSE_GOING_AWAY, "edge closing connection")

    async def _register(self, ws: WebSocketConnection) -> NodeLink | None:
        with trio.move_on_after(REGISTER_TIMEOUT):
            try:
                text = await ws.get_message()
            except ConnectionClosed:
                return None
            try:
                message = decode(text, max_bytes=self.max_message_bytes)
            except ProtocolError as exc:
                await _close(ws, exc.close_code, exc.close_reason)
                return None
            if type(message) is not Register:
                return await self._reject(ws, "bad_message", "the first message must be register", None)
            node_id = message.node_id
            if message.protocol != PROTOCOL_VERSION:
                return await self._reject(
                    ws,
                    "protocol_mismatch",
                    f"protocol {message.protocol} is not supported (edge speaks {PROTOCOL_VERSION})",
                    node_id,
                )
            expected = self.token_for(node_id)
            if expected is None:
                return await self._reject(ws, "unknown_node", f"node {node_id!r} is not configured", node_id)
            if not hmac.compare_digest(expected.encode(), message.token.encode()):
                return await self._reject(ws, "bad_token", "invalid token", node_id)
            if node_id in self._links:
                return await self._reject(ws, "duplicate", f"node {node_id!r} already has a live connection", node_id)
            generation = self.admission.connect(node_id)
            link = NodeLink(self, node_id, generation, ws)
            link.providers = tuple(p.id for p in message.providers)
            self._links[node_id] = link
            interval_ms = max(1, int(self.heartbeat_timeout * 1000 / 3))
            link._queue(encode(Registered(node_id, generation, interval_ms)))
            logger.info(
                "node %s registered: generation %d, providers %s",
                node_id,
                generation,
                ", ".join(link.providers) or "none",
            )
            if self._on_connect is not None:
                self._on_connect(node_id, generation)
            return link
        await _close(ws, CLOSE_POLICY, "register timeout")
        return None

    async def _reject(self, ws: WebSocketConnection, code: str, reason: str, node_id: str | None) -> None:
        logger.warning("rejected node registration %s: %s (%s)", node_id or "?", reason, code)
        retryable = code == "duplicate"
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            try:
                await ws.send_message(encode(Rejected(code, reason, retryable)))
            except ConnectionClosed:
                pass
        await _close(ws, CLOSE_POLICY, code)
        return None

    def _release(self, link: NodeLink) -> None:
        """The connection ended: disconnect its generation (a stale one changes nothing)."""
        if self._links.get(link.node_id) is link:
            del self._links[link.node_id]
        link._end_runs()
        if self.admission.disconnect(link.node_id, link.generation):
            logger.info("node %s generation %d disconnected (%s)", link.node_id, link.generation, link.cause)
            if self._on_disconnect is not None:
                self._on_disconnect(link.node_id, link.generation, link.cause)

    def node_status(self, node_ids: list[str]) -> list[dict[str, object]]:
        """Per configured node: connected, generation, last heartbeat age (no secrets)."""
        now = trio.current_time()
        out = []
        for node_id in node_ids:
            link = self._links.get(node_id)
            out.append(
                {
                    "node_id": node_id,
                    "connected": link is not None,
                    "generation": self.admission.generation(node_id),
                    "last_heartbeat_age": None if link is None else round(max(0.0, now - link.last_seen), 3),
                    "active_runs": 0 if link is None else link.active_runs,
                }
            )
        return out

    def close_all(self) -> None:
        """Drop every node connection at once (the fallback when the Edge is cancelled)."""
        for link in tuple(self._links.values()):
            link.cause = "graceful"
            link.abort()

    async def aclose_all(self) -> None:
        """Close every node connection with 1001 (going away), all at once.

        Call it before cancelling the server: the close handshake needs the
        connections' reader tasks alive to see each node's reply. Checkpoints;
        each close is bounded (1 s) and shielded.
        """
        async with trio.open_nursery() as nursery:
            for link in tuple(self._links.values()):
                link.cause = "graceful"
                nursery.start_soon(_close, link.ws, CLOSE_GOING_AWAY, "edge shutting down")
