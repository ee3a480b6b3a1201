"""One connection to an upstream: its socket (:class:`iop_io.ByteStream`) and the parser of its current answer.

The layer under :mod:`iop_node.upstream.http11` (as httpcore's connection under
its HTTP/1.1 one): opening the socket, moving bytes with the read and write
timeouts, and feeding the answer's bytes to :class:`iop_http.AnswerParser`,
whose failures become ``httpx``'s here (the errors every layer above maps).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from typing import final

import attrs
import httpx
import trio

from iop_http import AnswerError, AnswerParser
from iop_io import ByteStream, PeerGone

Origin = tuple[bytes, bytes, int]
"""An upstream's scheme, host and port."""


class AnswerOverBound(httpx.RemoteProtocolError):
    """The answer went past one of the Node's bounds on what a backend sends (``UpstreamLimits``)."""


@final
class AnswerTooLarge(AnswerOverBound):
    """The answer's head, or the body of an answer relayed whole, is larger than its bound."""


def upstream_error(exc: AnswerError) -> httpx.RemoteProtocolError:
    """The ``httpx`` error for a failure of the answer's parser."""
    message = f"the upstream's answer: {exc}"
    if exc.kind == "too_large":
        return AnswerTooLarge(message)
    if exc.kind == "over_bound":
        return AnswerOverBound(message)
    return httpx.RemoteProtocolError(message)


async def open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket (``TCP_NODELAY`` set) to ``host``:``port``. Checkpoints.

    An IP address is connected with one non-blocking ``connect`` and a wait for
    writability (about a quarter of ``trio.open_tcp_stream``'s CPU, which resolves
    the name and races the addresses in a nursery); a host name, or Windows, goes
    through ``trio.open_tcp_stream``. Cancellation leaves nothing open.

    Raises:
        OSError: the connection failed.
    """
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = None
    if family is None or sys.platform == "win32":
        stream = await trio.open_tcp_stream(host, port)
        # trio connected it (address resolution, happy eyeballs, TCP_NODELAY); from here
        # on we drive the plain socket (see Connection).
        return socket.socket(fileno=stream.socket.detach())
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        error = sock.connect_ex((host, port))
        if error == errno.EINPROGRESS:
            await trio.lowlevel.wait_writable(sock)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        else:
            await trio.lowlevel.checkpoint()
        if error:
            raise OSError(error, os.strerror(error))
    except BaseException:
        sock.close()
        raise
    return sock


async def open_connection(origin: Origin, timeout: float) -> Connection:
    """A new connection to ``origin`` (plain ``http``). Checkpoints; cancellation leaves nothing open.

    Raises:
        httpx.ConnectTimeout: not connected within ``timeout`` seconds.
        httpx.ConnectError: the connection failed.
    """
    host = origin[1].decode("ascii")
    try:
        with trio.fail_after(timeout):
            sock = await open_socket(host, origin[2])
    except trio.TooSlowError:
        raise httpx.ConnectTimeout(f"connecting to {host}:{origin[2]} took over {timeout:g} s") from None
    except OSError as exc:
        raise httpx.ConnectError(f"cannot connect to {host}:{origin[2]}: {exc}") from None
    return Connection(origin, ByteStream(sock))


@final
@attrs.define(eq=False)
class Connection:
    """One upstream connection: its bytes (:class:`iop_io.ByteStream`) and the parser of its current answer.

    A write the socket takes whole costs no task switch (:class:`iop_io.ByteStream`);
    a read is one wait for readability plus the read.
    """

    origin: Origin
    io: ByteStream
    answer: AnswerParser = attrs.field(factory=AnswerParser)
    """The answer of the current exchange (a fresh parser per request)."""
    requests: int = 0
    """Requests sent on this connection so far (more than 1: it was reused)."""

    def close(self) -> None:
        """Close the socket now, waking any task waiting on it. Synchronous: safe in a cancelled task."""
        self.io.close()

    async def send_all(self, data: bytes, timeout: float) -> None:
        """Write all of ``data``. Checkpoints only when the send buffer is full.

        Raises:
            trio.TooSlowError: the data did not go out within ``timeout`` seconds.
            PeerGone: the socket failed or was closed.
        """
        sent = self.io.send_now(data)
        if sent == len(data):
            return
        with trio.fail_after(timeout):
            await self.io.flush(bytearray(memoryview(data)[sent:]))

    async def receive(self, timeout: float) -> bytes:
        """Read some bytes (``b""`` at EOF). Checkpoints.

        Raises:
            httpx.ReadTimeout: nothing arrived for ``timeout`` seconds.
            httpx.ReadError: the socket failed.
        """
        # A bare cancel scope: trio.fail_after's context-manager machinery would be paid on
        # every read (one per token per stream).
        with trio.CancelScope(deadline=trio.current_time() + timeout):
            return await self.receive_now()
        raise httpx.ReadTimeout(f"no data from the upstream for {timeout:g} s")

    async def receive_now(self) -> bytes:
        """Read some bytes (``b""`` at EOF), with no timeout of its own. Checkpoints (one wait for
        readability, then the read: the answer is rarely there yet when asked).

        Raises:
            httpx.ReadError: the socket failed.
        """
        try:
            return await self.io.receive_when_readable()
        except PeerGone as exc:
            raise read_error(exc) from None


def feed(answer: AnswerParser, data: bytes) -> None:
    """Parse bytes read from the upstream (``b""``: it closed the connection).

    Raises:
        httpx.RemoteProtocolError: the answer is not valid HTTP/1.1, or the
            connection closed in the middle of it (:class:`AnswerOverBound`:
            it went past a bound).
    """
    try:
        if data:
            answer.feed(data)
        else:
            answer.feed_eof()
    except AnswerError as exc:
        raise upstream_error(exc) from None


def read_error(exc: PeerGone) -> httpx.ReadError:
    """The ``httpx`` error for a failed read."""
    return httpx.ReadError(f"upstream read failed: {exc or 'the connection broke'}")
