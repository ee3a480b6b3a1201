"""Small ASGI helpers: the scope the listener builds for a request, and what the Edge's apps (the OpenAI
API and the queue page) share."""

from __future__ import annotations

import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import trio

from iop_http import RequestHead

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
"""An ASGI ``receive`` callable."""

CONNECTION = "iop.connection"
"""Scope extension: the listener's :class:`~.cycle.ConnectionHooks` for this request (its one key in the scope)."""


def last_value(query: Mapping[str, Sequence[str]], name: str) -> str | None:
    """The last value of ``name`` in a parsed query string (``urllib.parse.parse_qs``), if any."""
    values = query.get(name)
    return values[-1] if values else None


async def watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away (an ``http.disconnect`` message)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def asgi_scope(request: RequestHead, hooks: object) -> dict[str, Any]:
    """The ASGI HTTP scope of ``request``, routed by its origin-form path, with ``hooks`` as its extension."""
    path, _, query = request.path.decode("latin-1").partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request.http_version.decode(),
        "method": request.method.decode("ascii"),
        "scheme": "http",
        "path": urllib.parse.unquote(path) if "%" in path else path,
        "raw_path": path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "headers": request.headers,
        "extensions": {CONNECTION: hooks},
    }
