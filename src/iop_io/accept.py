"""A server's accept loop: every connection waiting is accepted in one wake-up (up to a batch).

``trio.serve_listeners`` accepts one connection per scheduling round: when
hundreds of clients connect within a second to a busy server, a round lasts
milliseconds and the last of them waited seconds for their accept.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Final

import trio

logger = logging.getLogger("iop_io")

Handler = Callable[[trio.SocketStream], Awaitable[None]]

ACCEPT_BATCH: Final = 256
"""Connections the listener accepts in one wake-up at most; then the loop runs others and it looks again."""

_ACCEPT_GIVEN_UP: Final = frozenset({errno.ECONNABORTED, errno.ECONNRESET, errno.EPROTO, errno.EPERM, errno.ETIMEDOUT})
"""``accept`` errors about one connection its client gave up (skipped, as trio's listener does)."""
_ACCEPT_CAPACITY: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""``accept`` errors of an exhausted process or system: the listener waits :data:`_ACCEPT_PAUSE` and tries again."""
_ACCEPT_PAUSE: Final = 0.1


def accept_waiting(listener: socket.socket, limit: int = ACCEPT_BATCH) -> list[socket.socket]:
    """Every connection waiting on the non-blocking ``listener`` now (at most ``limit``), without waiting.

    Why: ``trio.serve_listeners`` accepts ONE connection per scheduling round (its
    ``accept`` yields after each success): a burst of clients connecting at once waits
    for its accepts round by round while the Edge's rounds are busy relaying the
    streams already running. One wake-up here takes them all.

    Raises:
        OSError: ``accept`` failed otherwise than for one given-up connection (e.g.
            ``EMFILE``), and nothing was accepted before it.
    """
    accepted: list[socket.socket] = []
    while len(accepted) < limit:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno in _ACCEPT_GIVEN_UP:
                continue
            if accepted:
                break  # the next call meets it again
            raise
        accepted.append(sock)
    return accepted


async def accept_loop(listener: socket.socket, nursery: trio.Nursery, handle: Handler) -> None:
    """Serve every connection to ``listener`` with ``handle`` in its own task of ``nursery``, until cancelled."""
    while True:
        await trio.lowlevel.wait_readable(listener)
        try:
            accepted = accept_waiting(listener)
        except OSError as exc:
            if exc.errno not in _ACCEPT_CAPACITY:
                raise
            logger.error("accept failed (%s); retrying in %g s", exc, _ACCEPT_PAUSE)
            await trio.sleep(_ACCEPT_PAUSE)
            continue
        for sock in accepted:
            nursery.start_soon(_serve_accepted, handle, sock)


async def _serve_accepted(handle: Handler, sock: socket.socket) -> None:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    try:
        await handle(stream)
    finally:
        await trio.aclose_forcefully(stream)
