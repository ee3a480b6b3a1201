"""How one connection's runs reach the socket: a run's output, a tunnel's parts, the one writer.

Module functions of :class:`~iop_node.EdgeSession`'s connection (see its design
notes): run tasks hand frames to the connection's :class:`~iop_node.edges.outbox.Outbox`,
and only :func:`write_frames` writes to the socket.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import aclosing
from typing import final

import trio
from trio_websocket import ConnectionClosed

from iop_node._errors import DeadlineExceeded, StreamStalled, UpstreamUnreachable
from iop_node._runtime import NodeRuntime
from iop_node.adapters.interface import Adapter, TunnelHead
from iop_node.edges.outbox import Outbox
from iop_node.edges.websocket import EdgeSocket, EdgeWebSocket
from iop_node.health.progress import Progress
from iop_node.upstream.abort import LETTING_GO, Abandoned
from iop_node.upstream.poller import BodyPoller, RunOutput
from iop_wire import NodeMessage, Run, TunnelChunk, TunnelRequest, TunnelStart, record_header

Record = tuple[bytes, bytes]
"""A data record: its header (:func:`iop_wire.record_header`) and its data."""

RECORD_BYTES = 64 * 1024
"""The most data in one record: a larger piece of an answer (an adapter that encodes a whole
non-stream answer hands it over at once) goes as several records in order, so a frame to the Edge
stays within the outbox's batch plus one record, far under the Edge's ``max_ws_message_bytes`` --
one record of a 10 MiB answer would be over its 8 MiB and cut every run of the link."""


async def relay_run(
    run: Run, adapter: Adapter, outbox: Outbox | None, poller: BodyPoller | None, runtime: NodeRuntime
) -> Record | None:
    """Serve ``run`` on ``adapter``: its output as data records, within the run's deadline.

    A streamed run counts in its provider's ``runtime.progress``, and every run's chunks from
    the backend too ([health-probe]: the stall watchdog, :mod:`iop_node.health.progress`).

    Returns the run's whole body as its last data record when the poller held
    it for the run's end (the session sends it with the end), else None. A cancelled
    run returns (or raises) only once the backend let go of its aborted request, or its
    provider's ``abort_grace_ms`` passed (:mod:`iop_node.upstream.abort`).

    Raises:
        DeadlineExceeded: the run's deadline ([deadline], wire v6 ``run.deadline_ms``) passed
            first: the upstream request, connecting and every read included, was closed.
    """
    progress = runtime.progress[run.provider]
    abandoned = Abandoned()
    token = LETTING_GO.set(abandoned)
    try:
        if run.deadline_ms is None:
            return await _relay_output(run, adapter, outbox, poller, progress)
        with trio.move_on_after(run.deadline_ms / 1000):
            return await _relay_output(run, adapter, outbox, poller, progress)
    finally:
        LETTING_GO.reset(token)
        await abandoned.settle()  # the permit stays taken until the backend let go of an aborted request
    raise DeadlineExceeded(f"the run's deadline of {run.deadline_ms} ms passed; its upstream request was closed")


async def _relay_output(
    run: Run, adapter: Adapter, outbox: Outbox | None, poller: BodyPoller | None, progress: Progress
) -> Record | None:
    """:func:`relay_run` without its deadline.

    Raises:
        StreamStalled: the upstream went silent for its read timeout, or the stall watchdog cut
            the run, after part of the answer went out in data records ([error-classes]).
        UpstreamUnreachable: the same before any part went out (the Edge may fail it over).
    """
    assert outbox is not None
    records = _RunRecords(run.run_id, outbox, progress)
    output = RunOutput(records.send, records.send_nowait, poller, records.hold)
    watched = run.stream  # a non-stream answer comes whole at its end: its silence says nothing of a hang
    scope = progress.begin() if watched else trio.CancelScope()  # the scope the stall watchdog cancels
    try:
        with scope:
            await adapter.relay(run.endpoint, run.body, stream=run.stream, send=output)
    except UpstreamUnreachable as exc:
        if exc.silent and records.seq:
            raise StreamStalled(
                f"the upstream went silent after {records.seq} pieces of its answer: {exc.message}"
            ) from None
        raise
    finally:
        if watched:
            progress.end(scope)
    if scope.cancelled_caught:
        raise _stalled(progress, records.seq)
    return await records.last()


def _stalled(progress: Progress, sent: int) -> StreamStalled | UpstreamUnreachable:
    """The stall watchdog cut the run after ``sent`` records: let the backend go now, and the error to raise."""
    abandoned = LETTING_GO.get()
    if abandoned is not None:  # a stalled backend is a failure: closed at once, the run failed over now
        abandoned.let_go_now()
    stalled = f"stalled: the backend sent no byte for {progress.silence:.1f} s with runs in flight"
    return StreamStalled(f"{stalled}, after {sent} pieces of its answer") if sent else UpstreamUnreachable(stalled)


@final
class _RunRecords:
    """One run's output as data records, numbered in order (:attr:`seq`), each at most
    :data:`RECORD_BYTES`; every chunk counts for the stall watchdog. A whole body the poller
    held for the run's end (``BodyPoller.relay``) waits in :attr:`held`."""

    __slots__ = ("_run_id", "_outbox", "_progress", "seq", "held")

    def __init__(self, run_id: str, outbox: Outbox, progress: Progress) -> None:
        self._run_id = run_id
        self._outbox = outbox
        self._progress = progress
        self.seq = 0
        self.held: list[bytes] = []

    async def send(self, chunk: bytes) -> None:
        self._progress.chunks += bool(chunk)  # a byte came: the stall watchdog's count
        for piece in _pieces(chunk):
            await self._outbox.put_record(record_header(self._run_id, self.seq, len(piece)), piece)
            self.seq += 1

    def send_nowait(self, chunk: bytes) -> None:
        self._progress.chunks += bool(chunk)  # a byte came: the stall watchdog's count
        for piece in _pieces(chunk):
            self._outbox.put_record_nowait(record_header(self._run_id, self.seq, len(piece)), piece)
            self.seq += 1

    def hold(self, body: bytes) -> None:
        self._progress.chunks += 1
        self.held.append(body)

    async def last(self) -> Record | None:
        """The held body as the run's last data record (sent with its end), or None: none was
        held, or it was larger than a record and went out now as records of its own."""
        held = self.held
        if not held:
            return None
        if len(held[0]) > RECORD_BYTES:
            await self.send(held[0])
            return None
        return record_header(self._run_id, self.seq, len(held[0])), held[0]


