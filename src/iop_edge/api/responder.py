"""One HTTP response of the API: :class:`Responder` and the framing of its head."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, final

import trio

from iop_edge.api.rejections import RequestRejected
from iop_edge.api.rejections import canned as _canned
from iop_edge.listener.asgi import CONNECTION
from iop_edge.listener.cycle import PAUSE_READING
from iop_edge.listener.server import CannedResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


SSE = (b"content-type", b"text/event-stream")


@final
class Responder:
    """Sends one HTTP response; knows whether the head is out already, and whether a run was sent
    for it (``run_sent``: the request may have run at a backend, whatever its answer says)."""

    __slots__ = ("_send", "_scope", "started", "finished", "run_sent", "write_nowait", "respond_nowait")

    def __init__(
        self,
        send: Send,
        scope: Scope,
        write_nowait: Callable[[bytes], bool] | None = None,
        respond_nowait: Callable[[int, list[tuple[bytes, bytes]], bytes], bool] | None = None,
    ) -> None:
        self._send = send
        self._scope = scope
        self.started = False
        self.finished = False
        self.run_sent = False
        self.write_nowait = write_nowait
        """The listener's ``write_body_nowait``: a body chunk written from any task, never waiting."""
        self.respond_nowait = respond_nowait
        """The listener's ``respond_nowait``: a whole response written from any task, never waiting."""

    async def start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": list(headers)})

    async def chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes = b"") -> None:
        self.finished = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def whole(self, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> None:
        await self.start(status, framed(headers, body))
        await self.finish(body)

    async def pieces(
        self,
        status: int,
        headers: Iterable[tuple[bytes, bytes]],
        parts: list[bytes],
        written: Callable[[int], None] | None = None,
    ) -> None:
        """A whole response whose body is ``parts`` in order, never joined: one ``content-length``,
        then each piece written as it comes and dropped from ``parts`` once handed on (the list is
        emptied), so the body is held once, at its size, and less as it goes out (``written`` is told
        each piece's size as it is handed on). Cut short, the response is finished as it stands
        (:meth:`reject` writes nothing more)."""
        size = sum(map(len, parts))
        await self.start(status, [*headers, (b"content-length", b"%d" % size)])
        parts.reverse()
        try:
            while parts:
                piece = parts.pop()
                await self.chunk(piece)
                if written is not None:
                    written(len(piece))
                del piece
                await trio.lowlevel.checkpoint()  # a socket that takes every piece at once must not hold the loop
        except BaseException:
            # Cut short (the client left, the deadline passed): an error cannot follow inside a body
            # whose length is promised, so nothing more is written; the connection closes, the body short.
            self.finished = True
            raise
        await self.finish(b"")

    def whole_nowait(self, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> bool:
        """Answer with a whole response now, from any task, never waiting (the listener's ``respond_nowait``).

        Returns:
            Whether it went out; if not (no such extension, the response started, the client
            gone), answer with :meth:`whole` as usual.
        """
        respond = self.respond_nowait
        if respond is None or self.started or not respond(status, framed(headers, body), body):
            return False
        self.started = self.finished = True
        return True

    def serve_next_meanwhile(self) -> bool:
        """The answer is out: the connection may serve its next requests while this request finishes
        (the listener's ``serve_next_meanwhile``); whether it does."""
        hooks = self._scope.get("extensions", {}).get(CONNECTION)
        return self.finished and hooks is not None and bool(hooks.serve_next_meanwhile())

    async def canned(self, response: CannedResponse) -> None:
        """Answer with a response encoded once (a refusal on the request head)."""
        self.started = self.finished = True
        await self._send({"type": "http.response.start", "status": response.status, "headers": response.headers})
        await self._send({"type": "http.response.body", "body": response.body, "more_body": False})

    async def reject(self, rejection: RequestRejected) -> None:
        """Answer with an error: a JSON response, or a final SSE error event mid-stream.

        Shielded, for at most :data:`REJECT_BOUND_S`: the answer goes out even when the request's
        scope is cancelled as it is written (a leader stepping down just as a node refuses its run
        as ``stale_epoch``: found by the seeded simulation's Edge replicas). Without the shield the
        response was marked finished and never sent, and the client got nothing.
        """
        if self.finished:
            return
        if rejection.read_after is not None:
            self._scope[PAUSE_READING] = rejection.read_after
        with trio.CancelScope(shield=True), trio.move_on_after(REJECT_BOUND_S):
            if not self.started:
                head, body = _canned(rejection)
                self.started = self.finished = True
                await self._send({"type": "http.response.start", "status": rejection.status, "headers": head})
                await self._send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                await self.finish(b"data: " + rejection.body() + b"\n\n")


REJECT_BOUND_S = 1.0
"""How long an error answer may take to write, shielded from the request's cancellation (:meth:`Responder.reject`)."""


def header_pairs(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value.encode()) for name, value in headers]


def framed(headers: Iterable[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` and the ``content-length`` of ``body``.

    With a content-length the server frames the body as is; without one it
    chunk-encodes it and writes the terminating chunk as one more socket send.
    """
    return [*headers, (b"content-length", b"%d" % len(body))]
