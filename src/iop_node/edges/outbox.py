"""The frames a session has queued for its one writer task, batched per write.

Run tasks queue JSON text frames (run ends, heartbeats, tunnel messages) and
data records (a header plus the run's output bytes). The writer takes
every frame queued since its last write with :meth:`Outbox.next_frames`, for ONE
write to the socket: every data record among them (across runs, in queue order)
joined into ONE binary frame, first, then the text frames as queued. A run's end
never overtakes its data (a run queues no text frame before its records: its end
is queued after them, and records move only ahead of text frames). A busy node
sends few large frames instead of one per upstream read, and a run whose answer
and end are queued together (a non-stream answer read whole) costs one
``send()``, not two (the Edge then finds both in one read). Why the records go
first rather than in stretches between the text frames: with runs ending while
others answer, every run's end split the records into a frame per run (two
WebSocket frames per non-stream run, each costing wsproto's framing and masking
on the Node and parsing on the Edge).

Queuing is synchronous once there is room, hence cancellation-atomic: a record or
frame is queued whole or not at all. Room: while more than :data:`LIMIT` bytes
wait, queuing waits (a node whose Edge does not read stops reading its
upstreams instead of growing without bound). Queuing with room does not
checkpoint: a run task queues right after its upstream read (which did), and a
reschedule per queued token was a measurable share of the Node's CPU per token.
Queuing wakes the writer only when it waits for work (``trio.Event.set`` is a
no-op otherwise), so a busy writer is not rescheduled once per record.
"""

from __future__ import annotations

from collections import deque
from typing import Final, final

import trio

LIMIT: Final = 1024 * 1024
"""Bytes queued before queuing waits for the writer."""
MAX_FRAME: Final = 1024 * 1024
"""The most data bytes the writer puts in one binary frame (one record may exceed it)."""


@final
class Outbox:
    """A bounded FIFO of text frames and data records with one reader (the writer task)."""

    __slots__ = ("_items", "_queued", "_wakeup", "_room", "_closed", "_idle")

    def __init__(self) -> None:
        self._items: deque[str | tuple[bytes, bytes]] = deque()
        self._queued = 0
        self._wakeup = trio.Event()
        self._room = trio.Event()
        self._closed = False
        self._idle = False
        """The writer waits for work in :meth:`next_frames` (and has not been woken)."""

    async def put_text(self, frame: str) -> None:
        """Queue a text frame. Checkpoints only when it waits for room; cancellation-atomic.

        Raises:
            trio.BrokenResourceError: the writer is gone.
        """
        if self._queued > LIMIT or self._closed:
            await self._wait_for_room()
        self._items.append(frame)
        self._queued += len(frame)
        self._wakeup.set()

    async def put_record(self, header: bytes, data: bytes) -> None:
        """Queue one data record (``header`` from :func:`iop_wire.record_header`).

        Checkpoints only when it waits for room; cancellation-atomic.

        Raises:
            trio.BrokenResourceError: the writer is gone.
        """
        if self._queued > LIMIT or self._closed:
            await self._wait_for_room()
        self._items.append((header, data))
        self._queued += len(header) + len(data)
        self._wakeup.set()

    def put_record_nowait(self, header: bytes, data: bytes) -> None:
        """Queue one data record now, room or not (the caller waits for room itself: :meth:`room`).

        Raises:
            trio.BrokenResourceError: the writer is gone.
        """
        if self._closed:
            raise trio.BrokenResourceError("the connection's writer is gone")
        self._items.append((header, data))
        self._queued += len(header) + len(data)
        self._wakeup.set()

    async def room(self) -> bool:
        """Return once there is room (or the writer is gone): True if it had to wait.

        Does not checkpoint when there is room; otherwise checkpoints.
        """
        if self._queued <= LIMIT or self._closed:
            return False
        while self._queued > LIMIT and not self._closed:
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()
        return True

    async def _wait_for_room(self) -> None:
        # Nothing awaits between the last check and the caller's append.
        await trio.lowlevel.checkpoint()
        while self._queued > LIMIT and not self._closed:
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()
        if self._closed:
            raise trio.BrokenResourceError("the connection's writer is gone")

    async def next_frames(self) -> list[str | bytes]:
        """Every frame queued now (at least one), for one write. Checkpoints.

        The data records come first, joined into one binary frame in queue order; the
        text frames follow as queued. Items are taken while the total stays under
        :data:`MAX_FRAME` bytes (the first goes whatever its size; one record may exceed it).
        """
        while not self._items:
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
            self._idle = True
            try:
                await self._wakeup.wait()
            finally:
                self._idle = False
        items = self._items
        parts: list[bytes] = []
        frames: list[str | bytes] = []
        size = 0
        while items and size < MAX_FRAME:
            item = items.popleft()
            if isinstance(item, str):
                frames.append(item)
                size += len(item)
            else:
                parts += item
                size += len(item[0]) + len(item[1])
        if parts:
            frames.insert(0, b"".join(parts))
        self._queued -= size
        if self._queued <= LIMIT:
            self._room.set()
        return frames

    def take_if_idle(self, record: tuple[bytes, bytes] | None, text: str) -> list[str | bytes] | None:
        """The frames of ``record`` (if any) and ``text``, for the caller to write itself, when the
        writer waits for work with nothing queued; else None (queue them: the writer writes them).

        Frames the caller writes this way go out before anything queued after this call only if
        its write is ordered before the writer's next one (the connection's sends are).
        """
        if not self._idle or self._items or self._closed:
            return None
        return [text] if record is None else [record[0] + record[1], text]

    def close(self) -> None:
        """The writer is gone: queuing raises from now on, waiters wake up."""
        self._closed = True
        self._room.set()
        self._items.clear()
