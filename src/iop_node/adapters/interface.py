"""The one interface every adapter implements.

An adapter turns a normalized run (an OpenAI request body for
``chat/completions`` or ``completions``) or a raw tunnel request into upstream
I/O. It never touches the gate or the wire: the session takes the permit before
calling it and maps its :class:`~iop_node.RunFailed` errors to wire codes.

Both methods are async generators. Callers must iterate them inside
``contextlib.aclosing`` so the upstream request is closed at once when the run
ends early (cancel, connection drop, send failure). Adapters never yield from
inside a cancel scope or nursery, which keeps that pattern safe under trio.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, Final, Protocol, final

import attrs

from iop_node._errors import BadRunRequest
from iop_wire import ENDPOINTS


@final
@attrs.frozen
class TunnelHead:
    """The status line and headers of a tunnelled upstream response."""

    status: int
    headers: tuple[tuple[str, str], ...]


class Adapter(Protocol):
    """What the session and the runtime need from an adapter."""

    def run(self, endpoint: str, body: dict[str, Any], *, stream: bool) -> AsyncGenerator[dict[str, Any], None]:
        """Yield the upstream's response objects for one normalized run.

        A streamed run yields one OpenAI chunk object per upstream event; a
        non-stream run yields exactly one complete response object. Every
        ``await`` inside checkpoints; cancellation closes the upstream request.

        Raises:
            BadRunRequest: unknown endpoint or unusable body.
            UpstreamUnreachable: connection error or timeout.
            UpstreamFailed: non-2xx answer or unreadable body.
        """
        ...

    async def relay(
        self, endpoint: str, body: dict[str, Any], *, stream: bool, send: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """Hand one normalized run's answer to ``send`` as the bytes the client receives.

        A streamed run sends the SSE body (``data:`` events, ``data: [DONE]`` at the
        end) in pieces as they become available; a non-stream run sends the JSON
        response body. An adapter whose upstream speaks OpenAI passes the upstream's
        own bytes through without parsing them; the others encode what :meth:`run`
        yields (:func:`relay_encoded`). ``send`` is the session's queue of data
        records: it checkpoints only when it waits for room and takes a piece whole
        or not at all. Returns at the end of the answer. Same errors and cancellation
        as :meth:`run` (a push, not a generator: a run's read timeout then spans many
        reads in one cancel scope instead of one per read).
        """
        ...

    def tunnel(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> AsyncGenerator[TunnelHead | bytes, None]:
        """Forward one raw request to the upstream's native API.

        Yields one :class:`TunnelHead` first, then the raw response body in
        chunks. Any upstream status is passed through; only transport failures
        raise. Cancellation closes the upstream request.

        Raises:
            BadRunRequest: unusable method or path.
            UpstreamUnreachable: connection error or timeout.
        """
        ...

    async def aclose(self) -> None:
        """Release the adapter's resources (its HTTP connection pool).

        Checkpoints; meant to run once at shutdown.
        """
        ...


def check_endpoint(endpoint: str) -> None:
    """Raise :class:`~iop_node.BadRunRequest` unless ``endpoint`` is a run endpoint."""
    if endpoint not in ENDPOINTS:
        raise BadRunRequest(f"unknown endpoint {endpoint!r}; expected one of {', '.join(ENDPOINTS)}")


_encode: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


async def relay_encoded(
    objects: AsyncGenerator[dict[str, Any], None], *, stream: bool, send: Callable[[bytes], Awaitable[None]]
) -> None:
    """:meth:`Adapter.relay` for an adapter that builds objects: hand :func:`encoded_run`'s bytes to ``send``.

    Checkpoints; closes ``objects`` when it ends or is cancelled.
    """
    async with aclosing(encoded_run(objects, stream=stream)) as chunks:
        async for chunk in chunks:
            await send(chunk)


async def encoded_run(objects: AsyncGenerator[dict[str, Any], None], *, stream: bool) -> AsyncGenerator[bytes, None]:
    """The client's bytes for the objects of :meth:`Adapter.run`: SSE events and ``[DONE]``, or one JSON body.

    Closes ``objects`` when closed itself (iterate it inside ``aclosing``).
    """
    async with aclosing(objects) as items:
        async for item in items:
            yield b"data: " + _encode(item).encode() + b"\n\n" if stream else _encode(item).encode()
    if stream:
        yield b"data: [DONE]\n\n"
