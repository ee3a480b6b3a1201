"""A small HTTP/1.1 server for the mock backend's ASGI app: :mod:`iop_http` framing on :mod:`iop_io`'s transport.

Why not hypercorn: the mock stands in for a GPU server, whose token production costs the host
nothing, yet under hypercorn its CPU per streamed token (ASGI wrappers, hypercorn's protocol
layers, trio's ``send_all`` rescheduling its task on every call) took most of the box at fleet load. Here one task per connection reads requests and calls
the app with the ASGI ``scope``, ``receive`` and ``send`` the mock uses (``http`` only: no
lifespan, websockets or HTTP/2). The bytes are framed by the project's one HTTP owner, as the
Edge's are:

- Accept: :func:`iop_io.accept_loop`, every connection waiting accepted at each wake-up (as
  uvicorn's asyncio loop does), where ``trio.serve_listeners`` accepts one per scheduling round:
  a Node opening hundreds of connections at once to a mock busy streaming met seconds of accept
  delay that a real server does not add.
- Requests: read by one :class:`iop_http.RequestReader` per connection (llhttp and the
  project's rules, as the Edge reads them); a refusal (a head, or a chunked body's framing) gets
  :func:`iop_http.error_response` (fixed text, ``connection: close``) and the connection closes.
- Keep-alive: a connection serves requests one after another until the client closes it or
  asks to (``connection: close``, HTTP/1.0), or sends nothing of a next request for
  ``keep_alive_timeout`` seconds (5 s, as hypercorn's and uvicorn's default: a client's pool
  meets idle connections closed by the server, as with a real one).
- The whole request body is read before the app runs; ``expect: 100-continue`` is answered.
- ``receive`` returns the body once, then waits for the client to go away and returns
  ``http.disconnect`` (bytes of a pipelined next request read meanwhile are kept for it).
- ``send``: the response head goes out with the first body message, encoded by
  :func:`iop_http.encode_head`; a body is framed by its ``content-length`` or else chunked
  (:func:`iop_http.encode_chunk`), written by :class:`iop_io.SocketTransport` with one
  non-blocking ``send()`` from the app's task, which waits only for what the socket did not
  take. Once the client is gone it raises :class:`OSError`, as ASGI servers do.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, final

import trio

from iop_http import (
    CLOSED,
    END_OF_MESSAGE,
    LAST_CHUNK,
    NEED_DATA,
    Refusal,
    RequestHead,
    RequestReader,
    encode_chunk,
    encode_head,
    error_response,
)
from iop_io import PeerGone, SocketTransport, accept_loop

__all__ = ["serve_asgi"]

logger = logging.getLogger("iop_mock.server")

App = Callable[
    [Mapping[str, Any], Callable[[], Awaitable[Mapping[str, Any]]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]

_SERVER: Final = (b"server", b"iop-mock")
_CONTINUE: Final = encode_head(100, [_SERVER])
_FAILED: Final = error_response(Refusal(500, "internal server error"))


async def serve_asgi(
    app: App,
    host: str,
    port: int,
    *,
    backlog: int = 1024,
    keep_alive_timeout: float = 5.0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` (0: a free port) until cancelled.

    Args:
        app: an ASGI 3 application (only ``http`` scopes are sent to it).
        host: the address to bind.
        port: the TCP port; 0 picks a free one.
        backlog: the listen queue length.
        keep_alive_timeout: seconds a connection may wait for its next request (the first one
            included) before the server closes it.
        task_status: receives the bound port once the socket listens.

    Raises:
        OSError: the address cannot be bound.

    Checkpoints. Runs until cancelled; cancellation closes the listener and every connection.
    """
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    bound = listeners[0].socket.getsockname()[1]

    sockets = [socket.socket(fileno=listener.socket.detach()) for listener in listeners]

    async def handle(stream: trio.SocketStream) -> None:
        await _Connection(SocketTransport(stream), app).serve(keep_alive_timeout)

    try:
        async with trio.open_nursery() as nursery:
            for sock in sockets:
                sock.setblocking(False)
                nursery.start_soon(accept_loop, sock, nursery, handle)
            task_status.started(bound)
    finally:
        for sock in sockets:
            sock.close()


