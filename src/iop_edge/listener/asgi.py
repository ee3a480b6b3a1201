"""Small ASGI helpers shared by the Edge's apps (the OpenAI API and the queue page)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import trio

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
"""An ASGI ``receive`` callable."""


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
