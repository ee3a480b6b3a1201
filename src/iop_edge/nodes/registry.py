"""The node socket's registry: who may register, and the one live link per node.

:class:`NodeRegistry` serves each connection of the node socket with its own
WebSocket end (:class:`NodeSocket`: wsproto, read in the link's reader task,
no reader task of its own): TCP connections from its listener and the
simulation's in-memory streams alike, through :meth:`NodeRegistry.serve_stream`.
It owns no admission state: an accepted registration calls
``admission.connect(node_id)``; the end of that connection -- close, drop,
heartbeat timeout, protocol error -- calls ``admission.disconnect(node_id,
generation)`` at once, and a stale or rejected connection never does. Admission
then fences the generation's leases, which cancels their request handlers.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import ssl
from collections.abc import Callable
from typing import NamedTuple, final

import trio
from trio_websocket import ConnectionClosed

from iop_admission import Admission, ProviderKey, ProviderReport
from iop_edge.ha.fencing import LeaderFence
from iop_edge.metrics import DisconnectCause
from iop_edge.nodes.connection import NodeSocket, close_quietly
from iop_edge.nodes.limits import PendingLimits, Source, source_of
from iop_edge.nodes.link import NodeLink
from iop_edge.nodes.peer_watch import PeerWatch, PendingSlot, peer_host
from iop_edge.nodes.runs import NodeGone
from iop_edge.status import NodeRow, NodeStatus
from iop_wire import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY,
    MAX_NODE_ID_CHARS,
    OLDEST_PROTOCOL,
    PROTOCOL_VERSIONS,
    ProtocolError,
    Register,
    Registered,
    Rejected,
    decode,
    encode,
    spoken,
    valid_node_id,
)

logger = logging.getLogger("iop_edge.nodes")


HANDSHAKE_TIMEOUT = 5.0
"""Default seconds from accept to a valid ``register`` (``node_handshake_timeout_ms``)."""


class _Rejection(NamedTuple):
    code: str
    reason: str
    node_id: str | None
    metric_reason: str | None = None  # the metrics label, when it says more than the wire code


class _Peer(NamedTuple):
    """What the Edge knows of a connection's other end before it registers."""

    source: Source
    stream: trio.abc.Stream | None
    cert_names: frozenset[str] | None
    """DNS names of the client certificate with mutual TLS; None without it."""


_BACKOFF_CODES = frozenset(("bad_token", "unknown_node"))
"""Rejections that answer a wrong credential: answered after the source's backoff."""


def _loggable(text: str) -> str:
    """A peer's identifier as a log line may carry it: as sent when printable and short, else escaped and cut."""
    if valid_node_id(text):
        return text
    return repr(text[:MAX_NODE_ID_CHARS]) + ("..." if len(text) > MAX_NODE_ID_CHARS else "")


def _problem(
    message: Register, peer: _Peer, token_for: Callable[[str], str | None], links: dict[str, NodeLink]
) -> _Rejection | None:
    """Why ``message`` from ``peer`` cannot register now (None: it can)."""
    node_id = message.node_id
    if not valid_node_id(node_id):  # too long or not printable: ``unknown_node`` at once
        return _Rejection("unknown_node", "the node id is too long or not printable", node_id)
    if message.protocol not in PROTOCOL_VERSIONS:
        upgrade = "the node" if message.protocol < OLDEST_PROTOCOL else "this edge"
        reason = f"wire v{message.protocol} is not spoken here (this edge speaks {spoken()}): upgrade {upgrade}"
        return _Rejection("protocol_mismatch", reason, node_id)
    expected = token_for(node_id)
    if expected is None:
        return _Rejection("unknown_node", f"node {node_id!r} is not configured", node_id)
    if peer.cert_names is not None and node_id not in peer.cert_names:
        reason = f"the client certificate is not issued to node {node_id!r}"
        return _Rejection("bad_token", reason, node_id, "cert_mismatch")
    # The bytes, exactly: a token holding a lone surrogate (valid JSON) is bytes that match nothing.
    if not hmac.compare_digest(expected.encode(), message.token.encode("utf-8", "surrogatepass")):
        return _Rejection("bad_token", "invalid token", node_id)
    if node_id in links:
        return _Rejection("duplicate", f"node {node_id!r} already has a live connection", node_id)
    return None


