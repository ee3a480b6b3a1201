"""Sockets watched for readability by one task: :class:`ReadySet`, an epoll set of our own inside trio's loop.

Why: a task that waits for one socket with trio's ``wait_readable`` costs, per
wait, the socket's registration in trio's epoll (one-shot, re-armed every
time) and a wakeup of that task. Where one task serves many sockets that stay
of interest across many reads (a listener's connections while their apps run,
a Node's upstream bodies while they stream), they stay registered here
(level-triggered, or edge-triggered for an owner that reads a socket until a read
comes short) from :meth:`ReadySet.add` to :meth:`ReadySet.discard`, both
synchronous; trio waits on this set's one descriptor, and one wakeup of the
serving task finds every socket that has something to read.

Linux only (``select.epoll``): :data:`CAN_POLL` says whether a :class:`ReadySet`
can be made; elsewhere each user falls back to a wait per socket.
"""

from __future__ import annotations

import select
from typing import Final, Generic, TypeVar, final

import trio

CAN_POLL: Final = hasattr(select, "epoll")
"""Whether this platform has the epoll a :class:`ReadySet` needs."""

T = TypeVar("T")


@final
class ReadySet(Generic[T]):
    """Descriptors watched for readability, each with the item its owner serves it for."""

    __slots__ = ("_epoll", "_items", "_edge")

    def __init__(self, *, edge: bool = False) -> None:
        """``edge``: a descriptor is ready once per arrival (``EPOLLET``), not at every
        :meth:`ready` while it has unread data: its owner reads it until a read comes short.
        """
        self._epoll = select.epoll()
        self._items: dict[int, T] = {}
        self._edge = select.EPOLLET if edge else 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, fd: int) -> T | None:
        """The item ``fd`` is watched for, if it is."""
        return self._items.get(fd)

    def add(self, fd: int, item: T, *, connecting: bool = False) -> None:
        """Watch ``fd`` for ``item`` until :meth:`discard`.

        ``connecting``: ``fd`` is a socket whose non-blocking ``connect`` is under way: it is
        also ready when writable (connected, or failed: ask ``SO_ERROR``) until :meth:`connected`.

        Raises:
            OSError, ValueError: ``fd`` cannot be watched (closed), or the set is closed.
        """
        self._epoll.register(fd, (select.EPOLLIN | select.EPOLLOUT if connecting else select.EPOLLIN) | self._edge)
        self._items[fd] = item

    def connected(self, fd: int) -> None:
        """``fd``'s connection is made: from now on it is ready only when readable."""
        self._epoll.modify(fd, select.EPOLLIN | self._edge)

    def discard(self, fd: int, item: T) -> bool:
        """Stop watching ``fd`` if it is watched for ``item``; whether it was."""
        if self._items.get(fd) is not item:
            return False
        del self._items[fd]
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):  # closed already (the kernel dropped it), or the set is closed
            pass
        return True

    def watched(self) -> list[tuple[int, T]]:
        """Every descriptor watched and its item (a copy)."""
        return list(self._items.items())

    async def wait(self) -> None:
        """Wait until a watched descriptor is readable (or the set has nothing to wait for). Checkpoints."""
        await trio.lowlevel.wait_readable(self._epoll)

    def ready(self) -> list[tuple[int, T]]:
        """The watched descriptors readable now (or, connecting, writable), with their items. Never waits."""
        items = self._items
        found = self._epoll.poll(0, len(items) or 1)
        return [(fd, item) for fd, _ in found if (item := items.get(fd)) is not None]

    def close(self) -> None:
        """Release the epoll set. Idempotent."""
        self._epoll.close()
