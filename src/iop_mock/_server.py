"""A small HTTP/1.1 server for the mock backend's ASGI app: h11 on non-blocking stdlib sockets.

Why not hypercorn: the mock stands in for a GPU server, whose token production costs the host
nothing, yet under hypercorn it spent ~150-180 µs of CPU per streamed token (ASGI wrappers,
hypercorn's protocol layers, trio's ``send_all`` rescheduling its task on every call), most of
two cores at 512 streams x 20 tokens/s. Here one task per connection drives an
:class:`h11.Connection` and calls the app with the ASGI ``scope``, ``receive`` and ``send``
the mock uses (``http`` only: no lifespan, websockets or HTTP/2):

- Accept: each wake-up of the listener accepts every connection waiting (as uvicorn's asyncio
  loop does, up to its backlog), where ``trio.serve_listeners`` accepts one per scheduling
  round: a Node opening hundreds of connections at once to a mock busy streaming met seconds
  of accept delay that a real server does not add.
- Keep-alive: a connection serves requests one after another until the client closes it or
  asks to (``connection: close``), or sends nothing of a next request for
  ``keep_alive_timeout`` seconds (5 s, as hypercorn's and uvicorn's default: a client's pool
  meets idle connections closed by the server, as with a real one); a malformed request gets a
  400 and the connection closes.
- The whole request body is read before the app runs; ``expect: 100-continue`` is answered.
- ``receive`` returns the body once, then waits for the client to go away and returns
  ``http.disconnect`` (bytes of a pipelined next request read meanwhile are kept for it).
- ``send``: the response head goes out with the first body message, in one ``send()``; a body
  message is framed by h11 and written with one non-blocking ``send()`` from the app's task,
  which waits (``wait_writable``) only for what the socket did not take. Once the client is
  gone it raises :class:`OSError`, as ASGI servers do.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, final

import h11
import trio

__all__ = ["serve_asgi"]

logger = logging.getLogger("iop_mock.server")

App = Callable[
    [Mapping[str, Any], Callable[[], Awaitable[Mapping[str, Any]]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]

_RECEIVE_SIZE = 65536
_SERVER = [(b"server", b"iop-mock")]


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
    try:
        async with trio.open_nursery() as nursery:
            for sock in sockets:
                sock.setblocking(False)
                nursery.start_soon(_accept, sock, nursery, app, keep_alive_timeout)
            task_status.started(bound)
    finally:
        for sock in sockets:
            sock.close()


_GIVEN_UP = frozenset({errno.ECONNABORTED, errno.ECONNRESET, errno.EPROTO, errno.EPERM, errno.ETIMEDOUT})
"""``accept`` errors about one connection its client gave up: skipped."""


async def _accept(listener: socket.socket, nursery: trio.Nursery, app: App, keep_alive_timeout: float) -> None:
    """Serve every connection to ``listener``, accepting all those waiting at each wake-up. Checkpoints."""
    while True:
        await trio.lowlevel.wait_readable(listener)
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in _GIVEN_UP:
                    continue
                logger.error("accept failed (%s); retrying in 0.1 s", exc)
                await trio.sleep(0.1)
                break
            nursery.start_soon(_Connection(sock).serve, app, keep_alive_timeout)


@final
class _Connection:
    """One client connection: an h11 state machine over a non-blocking stdlib socket."""

    __slots__ = ("sock", "h11", "_body", "_head")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.h11 = h11.Connection(h11.SERVER)
        self._body: bytes | None = None
        self._head: h11.Response | None = None

    async def serve(self, app: App, keep_alive_timeout: float) -> None:
        """Serve requests until the client leaves or the connection cannot go on. Checkpoints."""
        try:
            while True:
                request = None
                with trio.move_on_after(keep_alive_timeout):
                    request = await self._next_request()
                if request is None:
                    return
                if not await self._call(app, request):
                    return
                if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                    return
                self.h11.start_next_cycle()
        except h11.RemoteProtocolError as error:
            await self._refuse(error)
        except OSError:
            pass  # the client is gone
        finally:
            self.sock.close()

    async def _next_request(self) -> h11.Request | None:
        """The next request with its whole body read (kept for ``receive``); None at the end."""
        request: h11.Request | None = None
        parts: list[bytes] = []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                if self.h11.they_are_waiting_for_100_continue:
                    await self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=_SERVER)))
                self.h11.receive_data(await self._recv())
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._body = b"".join(parts)
                return request
            else:  # ConnectionClosed, or PAUSED after a request we did not finish
                return None

    async def _call(self, app: App, request: h11.Request) -> bool:
        """Run the app for ``request``; False if the connection must close. Checkpoints."""
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode("latin-1"),
            "scheme": "http",
            "path": path,
            "raw_path": request.target,
            "query_string": query.encode("latin-1"),
            "headers": list(request.headers),
        }
        self._head = None
        try:
            await app(scope, self._receive, self._send)
        except OSError:
            return False
        except Exception:
            logger.exception("the app failed on %s %s", scope["method"], path)
            await self._answer_and_close(500, b"internal server error")
            return False
        return True

    async def _receive(self) -> dict[str, Any]:
        """ASGI ``receive``: the body once, then ``http.disconnect`` when the client leaves. Checkpoints."""
        body, self._body = self._body, None
        if body is not None:
            await trio.lowlevel.checkpoint()
            return {"type": "http.request", "body": body, "more_body": False}
        while data := await self._recv():
            self.h11.receive_data(data)  # a pipelined next request: h11 keeps it for the next cycle
        return {"type": "http.disconnect"}

    async def _send(self, message: Mapping[str, Any]) -> None:
        """ASGI ``send``; the head waits for the first body message. Checkpoints only when the socket is full.

        Raises:
            OSError: the client is gone.
        """
        if message["type"] == "http.response.start":
            self._head = h11.Response(status_code=message["status"], headers=[*_SERVER, *message.get("headers", ())])
            return
        if message["type"] != "http.response.body":
            return
        data = b""
        if self._head is not None:
            data, self._head = self.h11.send(self._head) or b"", None
        body = message.get("body", b"")
        if body:
            data += self.h11.send(h11.Data(data=body)) or b""
        if not message.get("more_body", False):
            data += self.h11.send(h11.EndOfMessage()) or b""
        if data:
            await self._write(data)

    async def _write(self, data: bytes) -> None:
        """Write ``data`` whole: one ``send()``, then waits only for what the socket did not take."""
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)

    async def _recv(self) -> bytes:
        """The next bytes from the client; ``b""`` once it closed (or reset) the connection. Checkpoints."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                data = self.sock.recv(_RECEIVE_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                waited = True
                continue
            except OSError:
                data = b""
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data

    async def _refuse(self, error: h11.RemoteProtocolError) -> None:
        """Answer a malformed request with the status h11 suggests (400 mostly)."""
        await self._answer_and_close(error.error_status_hint, f"bad request: {error}".encode())

    async def _answer_and_close(self, status: int, body: bytes) -> None:
        """Send a plain-text answer with ``connection: close``, if no response has started."""
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE) or self._head is not None:
            return
        headers = [*_SERVER, (b"content-type", b"text/plain"), (b"connection", b"close")]
        head = h11.Response(status_code=status, headers=[*headers, (b"content-length", str(len(body)).encode())])
        try:
            await self._write(
                self.h11.send(head) + self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
            )
        except (OSError, h11.LocalProtocolError):
            pass  # the client is gone, or h11 will not send this: the connection closes anyway
