"""The ASGI ``lifespan`` scope of an app that holds no resources of its own: :func:`answer_lifespan`.

Both of the project's ASGI apps (the Edge's API, the mock backend) start and stop with nothing to
set up, but a server that speaks the lifespan protocol waits for each step's answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any


async def answer_lifespan(
    receive: Callable[[], Awaitable[Mapping[str, Any]]], send: Callable[[dict[str, str]], Awaitable[None]]
) -> None:
    """Acknowledge ``lifespan.startup`` and ``lifespan.shutdown``; return after the shutdown.

    Checkpoints (each ``receive`` and ``send``). Cancellation propagates.
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