def _pieces(chunk: bytes) -> Iterator[bytes]:
    """``chunk`` in pieces of at most :data:`RECORD_BYTES` (none for an empty one)."""
    for start in range(0, len(chunk), RECORD_BYTES):
        yield chunk[start : start + RECORD_BYTES]


async def relay_tunnel(
    request: TunnelRequest, body: bytes, adapter: Adapter, send: Callable[[NodeMessage], Awaitable[None]]
) -> None:
    """Serve one tunnel request: ``tunnel_start``, then ``tunnel_chunk`` per body part; a cancelled one
    returns once the backend let go of it (see :func:`relay_run`)."""
    abandoned = Abandoned()
    token = LETTING_GO.set(abandoned)
    try:
        parts = adapter.tunnel(request.method, request.path, request.headers, body)
        async with aclosing(parts):
            async for part in parts:
                if isinstance(part, TunnelHead):
                    await send(TunnelStart(request.run_id, part.status, part.headers))
                elif part:
                    await send(TunnelChunk.from_bytes(request.run_id, part))
    finally:
        LETTING_GO.reset(token)
        await abandoned.settle()


async def write_frames(ws: EdgeWebSocket, outbox: Outbox, connection: trio.CancelScope) -> None:
    """The only task that writes to the socket; a failed write ends the connection.

    Every frame queued since the last write goes out in one write (the data
    records among them in one binary frame): a run's output and its end
    queued together cost one ``send()``.
    """
    try:
        while True:
            frames = await outbox.next_frames()
            try:
                if isinstance(ws, EdgeSocket):
                    await ws.send_messages(frames)
                else:  # trio-websocket's connection (tests, simulations): one message at a time
                    for frame in frames:
                        await ws.send_message(frame)
            except ConnectionClosed:
                connection.cancel()
                return
    finally:
        outbox.close()
