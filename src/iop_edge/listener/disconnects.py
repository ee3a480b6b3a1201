"""The listener's disconnect watch: the client leaving while the app runs cancels the app's scope.

Linux (:data:`iop_io.CAN_POLL`): one :class:`DisconnectPoller` task watches every plain TCP connection
of a listener through one :class:`iop_io.ReadySet`; elsewhere each connection has
a :class:`DisconnectWatcher` task, parked between requests. What they read
while watching (a pipelined next request) goes to the connection at once
(:meth:`Watched.keep_read`), so the bytes keep their order whoever reads next.
"""

from __future__ import annotations

from typing import Protocol, final

import trio

from iop_io import ByteStream, ParkedTask, PeerGone, ReadySet


class Watched(Protocol):
    """What the watch needs of the connection it watches."""

    gone: bool

    def keep_read(self, data: bytes) -> bool:
        """Keep ``data`` (read while watched) for the next request; whether to go on watching."""
        ...


@final
class DisconnectWatcher:
    """One connection's disconnect watcher: a task that lives as long as the connection.

    Parked between requests; :meth:`watch` wakes it to wait for the socket to
    become readable while the app runs. What it reads then (a pipelined next
    request) goes to the connection's request reader at once, in the same step as the
    read, so the bytes keep their order whoever reads next; an end of stream
    or an error marks the connection gone and cancels the watched scope.
    :meth:`stop` (the app returned) withdraws its wait at once, so the
    connection's task can read the socket right after.
    """

    __slots__ = ("connection", "io", "watched", "_parked", "_waiting")

    def __init__(self, connection: Watched, io: ByteStream) -> None:
        self.connection = connection
        self.io = io
        self.watched: trio.CancelScope | None = None
        self._parked = ParkedTask()  # the watch task, between watches
        self._waiting: trio.CancelScope | None = None

    def watch(self, cancel_scope: trio.CancelScope) -> None:
        """Cancel ``cancel_scope`` if the client goes away before :meth:`stop` (never waits)."""
        self.watched = cancel_scope
        self._parked.wake()

    def stop(self) -> None:
        """Stop watching (never waits); the socket is free for another reader when this returns."""
        self.watched = None
        if self._waiting is not None:
            self._waiting.cancel()

    async def run(self) -> None:
        """Watch whenever asked, until the connection's nursery is cancelled. Checkpoints."""
        while True:
            if self.watched is None:
                await self._parked.park()
                continue
            with trio.CancelScope() as self._waiting:
                await self._wait_readable()
            self._waiting = None

    async def _wait_readable(self) -> None:
        while True:
            try:
                await self.io.wait_readable()
            except PeerGone:  # closed under the wait: read_while_watched below marks the connection gone
                pass
            if self.watched is None:
                return  # stopped while the wake-up was on its way: the connection reads now
            if not read_while_watched(self.connection, self.io, self.watched):
                self.watched = None
                return


def read_while_watched(connection: Watched, io: ByteStream, watched: trio.CancelScope) -> bool:
    """Read what the client sent while its app runs (``io`` is readable); whether to go on watching.

    The bytes (a pipelined next request) go to the connection's request reader at once, so
    they keep their order whoever reads next; past ``max_head_bytes`` of them,
    watching stops (the rest stays in the socket). An end of stream or an error
    marks the connection gone and cancels ``watched``.
    """
    try:
        data = io.receive_nowait()
    except PeerGone:
        data = b""
    if data is None:
        return True
    if not data:
        connection.gone = True
        watched.cancel()
        return False
    return connection.keep_read(data)


@final
class DisconnectPoller:
    """The disconnect watch of every plain TCP connection of one listener, in ONE task
    (Linux: an :class:`iop_io.ReadySet`).

    Why: a watcher task per connection costs, per request, two task wake-ups
    (:meth:`DisconnectWatcher.watch` and ``stop``), a cancel scope cancelled and
    two registrations in trio's epoll. Here watching a connection is one
    registration in the listener's ready set and stopping one unregistration,
    both synchronous; :meth:`run` wakes only when a watched client sent
    something or left, and handles it as the per-connection watcher does
    (:func:`read_while_watched`).
    """

    __slots__ = ("watching",)

    def __init__(self) -> None:
        self.watching: ReadySet[PolledWatch] = ReadySet()

    async def run(self) -> None:
        """Handle watched sockets that became readable, until cancelled. Checkpoints."""
        watching = self.watching
        try:
            while True:
                await watching.wait()
                for _, watch in watching.ready():
                    if watch.watched is None:
                        continue
                    if not read_while_watched(watch.connection, watch.io, watch.watched):
                        watch.stop()
        finally:
            watching.close()


@final
class PolledWatch:
    """One connection's watch through its listener's :class:`DisconnectPoller` (``watch`` and ``stop`` as
    :class:`DisconnectWatcher`'s, without a task)."""

    __slots__ = ("poller", "connection", "io", "watched", "_fd")

    def __init__(self, poller: DisconnectPoller, connection: Watched, io: ByteStream) -> None:
        self.poller = poller
        self.connection = connection
        self.io = io
        self.watched: trio.CancelScope | None = None
        self._fd = -1  # the descriptor registered (a closed socket's fileno() says -1)

    def watch(self, cancel_scope: trio.CancelScope) -> None:
        """Cancel ``cancel_scope`` if the client goes away before :meth:`stop` (never waits)."""
        fd = self.io.fileno()
        try:
            self.poller.watching.add(fd, self)
        except (OSError, ValueError):  # the socket or the listener is closed: nothing to watch any more
            self.connection.gone = True
            cancel_scope.cancel()
            return
        self.watched = cancel_scope
        self._fd = fd

    def stop(self) -> None:
        """Stop watching (never waits); the socket is free for another reader when this returns."""
        if self.watched is None:
            return
        self.watched = None
        self.poller.watching.discard(self._fd, self)
