"""The reconnect loop: open a connection, serve it with an EdgeSession, back off, repeat.

:class:`EdgeClient` is deliberately thin. How a connection is opened is
injectable (``connect``), so tests and simulations can hand it in-memory
WebSocket connections; everything that happens on a connection lives in
:class:`~iop_node.EdgeSession`.

Backoff: after any failed attempt or drop the client waits
``min(max_ms, initial_ms * 2**attempt)`` with +-``jitter`` relative jitter
(defaults 0.1 s doubling to 5 s, +-20 %), so a fleet of nodes does not
reconnect in lockstep after an Edge restart. A successful registration resets
the attempt counter. A non-retryable rejection (bad token, protocol mismatch)
ends the loop with :class:`~iop_node.RegistrationRejected`, except a protocol
mismatch of wire vN > 1: then the next connection offers v(N-1) (an Edge older
than the node), and the one after such a session ended offers the newest again.
"""

from __future__ import annotations

import logging
import random
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import final

import attrs
import trio
from trio_websocket import ConnectionClosed, HandshakeError

from iop_config import TlsFileError
from iop_node._errors import EdgeProtocolViolation, RegistrationRejected, RegistrationTimeout
from iop_node._runtime import NodeRuntime
from iop_node.config import NodeConfig, ReconnectConfig
from iop_node.edges.session import CLOSE_TIMEOUT, EdgeSession
from iop_node.edges.websocket import EdgeWebSocket, open_edge_socket
from iop_wire import MAX_MESSAGE_BYTES, OLDEST_PROTOCOL, PROTOCOL_VERSION, PROTOCOL_VERSIONS

logger = logging.getLogger("iop_node")

CONNECT_TIMEOUT = 10.0
"""Seconds to open the TCP connection and, again, for the WebSocket handshake."""

Connector = Callable[[trio.Nursery], AbstractAsyncContextManager[EdgeWebSocket]]
"""Opens one WebSocket connection to the Edge as an async context manager.

It is given a nursery for the connection's background tasks, if it has any
(:func:`websocket_connector`'s connections have none; a trio-websocket
connection's reader, as in ``trio_websocket.wrap_client_stream(nursery, stream, ...)``).
That nursery outlives the session, so such a reader can still complete the
closing handshake after a shutdown cancelled the session. A simulation can hand
the node's own socket on an in-memory stream here
(:func:`~iop_node.edges.websocket.open_edge_socket`, as :func:`websocket_connector` does).
"""


def first_delay(policy: ReconnectConfig, rng: random.Random) -> float:
    """Seconds to wait before the first attempt: at start, and after a registered connection ended.

    Uniform in ``[0, jitter * max_ms]`` [reconnect-storm]: when an Edge restarts,
    every node loses its connection at the same instant; without this spread
    they would all dial it again within a few milliseconds.
    """
    return rng.uniform(0.0, policy.jitter * policy.max_ms / 1000)


def backoff_delay(attempt: int, policy: ReconnectConfig, rng: random.Random) -> float:
    """Seconds to wait before connection attempt ``attempt + 1`` (``attempt`` >= 0).

    ``min(max_ms, initial_ms * 2**attempt)`` scaled by a uniform factor in
    ``[1 - jitter, 1 + jitter]``.
    """
    base = min(policy.max_ms, policy.initial_ms * (1 << min(attempt, 62))) / 1000
    return base * rng.uniform(1 - policy.jitter, 1 + policy.jitter)