@final
class NodeRegistry:
    """Accepts node connections and tracks the one live link per node.

    Args:
        admission: the pool; connect/disconnect are the only calls made on it.
        token_for: returns the token a node must present (None: unknown node).
            Read at each registration, so a refreshed config applies to new ones.
        heartbeat_timeout: seconds without any message before a node is dropped.
        max_message_bytes: limit for one frame from a node.
        limits: the pending caps and failure backoff of the node socket
            (default: 256 pending, 8 per source, backoff 0.1 s doubling to 5 s).
        handshake_timeout: seconds from accept to a valid ``register``.
        ssl_context: serve TLS with it (read at each accept, so replacing it
            changes new connections only). If it requires client certificates,
            a node must present one naming its node id (a DNS name in the
            subject alternative names).
        on_connect, on_disconnect: observers (metrics, logs); never used for state.
        on_pending_closed: observer called with why a pending connection was
            closed by the Edge (``max_pending``, ``max_pending_per_source``,
            ``handshake_timeout``).
        on_rejected: observer called with ``(code, address_class)`` for every
            rejected registration.
    """

    def __init__(
        self,
        admission: Admission,
        *,
        token_for: Callable[[str], str | None],
        heartbeat_timeout: float,
        max_message_bytes: int,
        limits: PendingLimits | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
        on_connect: Callable[[str, int], None] | None = None,
        on_disconnect: Callable[[str, int, DisconnectCause], None] | None = None,
        on_pending_closed: Callable[[str], None] | None = None,
        on_rejected: Callable[[str, str], None] | None = None,
    ) -> None:
        self.admission = admission
        self.token_for = token_for
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self.limits = limits if limits is not None else PendingLimits(max_pending=256, max_pending_per_source=8)
        self.handshake_timeout = handshake_timeout
        self.ssl_context = ssl_context
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._on_pending_closed = on_pending_closed
        self._on_rejected = on_rejected
        self._links: dict[str, NodeLink] = {}
        self._run_ids = itertools.count(1)
        self.fence = LeaderFence(hold=admission.hold)  # [epoch-fencing] moved with this Edge's leadership

    def report_health(self, provider: ProviderKey, report: ProviderReport) -> None:
        """[health-probe] A node's report of one of its providers (:class:`~iop_edge.nodes.link.LinkHost`)."""
        self.admission.report_health(provider, report)

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

    # ------------------------------------------------------------- serving

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one accepted TCP connection of the node socket, from accept to close.

        The connection is *pending* until it registers: counted against the
        caps of :attr:`limits` (refused and closed at once beyond them), and
        closed if the WebSocket handshake and a valid ``register`` do not
        arrive within :attr:`handshake_timeout`. A stream that is not a socket
        (the simulation's in-memory ones) comes from one ``unknown`` source: its
        per-source cap counts them all. Never raises for what the peer does. Checkpoints (it runs for the life of the connection);
        cancellation closes the connection and disconnects its node.
        """
        source = source_of(peer_host(stream))
        refusal = self.limits.open(source)
        if refusal is not None:
            self._pending_closed(refusal)
            await trio.aclose_forcefully(stream)
            return
        slot = PendingSlot(self.limits, source)
        deadline = trio.current_time() + self.handshake_timeout
        try:
            peer = await self._secure(stream, source, deadline)
            if peer.stream is not None:
                watched = PeerWatch(peer.stream)
                peer = peer._replace(stream=watched)
                ws = await self._handshake(watched, deadline)
                if ws is not None:
                    await self._serve_ws(ws, peer, slot, deadline)
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # The peer broke the connection mid-handshake: its end, not the listener's.
            logger.debug("node socket: connection from %s broke: %r", source.key, exc)
        finally:
            slot.release()
            await trio.aclose_forcefully(stream)

    async def _secure(self, stream: trio.abc.Stream, source: Source, deadline: float) -> _Peer:
        """The TLS handshake by ``deadline`` when TLS is on; a peer whose ``stream`` is None failed it."""
        context = self.ssl_context
        if context is None:
            return _Peer(source, stream, None)
        tls = trio.SSLStream(stream, context, server_side=True)
        with trio.move_on_at(deadline) as timer:
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                logger.info("node socket: TLS handshake with %s failed: %s", source.key, exc.__cause__ or exc)
                self._pending_closed("tls_handshake")
                return _Peer(source, None, None)
        if timer.cancelled_caught:
            self._pending_closed("handshake_timeout")
            return _Peer(source, None, None)
        if context.verify_mode != ssl.CERT_REQUIRED:
            return _Peer(source, tls, None)
        cert = tls.getpeercert() or {}
        names = frozenset(str(value) for kind, value in cert.get("subjectAltName", ()) if kind == "DNS")
        return _Peer(source, tls, names)

    async def _handshake(self, watched: PeerWatch, deadline: float) -> NodeSocket | None:
        """The WebSocket handshake on ``watched`` by ``deadline``; None if the peer left, failed it or was too slow."""
        ws = NodeSocket(watched, self.max_message_bytes)
        with trio.move_on_at(deadline):
            return ws if await ws.handshake() else None
        self._pending_closed("handshake_timeout")
        return None

    async def _serve_ws(self, ws: NodeSocket, peer: _Peer, slot: PendingSlot, deadline: float) -> None:
        link: NodeLink | None = None
        try:
            link = await self._register(ws, peer, deadline)
            if link is None:
                return
            slot.release()  # registered: never counted against the pending caps again
            await link._serve(self.heartbeat_timeout)
        finally:
            if link is not None:
                self._release(link)
            if not ws.closed:
                await close_quietly(ws, CLOSE_GOING_AWAY, "edge closing connection")

    # -------------------------------------------------------- registration

    async def _register(self, ws: NodeSocket, peer: _Peer, deadline: float) -> NodeLink | None:
        """Read ``register`` by ``deadline`` and register the node, or reject it (then None)."""
        message: Register | _Rejection | None = None
        with trio.move_on_at(deadline) as timer:
            message = await self._read_register(ws)
        if timer.cancelled_caught:
            self._pending_closed("handshake_timeout")
            await close_quietly(ws, CLOSE_POLICY, "register timeout")
            return None
        if message is None:
            return None
        rejection = message if isinstance(message, _Rejection) else _problem(message, peer, self.token_for, self._links)
        if rejection is not None:
            await self._reject(ws, rejection, peer.source)
            return None
        assert isinstance(message, Register)
        return self._connect(ws, message)

    async def _read_register(self, ws: NodeSocket) -> Register | _Rejection | None:
        """The first message: a ``register``, a rejection, or None (connection closed)."""
        try:
            text = await ws.get_message()
        except ConnectionClosed:
            return None
        try:
            message = decode(text, max_bytes=self.max_message_bytes)
        except ProtocolError as exc:
            await close_quietly(ws, exc.close_code, exc.close_reason)
            return None
        if type(message) is not Register:
            return _Rejection("bad_message", "the first message must be register", None)
        return message

    def _connect(self, ws: NodeSocket, message: Register) -> NodeLink:
        node_id = message.node_id
        generation = self.admission.connect(node_id)
        link = NodeLink(self, node_id, generation, ws, message.protocol)
        link.providers = tuple(p.id for p in message.providers)
        self._links[node_id] = link
        interval_ms = max(1, int(self.heartbeat_timeout * 1000 / 3))
        link._queue(encode(Registered(node_id, generation, interval_ms)))
        self.fence.greet(link)
        logger.info(
            "node %s registered: generation %d, wire v%d, providers %s",
            node_id,
            generation,
            link.protocol,
            ", ".join(map(_loggable, link.providers)) or "none",
        )
        if self._on_connect is not None:
            self._on_connect(node_id, generation)
        return link

    async def _reject(self, ws: NodeSocket, rejection: _Rejection, source: Source) -> None:
        """Answer ``rejected`` and close; a failed credential is answered after its source's backoff.

        The token is never logged. Checkpoints; the delay is bounded by the
        limits' ``backoff_max``, the answer and the close by 1 s each.
        """
        code = rejection.code
        delay = self.limits.failed(source, trio.current_time()) if code in _BACKOFF_CODES else 0.0
        logger.warning(
            "rejected node registration %s from %s: %s (%s)%s",
            "?" if rejection.node_id is None else _loggable(rejection.node_id),
            source.key,
            rejection.reason,
            code,
            f"; answering in {delay:.2f} s" if delay else "",
        )
        if self._on_rejected is not None:
            self._on_rejected(rejection.metric_reason or code, source.address_class)
        await trio.sleep(delay)
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            try:
                await ws.send_message(encode(Rejected(code, rejection.reason, code == "duplicate")))
            except ConnectionClosed:
                pass
        await close_quietly(ws, CLOSE_POLICY, code)

    def _pending_closed(self, reason: str) -> None:
        logger.debug("node socket: closing a pending connection (%s)", reason)
        if self._on_pending_closed is not None:
            self._on_pending_closed(reason)

    def _release(self, link: NodeLink) -> None:
        """The connection ended: disconnect its generation (a stale one changes nothing)."""
        if self._links.get(link.node_id) is link:
            del self._links[link.node_id]
        link._end_runs()
        if self.admission.disconnect(link.node_id, link.generation):
            self.fence.forget(link.node_id)
            logger.info("node %s generation %d disconnected (%s)", link.node_id, link.generation, link.cause)
            if self._on_disconnect is not None:
                self._on_disconnect(link.node_id, link.generation, link.cause)

    def node_status(self, node_ids: list[str]) -> tuple[NodeStatus, ...]:
        """Per configured node: connected, generation, last heartbeat age, active runs (no secrets)."""
        return tuple(NodeStatus(**row) for row in self.node_rows(node_ids))

    def node_rows(self, node_ids: list[str]) -> list[NodeRow]:
        """:meth:`node_status` as plain dicts (:data:`~iop_edge.status.NodeRow`), without the objects."""
        now = trio.current_time()
        generation = self.admission.generation
        links = self._links
        out = []
        for node_id in node_ids:
            link = links.get(node_id)
            out.append(
                {
                    "node_id": node_id,
                    "connected": link is not None,
                    "generation": generation(node_id),
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
                nursery.start_soon(close_quietly, link.ws, CLOSE_GOING_AWAY, "edge shutting down")
