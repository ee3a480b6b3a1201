"""A real Edge listener on 127.0.0.1 whose app records every request it runs: the smuggling tests' backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from iop_edge.listener.server import HttpLimits, serve_http

MARKER = b"GET /marker HTTP/1.1\r\nhost: x\r\n\r\n"
"""The request pipelined behind each refused one: it must never run on that connection."""


@attrs.define
class Backend:
    """What the app ran: (method, path, body) per request, in order."""

    port: int = 0
    ran: list[tuple[str, str, bytes]] = attrs.Factory(list)

    def count(self, path: str) -> int:
        return sum(1 for _, p, _ in self.ran if p == path)


def recording_app(backend: Backend) -> Any:
    """An app that reads each body whole (except on ``/deny``: 401 before the body) and answers 200."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/deny":
            backend.ran.append((scope["method"], "/deny", b""))
            await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"6")]})
            await send({"type": "http.response.body", "body": b"denied"})
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        backend.ran.append((scope["method"], scope["path"], body))
        answer = b"ran " + scope["path"].encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]}
        )
        await send({"type": "http.response.body", "body": answer})

    return app


@asynccontextmanager
async def listening(max_head_bytes: int = 64 * 1024) -> AsyncIterator[Backend]:
    backend = Backend()
    limits = HttpLimits(header_timeout=10.0, read_timeout=10.0, max_head_bytes=max_head_bytes)
    async with trio.open_nursery() as nursery:
        backend.port = await nursery.start(
            lambda task_status: serve_http(
                recording_app(backend), "127.0.0.1", 0, limits=limits, task_status=task_status
            )
        )
        yield backend
        nursery.cancel_scope.cancel()


async def exchange(port: int, *pieces: bytes) -> bytes:
    """Send ``pieces`` (one send each), then end the sending side; everything received until the close."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        for piece in pieces:
            try:
                await stream.send_all(piece)
            except trio.BrokenResourceError:
                break
        try:
            await stream.send_eof()
        except trio.BrokenResourceError:
            pass
        received = b""
        while True:
            try:
                data = await stream.receive_some()
            except trio.BrokenResourceError:
                break
            if not data:
                break
            received += data
        return received


def statuses(received: bytes) -> list[tuple[int, bytes]]:
    """The answers in ``received``: (status, body) each, framed by their content-length."""
    answers = []
    while received:
        end = received.index(b"\r\n\r\n") + 4
        head = received[:end].lower()
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) if b"content-length: " in head else 0
        if int(head[9:12]) >= 200:
            answers.append((int(head[9:12]), received[end : end + length]))
        received = received[end + length :] if int(head[9:12]) >= 200 else received[end:]
    return answers