class _Refused(Exception):
    """The request cannot be served: answer ``refusal`` and close the connection."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


@final
class _Connection:
    """One client connection: requests read one after another, each answered by the app."""

    __slots__ = ("transport", "app", "_reader", "_body", "_head", "_chunked", "_started", "_finished")

    def __init__(self, transport: SocketTransport, app: App) -> None:
        self.transport = transport
        self.app = app
        self._reader = RequestReader()
        self._body: bytes | None = None
        self._head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self._chunked = False
        self._started = False
        self._finished = False

    async def serve(self, keep_alive_timeout: float) -> None:
        """Serve requests until the client leaves or the connection cannot go on. Checkpoints."""
        try:
            async with trio.open_nursery() as nursery:
                self.transport.nursery = nursery  # for the flusher of what the socket did not take at once
                try:
                    await self._serve(keep_alive_timeout)
                except _Refused as refused:
                    await self.transport.send_all(error_response(refused.refusal))
                except PeerGone:
                    pass  # the client is gone
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            await self.transport.aclose()

    async def _serve(self, keep_alive_timeout: float) -> None:
        while True:
            request = None
            with trio.move_on_after(keep_alive_timeout):
                request = await self._next_request()
            if request is None or not await self._call(request) or self.transport.broken:
                return
            if not request.keep_alive:
                await self.transport.wait_written()
                return

    async def _next_request(self) -> RequestHead | None:
        """The next request with its whole body read (kept for ``receive``); None at the end.

        Raises:
            _Refused: the head or the body's framing is refused.
            PeerGone: the connection broke.
        """
        reader = self._reader
        head = await self._next_event()
        if head is None:
            return None
        if type(head) is Refusal:
            raise _Refused(head)
        assert type(head) is RequestHead
        if head.expect_continue and head.length and not reader.buffered:
            self.transport.write_nowait(_CONTINUE)
        parts: list[bytes] = []
        while (event := reader.next_event()) is not END_OF_MESSAGE:
            if type(event) is bytes:
                parts.append(event)
            elif event is NEED_DATA:
                if not await self._fill():
                    return None
            elif type(event) is Refusal:
                raise _Refused(event)
            else:
                return None  # CLOSED: the client left mid-body
        self._body = b"".join(parts)
        return head

    async def _next_event(self) -> RequestHead | Refusal | bytes | object | None:
        """The reader's next event, reading as it needs; None when no further request can come."""
        while (event := self._reader.next_event()) is NEED_DATA:
            if not await self._fill():
                return None
        return None if event is CLOSED else event

    async def _fill(self) -> bool:
        """Read more of the client's bytes into the reader; False at its end. Checkpoints."""
        data = await self.transport.receive_some()
        self._reader.feed(data)
        return bool(data)

    async def _call(self, request: RequestHead) -> bool:
        """Run the app for ``request``; False if the connection must close. Checkpoints."""
        target = request.path.decode("latin-1")
        path, _, query = target.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode("latin-1"),
            "scheme": "http",
            "path": path,
            "raw_path": request.path,
            "query_string": query.encode("latin-1"),
            "headers": request.headers,
        }
        self._head, self._started, self._finished, self._chunked = None, False, False, False
        try:
            await self.app(scope, self._receive, functools.partial(self.send, request=request))
        except OSError:
            return False
        except Exception:
            logger.exception("the app failed on %s %s", scope["method"], path)
            if not self._started:
                await self.transport.send_all(_FAILED)
            return False
        return self._finished

    async def _receive(self) -> dict[str, Any]:
        """ASGI ``receive``: the body once, then ``http.disconnect`` when the client leaves. Checkpoints."""
        body, self._body = self._body, None
        if body is not None:
            await trio.lowlevel.checkpoint()
            return {"type": "http.request", "body": body, "more_body": False}
        try:
            while await self._fill():
                pass  # a pipelined next request: kept in the buffer for the next cycle
        except PeerGone:
            pass
        return {"type": "http.disconnect"}

    async def send(self, message: Mapping[str, Any], request: RequestHead) -> None:
        """ASGI ``send`` of ``request``'s cycle; the head waits for the first body message (no body to a
        ``HEAD``). Checkpoints only when the socket is full.

        Raises:
            OSError: the client is gone.
        """
        if message["type"] == "http.response.start":
            self._head = (message["status"], [_SERVER, *message.get("headers", ())])
            return
        if message["type"] != "http.response.body":
            return
        if self.transport.broken:
            raise OSError("the client is gone")
        data = self._encode_head(request) if self._head is not None else b""
        body = b"" if request.method == b"HEAD" else message.get("body", b"")
        more = message.get("more_body", False)
        if self._chunked:
            data += encode_chunk(body) + (b"" if more else LAST_CHUNK)
        else:
            data += body
        self._finished = not more
        await self.transport.send_all(data)

    def _encode_head(self, request: RequestHead) -> bytes:
        """The response head: framed by its ``content-length``, else chunked (HTTP/1.1) or by closing
        the connection (HTTP/1.0); ``connection: close`` when the connection ends with it."""
        assert self._head is not None
        status, headers = self._head
        self._head, self._started = None, True
        framed = request.method == b"HEAD" or any(name.lower() == b"content-length" for name, _ in headers)
        self._chunked = not framed and request.keep_alive
        if self._chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        if not request.keep_alive:
            headers.append((b"connection", b"close"))
        return encode_head(status, headers)