def websocket_connector(
    url: str,
    *,
    connect_timeout: float = CONNECT_TIMEOUT,
    ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext | None] | None = None,
    local_address: str | None = None,
) -> Connector:
    """Return a connector that opens ``url`` (``ws://`` or ``wss://``); its errors are :meth:`_Endpoint.connect`'s.

    ``local_address`` binds the connection's source address (e.g. one of the
    host's several addresses); None lets the kernel choose.

    ``wss://`` uses ``ssl_context`` (default: verify against the system's CAs);
    a callable is called at each connection, so renewed certificate files are
    read at the next reconnect. The TLS handshake completes before the
    WebSocket handshake starts.

    The connection is the node's own :class:`~iop_node.edges.websocket.EdgeSocket`
    (wsproto on the plain socket, or on the TLS stream): it always closes its
    socket on exit (a close frame first, waiting for the Edge's for at most
    :data:`CLOSE_TIMEOUT`). Messages up to :data:`iop_wire.MAX_MESSAGE_BYTES`
    are accepted; a larger one closes the connection with 1009.
    """
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "wss"
    return _Endpoint(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or (443 if secure else 80),
        resource=(parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
        secure=secure,
        connect_timeout=connect_timeout,
        ssl_context=ssl_context,
        local_address=local_address,
    ).connect


@final
@attrs.frozen
class _Endpoint:
    """Where and how :func:`websocket_connector`'s connector connects."""

    host: str
    port: int
    resource: str
    secure: bool
    connect_timeout: float
    ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext | None] | None
    local_address: str | None

    @asynccontextmanager
    async def connect(self, nursery: trio.Nursery) -> AsyncIterator[EdgeWebSocket]:
        """One WebSocket connection to the Edge (``nursery`` unused: the node's socket has no reader task).

        Raises (on entering):
            OSError: the TCP connection failed.
            trio.BrokenResourceError: the TLS handshake failed (e.g. the Edge's
                certificate is not trusted; the cause is the ``ssl.SSLError``).
            trio.TooSlowError: connecting and the handshake took longer than
                ``connect_timeout`` seconds.
            trio_websocket.HandshakeError: the server refused the WebSocket handshake,
                or closed the connection before answering it (an Edge at its cap of
                pending connections closes new ones at once [reconnect-storm]: the
                node then backs off and retries instead of waiting out
                ``connect_timeout``).
        """
        with trio.fail_after(self.connect_timeout):
            context = None
            if self.secure:
                chosen = self.ssl_context() if callable(self.ssl_context) else self.ssl_context
                context = chosen or ssl.create_default_context()
            transport = await _open_transport(self.host, self.port, context, self.local_address)
        edge_socket = open_edge_socket(
            transport,
            self.host,
            self.resource,
            max_message_size=MAX_MESSAGE_BYTES,
            handshake_timeout=self.connect_timeout,
            close_timeout=CLOSE_TIMEOUT,
        )
        async with edge_socket as ws:
            yield ws


async def _open_transport(
    host: str, port: int, tls: ssl.SSLContext | None, local_address: str | None
) -> socket.socket | trio.SSLStream[trio.SocketStream]:
    """A TCP connection to ``host:port``: the plain socket, or TLS over it (handshake done) when ``tls`` is given.

    Checkpoints. On a failed TLS handshake the connection is closed before the error propagates.
    """
    tcp = await trio.open_tcp_stream(host, port, local_address=local_address)
    if tls is None:
        # trio connected it (address resolution, happy eyeballs, TCP_NODELAY); from here
        # on the node's WebSocket drives the plain socket (iop_node.edges.websocket).
        sock = socket.socket(fileno=tcp.socket.detach())
        sock.setblocking(False)
        return sock
    stream = trio.SSLStream(tcp, tls, server_hostname=host)
    try:
        await stream.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


@final
@attrs.define(eq=False)
class EdgeClient:
    """Keeps the node connected and registered to the Edge.

    Attributes:
        config: the node's config.
        runtime: gate and adapters, shared by every connection.
        connect: opens one connection; defaults to ``url``.
        rng: jitter source (seed it in tests).
        url: the Edge this client keeps the node registered with; None: the
            first of ``config.urls`` (:class:`~iop_node.EdgeClients` runs one
            client per Edge URL).
        session: the session of the current connection, if any.
        connections: number of connections opened so far.
        session_registered: whether the last connection got ``registered``.
        protocol: the wire version the next connection offers: the current one, or the
            previous right after an Edge refused it with ``protocol_mismatch`` (see :meth:`_attempt`).
    """

    config: NodeConfig
    runtime: NodeRuntime
    connect: Connector | None = None
    rng: random.Random = attrs.field(factory=random.Random)
    url: str | None = None
    session: EdgeSession | None = attrs.field(default=None, init=False)
    connections: int = attrs.field(default=0, init=False)
    session_registered: bool = attrs.field(default=False, init=False)
    protocol: int = attrs.field(default=PROTOCOL_VERSION, init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    _current: trio.CancelScope | None = attrs.field(default=None, init=False)

    async def run(self) -> None:
        """Connect, register and serve, reconnecting with backoff, until :meth:`shutdown`.

        The first attempt (at start, and after a registered connection ended)
        waits :func:`first_delay`; each failed one :func:`backoff_delay`.

        Checkpoints. :meth:`shutdown` cancels the current session (its runs are
        cancelled, a close 1001 goes to the Edge while the connection's reader
        is still alive to complete the closing handshake) and makes this
        return. Cancelling the caller instead also ends everything, but the
        closing handshake then waits out :data:`CLOSE_TIMEOUT`.

        Raises:
            RegistrationRejected: the Edge rejected the registration and said
                retrying will not help.
        """
        url = self.edge
        connect = self.connect or websocket_connector(url, ssl_context=lambda: self.config.ssl_context(url))
        token = self.config.resolved_token()
        policy = self.config.reconnect
        attempt = 0
        delay = first_delay(policy, self.rng)
        rejected: RegistrationRejected | None = None
        async with trio.open_nursery() as connection_tasks:
            try:
                while not self._stopping:
                    with self._phase():
                        await trio.sleep(delay)
                    if self._stopping:
                        break
                    problem = await self._attempt(connect, connection_tasks, token)
                    if self.session_registered:
                        attempt = 0
                        delay = first_delay(policy, self.rng)
                    else:
                        delay = backoff_delay(attempt, policy, self.rng)
                        attempt += 1
                    if not self._stopping:
                        logger.info("%s; reconnecting in %.2f s", problem, delay)
            except RegistrationRejected as exc:
                rejected = exc  # re-raised below, outside the nursery (no ExceptionGroup)
            connection_tasks.cancel_scope.cancel()
        if rejected is not None:
            raise rejected

    async def _attempt(self, connect: Connector, connection_tasks: trio.Nursery, token: str) -> str:
        """One connection: connect, serve, close. Returns why it ended (for the log)."""
        logger.info("connecting to %s", self.edge)
        self.session_registered = False
        try:
            with self._phase():
                async with connect(connection_tasks) as ws:
                    self.connections += 1
                    self.session = EdgeSession(ws, self.config, self.runtime, token, self.protocol)
                    try:
                        await self.session.serve()
                    finally:
                        self.session_registered = self.session.registered is not None
                        self.session = None
            self.protocol = PROTOCOL_VERSION  # the Edge may have been upgraded by the next connection
            return "connection closed"
        except RegistrationRejected as exc:
            if exc.code == "protocol_mismatch" and self.protocol > OLDEST_PROTOCOL:
                # An Edge one version older than this node: offer the previous version next.
                older = PROTOCOL_VERSIONS[PROTOCOL_VERSIONS.index(self.protocol) - 1]
                logger.warning(
                    "the edge does not speak wire v%d (%s); falling back to v%d", self.protocol, exc.reason, older
                )
                self.protocol = older
                return f"falling back to wire v{older}"
            if not exc.retryable:
                raise
            return str(exc)
        except (
            OSError,
            trio.BrokenResourceError,
            TlsFileError,
            trio.TooSlowError,
            HandshakeError,
            ConnectionClosed,
            EdgeProtocolViolation,
            RegistrationTimeout,
        ) as exc:
            return f"{type(exc).__name__}: {exc}".rstrip(": ")

    @property
    def edge(self) -> str:
        """The URL of the Edge this client connects to."""
        return self.url if self.url is not None else self.config.urls[0]

    def shutdown(self) -> None:
        """Stop :meth:`run`: cancel the current session or backoff and return. Idempotent."""
        self._stopping = True
        if self._current is not None:
            self._current.cancel()

    def _phase(self) -> trio.CancelScope:
        """A fresh cancel scope that :meth:`shutdown` cancels (already cancelled if stopping)."""
        self._current = trio.CancelScope()
        if self._stopping:
            self._current.cancel()
        return self._current
