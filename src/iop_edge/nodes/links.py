"""The node socket: registration, heartbeats, and runs multiplexed per connection.

:class:`NodeRegistry` serves each connection of the node socket with its own
WebSocket end (:class:`NodeSocket`: wsproto, read in the link's reader task,
no reader task of its own): TCP connections from its listener and the
simulation's in-memory streams alike, through :meth:`NodeRegistry.serve_stream`.
It owns no admission state: an accepted registration calls
``admission.connect(node_id)``; the end of that connection -- close, drop,
heartbeat timeout, protocol error -- calls ``admission.disconnect(node_id,
generation)`` at once, and a stale or rejected connection never does. Admission then fences the generation's leases, which
cancels their request handlers.

Design notes:

- One nursery per connection, with one reader and one writer task. Nothing
  waits to send: a frame (a run, a cancel) goes to the socket at once from
  the task that has it when the writer is idle with nothing queued
  (:meth:`NodeSocket.send_nowait`: one non-blocking write, so a request
  handler being cancelled can never leave half a frame on the socket; what the
  socket does not take is the writer's to send), and otherwise into the
  connection's *outbox* (a deque the writer is parked on), behind the frames
  already there, for the writer. A node that stops reading its socket stalls
  only its own writer. A full outbox (:data:`OUTBOX_SIZE` frames) means the
  node is not keeping up: the connection is dropped.
- The reader never blocks on a consumer either: events for a run go into that
  run's bounded channel with ``send_nowait``. A run whose client cannot keep
  up overflows its channel and is cancelled (the handler answers
  ``client_too_slow``); heartbeats and other runs keep flowing. Once a
  stream's relay has written everything it received, it attaches its
  client's writer (:meth:`RunChannel.attach`): data records then go from
  the reader to the client's socket without a task switch, and a client too
  far behind overflows the run the same way. A non-stream answer whose
  records and end arrive before its relay took any of them is written to the
  client by the reader too, whole (:meth:`RunChannel.answer_whole`).
- Every message from the node counts as liveness. No message for
  ``heartbeat_timeout`` seconds and the Edge drops the connection itself: the
  fallback for a peer that vanished without a close.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import os
import ssl
from collections.abc import Callable
from types import TracebackType
from typing import NamedTuple, final

import trio
from trio_websocket import ConnectionClosed

from iop_admission import Admission
from iop_edge.ha.fencing import LeaderFence
from iop_edge.metrics import DisconnectCause
from iop_edge.nodes.connection import NodeSocket
from iop_edge.nodes.limits import PendingLimits, Source, source_of
from iop_edge.status import NodeRow, NodeStatus
from iop_io import ParkedTask
from iop_wire import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY,
    CLOSE_PROTOCOL_ERROR,
    PROTOCOL_VERSION,
    PROTOCOL_VERSIONS,
    RECEIVE_BYTES,
    Cancel,
    Heartbeat,
    InFlight,
    ProtocolError,
    Register,
    Registered,
    Rejected,
    Run,
    RunData,
    RunEnd,
    RunEvent,
    TunnelChunk,
    TunnelEnd,
    TunnelRequest,
    TunnelStart,
    decode,
    encode,
    split_data,
)

logger = logging.getLogger("iop_edge.nodes")

HANDSHAKE_TIMEOUT = 5.0
"""Default seconds from accept to a valid ``register`` (``node_handshake_timeout_ms``)."""
OUTBOX_SIZE = 1024
"""Frames queued for one node before it counts as stalled and is dropped."""
RUN_BUFFER = 1024
"""Messages buffered for one run before its client counts as too slow."""
WRITE_BATCH_BYTES = 64 * 1024
"""Characters of queued frames past which the node link's writer stops adding frames to one write."""
CANCEL_SETTLE_TIMEOUT = 2.0
"""Seconds a run left before its end waits for the node to confirm the cancel."""
FLUSH = ""
"""Queued (never sent) behind a frame sent without waiting: the node link's writer sends what the
socket did not take of it, and what was queued behind it in the same scheduling round."""

RunMessage = RunEvent | RunData | RunEnd | TunnelStart | TunnelChunk | TunnelEnd
"""What a run's channel carries: JSON messages (v1 and v2) and v2 data records."""


class NodeGone(Exception):
    """The node connection that should carry a run is gone (or not there)."""


@final
class RunChannel:
    """One run's messages from its node, and its cancellation.

    The channel owns both ends of the run's buffer: its node link hands it
    messages with :meth:`deliver` (never waits), the relay reads them with
    :meth:`next` / :meth:`buffered`. Use as ``async with``: leaving it before
    the end message arrived sends ``cancel`` to the node and waits, bounded,
    for the node to confirm it, so a lease held around it is released only
    once the node has freed the provider (see :meth:`__aexit__`).

    Why a deque and one parked task, not a trio memory channel: a run has
    exactly one reader (its relay) and one writer (the link's reader task),
    and a memory channel per run (two channel objects, a state, a task set)
    was about a fiftieth of the Edge's CPU per request (py-spy, concurrency 64).
    """

    __slots__ = (
        "run_id",
        "link",
        "_queue",
        "_waiter",
        "_closed",
        "ended",
        "overflowed",
        "next_seq",
        "_sink",
        "_whole",
        "_taken",
        "answered",
    )

    def __init__(self, run_id: str, link: NodeLink) -> None:
        self.run_id = run_id
        self.link = link
        self._queue: collections.deque[RunMessage] = collections.deque()
        self._waiter = ParkedTask()  # the relay, in :meth:`next`
        self._closed = False  # nothing more comes: the end arrived, the run was dropped, or the relay left
        self.ended = False
        self.overflowed = False
        self.next_seq = 0
        """The number the run's next data record must carry (its node link checks and counts)."""
        self._sink: Callable[[bytes], bool] | None = None
        self._whole: Callable[[bytes], bool] | None = None
        self._taken = False  # the relay took a message: the reader no longer holds the whole answer
        self.answered = False
        """Whether the node link's reader wrote the whole answer to the client (:meth:`answer_whole`)."""

    async def __aenter__(self) -> RunChannel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave the run; a run left before its end is cancelled and its end awaited.

        The node frees a provider slot (its local permit, its upstream request)
        only when a cancelled run has unwound. A lease released as soon as
        ``cancel`` is queued lets the next waiter's run reach the node first,
        where it is refused with ``concurrency_limit`` (503 provider_busy). So
        this sends ``cancel`` and waits for the node's ``run_end`` or the end
        of the connection, then forgets the run.

        Checkpoints only for a run that had not ended. The wait is shielded
        from the caller's cancellation (a client that went away is the usual
        reason to be here) and bounded by :data:`CANCEL_SETTLE_TIMEOUT`.
        """
        self._sink = self._whole = None
        if not self.ended and self.link.cancel_run(self.run_id):
            with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_SETTLE_TIMEOUT):
                while not self.ended:
                    try:
                        await self.next()
                    except NodeGone:
                        break
        self._closed = True
        self._queue.clear()
        if not self.ended:
            self.link.forget_run(self.run_id)

    def deliver(self, message: RunMessage) -> bool:
        """Buffer the next message from the node (never waits).

        Returns:
            False when the run cannot take it: its buffer is full (the client
            is too slow; :attr:`overflowed` is set) or its reader left. The
            link then forgets the run and cancels it on the node.
        """
        sink = self._sink
        if sink is not None:
            if type(message) is RunData:
                if sink(message.data):
                    return True
                return self._overflow()
            self._sink = None  # the relay writes what follows, in order, from the buffer
        if self._closed:
            return False
        if len(self._queue) >= RUN_BUFFER:
            return self._overflow()
        self._queue.append(message)
        if type(message) is RunEnd or type(message) is TunnelEnd:
            self._closed = True
            if self._whole is not None and not self._taken:
                self._answer_whole(message)
        self._waiter.wake()
        return True

    def answer_whole(self, writer: Callable[[bytes], bool]) -> None:
        """Let the node link's reader answer a non-stream run itself: ``writer(body)`` writes it whole.

        When the run's end arrives (``ok``) with every data record of the run
        still buffered -- the relay took none of them, the usual case, since the
        node sends an answer and its end in one write -- the reader joins the
        records and calls ``writer`` (never waiting; it returns whether the
        answer went out), then :attr:`answered` tells the relay, which still
        gets every message, that there is nothing left to write. The client gets
        its answer without waiting for the relay's task to be scheduled.
        """
        self._whole = writer

    def _answer_whole(self, end: RunEnd | TunnelEnd) -> None:
        if type(end) is not RunEnd or end.status != "ok" or len(self._queue) < 2:
            return
        parts: list[bytes] = []
        for index, message in enumerate(self._queue):
            if type(message) is RunData:
                parts.append(message.data)
            elif index < len(self._queue) - 1:  # only data records before the end (a v1 answer: the relay)
                return
        try:
            self.answered = self._whole is not None and self._whole(b"".join(parts))
        except Exception:  # the reader serves every run of its node: one answer must not stop it
            logger.exception("run %s: writing its answer failed; its relay answers", self.run_id)

    def deliver_data(self, seq: int, data: bytes) -> bool:
        """Hand on the bytes of the run's data record ``seq`` (never waits).

        With a sink attached they go to it at once (no :class:`RunData`);
        otherwise as :meth:`deliver` of that record. Returns as :meth:`deliver`.
        """
        sink = self._sink
        if sink is None:
            return self.deliver(RunData(self.run_id, seq, data))
        if sink(data):
            return True
        return self._overflow()

    def _overflow(self) -> bool:
        """The client is too far behind: the run takes nothing more (:meth:`next` raises after the buffer)."""
        self.overflowed = True
        self.close()
        return False

    def attach(self, sink: Callable[[bytes], bool]) -> bool:
        """Hand the bytes of later data records to ``sink`` as they arrive, in the node link's reader.

        A relay that has written everything received so far attaches its
        client's writer, so a token goes from the node's frame to the client's
        socket without a task switch; the run's end and errors still come
        through :meth:`next`. ``sink`` returns False when the client is too far
        behind: the run then counts as overflowed (as a full buffer would).
        Attaches only when nothing is buffered (else the order would break);
        any other message detaches it, so what follows keeps its order too.

        Returns:
            Whether ``sink`` is attached now.
        """
        if self._sink is None:
            if self.ended or self._queue:
                return False
            self._sink = sink
        return True

    def detach(self) -> None:
        """Buffer data records again (for :meth:`next`); call it when the relay stops writing."""
        self._sink = None

    def close(self) -> None:
        """The connection ended: :meth:`next` raises :class:`NodeGone` after what is buffered."""
        self._closed = True
        self._waiter.wake()

    async def next(self) -> RunMessage:
        """The next message of this run.

        Checkpoints; cancellation leaves the run open (leave the ``with`` block
        to cancel it).

        Raises:
            NodeGone: the connection ended (or the run overflowed) before the end message.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._queue or self._closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._waiter.park()
        if not self._queue:
            raise NodeGone("run dropped: client too slow" if self.overflowed else "node connection lost")
        self._taken = True
        message = self._queue.popleft()
        if type(message) is RunEnd or type(message) is TunnelEnd:
            self.ended = True
        return message

    def ready(self) -> bool:
        """Whether :meth:`next` has a message to give without waiting (never waits)."""
        return bool(self._queue)

    def buffered(self) -> list[RunMessage]:
        """The messages of this run that have arrived already, up to its end (never waits).

        Lets a relay write a burst of output to its client in one send.
        A lost connection is left for the next :meth:`next` to raise.
        """
        messages: list[RunMessage] = []
        queue = self._queue
        while queue and not self.ended:
            self._taken = True
            message = queue.popleft()
            if type(message) is RunEnd or type(message) is TunnelEnd:
                self.ended = True
            messages.append(message)
        return messages


@final
class NodeLink:
    """One registered node connection: one node, one generation, one protocol version."""

    def __init__(
        self,
        registry: NodeRegistry,
        node_id: str,
        generation: int,
        ws: NodeSocket,
        protocol: int = PROTOCOL_VERSION,
    ) -> None:
        self.registry = registry
        self.node_id = node_id
        self.generation = generation
        self.ws = ws
        self.protocol = protocol
        self.providers: tuple[str, ...] = ()
        self.last_seen = trio.current_time()
        self.cause: DisconnectCause = "error"
        # The frames for the writer (a deque and the writer parked on it, not a memory channel:
        # one reader, and a frame per request pays neither the channel's calls nor its WouldBlock).
        self._outbox: collections.deque[str] = collections.deque()
        self._outbox_closed = False
        self._writer = ParkedTask()  # the writer task, when it waits for frames
        self._writer_busy = False  # frames queued for the writer, or taken and not written yet
        self._ending = False
        self._runs: dict[str, RunChannel] = {}
        self._cancel_scope: trio.CancelScope | None = None

    # ----------------------------------------------------------------- runs

    @property
    def epoch(self) -> int | None:
        """The epoch to put on this connection's runs [epoch-fencing]: the leader's, on v3 only."""
        return self.registry.fence.stamp(self.protocol)

    def send_frame(self, frame: str) -> None:
        """Queue one frame that is not a run's (``leader``); dropped if the connection is ending."""
        try:
            self._queue(frame)
        except NodeGone:
            pass

    def open_run(self, message: Run | TunnelRequest) -> RunChannel:
        """Register a run and queue its request frame for the node (never waits).

        Raises:
            NodeGone: the connection is closing or its outbox is full.
        """
        run_id = message.run_id
        channel = self._runs[run_id] = RunChannel(run_id, self)
        try:
            self._queue(encode(message))
        except NodeGone:
            self.forget_run(run_id)
            raise
        return channel

    def cancel_run(self, run_id: str) -> bool:
        """Ask the node to cancel ``run_id`` (never waits).

        Returns:
            True when ``cancel`` was queued: the run is still tracked and the
            connection open, so its end (or the connection's) will follow.
        """
        if run_id not in self._runs:
            return False
        try:
            self._queue(encode(Cancel(run_id)))
        except NodeGone:
            return False  # the connection is ending; the node cancels every run itself
        return True

    def forget_run(self, run_id: str) -> None:
        """Stop tracking ``run_id``: later frames for it are dropped."""
        channel = self._runs.pop(run_id, None)
        if channel is not None:
            channel.close()

    def _queue(self, frame: str) -> None:
        """Send ``frame`` now if the writer is idle with nothing queued, else queue it for the writer.

        A request handler then writes its run's frame itself: at concurrency 1 the
        frame leaves without waiting for the writer task's turn (a scheduling round
        or two on the request's path). The write cannot be cancelled half-way (it
        does not wait). The writer is still woken (with :data:`FLUSH`): it sends
        what the socket did not take, and frames queued in the same scheduling
        round wait behind it and leave together in its one write, as before.
        """
        if self._outbox_closed:
            raise NodeGone(f"node {self.node_id} is disconnecting")
        ws = self.ws
        if not (self._writer_busy or self._ending):
            try:
                sent = ws.send_nowait(frame)
            except ConnectionClosed:
                self.abort()
                raise NodeGone(f"node {self.node_id} is disconnecting") from None
            if sent:
                frame = FLUSH
        if len(self._outbox) >= OUTBOX_SIZE:
            logger.warning("node %s is not reading its socket; dropping it", self.node_id)
            self.cause = "error"
            self.abort()
            raise NodeGone(f"node {self.node_id} is stalled")
        self._outbox.append(frame)
        self._writer_busy = True  # what follows queues behind it: the order of frames is kept
        self._writer.wake()

    @property
    def queued_frames(self) -> int:
        """Frames waiting for the writer (a node that does not read its socket makes them pile up)."""
        return len(self._outbox)

    def _deliver(self, run_id: str, message: RunMessage) -> None:
        channel = self._runs.get(run_id)
        if channel is None:
            return  # a late message for a run we already gave up on
        if not channel.deliver(message):
            self.cancel_run(run_id)
            self.forget_run(run_id)
        elif type(message) is RunEnd or type(message) is TunnelEnd:
            del self._runs[run_id]
            if message.code == "stale_epoch":
                self.registry.fence.refused(self.node_id)

    def _deliver_data(self, frame: bytes) -> str | None:
        """Hand the records of a v2 data frame to their runs; the protocol problem, if any.

        A run with several records in the frame gets their bytes joined, in
        order, as one delivery: one write to its client instead of one per record.
        Every record's order is checked before any is delivered.
        """
        runs = self._runs
        batch: dict[str, tuple[RunChannel, int, bytes]] = {}
        for run_id, seq, data in split_data(frame, max_bytes=self.registry.max_message_bytes):
            channel = runs.get(run_id)
            if channel is None:
                continue  # a late record for a run we already gave up on
            if seq != channel.next_seq:
                return f"run {run_id}: data record {seq} out of order"
            channel.next_seq = seq + 1
            joined = batch.get(run_id)
            batch[run_id] = (channel, seq, data) if joined is None else (channel, joined[1], joined[2] + data)
        for run_id, (channel, seq, data) in batch.items():
            if not channel.deliver_data(seq, data):
                self.cancel_run(run_id)
                self.forget_run(run_id)
        return None

    @property
    def active_runs(self) -> int:
        """Runs this connection carries right now."""
        return len(self._runs)

    # ------------------------------------------------------------ lifecycle

    def abort(self) -> None:
        """Drop the connection now (its serve loop ends and disconnects the node)."""
        self._ending = True
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    async def _serve(self, heartbeat_timeout: float) -> None:
        async with trio.open_nursery() as nursery:
            self._cancel_scope = nursery.cancel_scope
            nursery.start_soon(self._write)
            with trio.CancelScope() as reading:
                nursery.start_soon(self._watch_heartbeat, heartbeat_timeout, reading)
                await self._read()
            nursery.cancel_scope.cancel()

    async def _watch_heartbeat(self, heartbeat_timeout: float, reading: trio.CancelScope) -> None:
        """Stop ``reading`` once no message came for ``heartbeat_timeout`` seconds.

        A task of its own, so the reader pays no timer per message (it only
        stamps :attr:`last_seen`).
        """
        while True:
            expires = self.last_seen + heartbeat_timeout
            if trio.current_time() >= expires:
                self.cause = "heartbeat_timeout"
                logger.warning("node %s sent nothing for %.1fs: dropping it", self.node_id, heartbeat_timeout)
                reading.cancel()
                return
            await trio.sleep_until(expires)

    async def _write(self) -> None:
        """Send the outbox's frames until it is closed and empty, or the connection fails. Checkpoints."""
        outbox = self._outbox
        try:
            while outbox or not self._outbox_closed:
                if not outbox:
                    await self._writer.park()
                    continue
                await self._send_queued()
                self._writer_busy = bool(outbox)
        except ConnectionClosed:
            self.abort()

    async def _send_queued(self) -> None:
        """Send the first frame queued and those behind it, in one write to the socket where possible.

        A write to a loopback or LAN socket costs more CPU than framing a
        message, so the frames that queued up while the writer waited (runs
        opened by several request handlers in one scheduling round) go out
        together (:meth:`NodeSocket.send_messages`); a batch stops growing past
        :data:`WRITE_BATCH_BYTES`, so large frames go one by one and a node that
        stops reading leaves the rest in its outbox. The writer waits one
        scheduling round for more only when others were queued already (at
        concurrency 1 that round would be latency for nothing).
        """
        ws = self.ws
        outbox = self._outbox
        if len(outbox) > 1:
            # Others queued already, so requests are arriving together: one more scheduling
            # round lets the handlers runnable now queue theirs (never at concurrency 1).
            await trio.lowlevel.cancel_shielded_checkpoint()
        frames = [outbox.popleft()]
        size = len(frames[0])
        while outbox and size < WRITE_BATCH_BYTES:  # large frames go one by one, the rest wait
            frames.append(outbox.popleft())
            size += len(frames[-1])
        messages = [frame for frame in frames if frame]  # without FLUSH
        if messages or ws.backlogged:
            await ws.send_messages(messages)  # none: the rest of a frame sent without waiting

    async def _read(self) -> None:
        ws = self.ws
        while True:
            try:
                text = await ws.get_message()
            except ConnectionClosed as exc:
                code = exc.reason.code if exc.reason else None
                self.cause = "graceful" if code in (1000, 1001) else "error"
                return
            self.last_seen = trio.current_time()
            try:
                if type(text) is bytes and self.protocol >= 2:
                    problem = self._deliver_data(text)
                    if problem is None:
                        continue
                    raise ProtocolError(problem)
                message = decode(text, max_bytes=self.registry.max_message_bytes)
            except ProtocolError as exc:
                logger.warning("node %s: protocol error: %s", self.node_id, exc.reason)
                self.cause = "error"
                await _close(ws, exc.close_code, exc.close_reason)
                return
            kind = type(message)
            if kind is Heartbeat:
                continue
            if isinstance(message, RunMessage):
                self._deliver(message.run_id, message)
                continue
            if isinstance(message, InFlight) and self.protocol >= 3:
                self.registry.fence.answered(self.node_id, message)
                continue
            logger.warning("node %s sent an unexpected %s", self.node_id, kind.__name__)
            self.cause = "error"
            await _close(ws, CLOSE_PROTOCOL_ERROR, f"unexpected {kind.__name__} message")
            return

    def _end_runs(self) -> None:
        self._ending = True
        self._outbox_closed = True
        self._writer.wake()
        for channel in self._runs.values():
            channel.close()
        self._runs.clear()

    def __repr__(self) -> str:
        return f"<NodeLink {self.node_id} gen {self.generation} runs {len(self._runs)}>"


class _Rejection(NamedTuple):
    code: str
    reason: str
    node_id: str | None
    metric_reason: str | None = None  # the metrics label, when it says more than the wire code


class _Peer(NamedTuple):
    """What the Edge knows of a connection's other end before it registers."""

    source: Source
    stream: trio.abc.Stream | None
    cert_names: frozenset[str] | None
    """DNS names of the client certificate with mutual TLS; None without it."""


_BACKOFF_CODES = frozenset(("bad_token", "unknown_node"))
"""Rejections that answer a wrong credential: answered after the source's backoff."""

MAX_NODE_ID_CHARS = 128
"""The longest ``register.node_id`` the Edge looks up (docs/wire.md); a longer one, or one with a
character that is not printable, is ``unknown_node`` at once."""


def _loggable(text: str) -> str:
    """A peer's identifier as a log line may carry it: as sent when printable and short, else escaped and cut."""
    if text.isprintable() and len(text) <= MAX_NODE_ID_CHARS:
        return text
    return repr(text[:MAX_NODE_ID_CHARS]) + ("..." if len(text) > MAX_NODE_ID_CHARS else "")


@final
class _PendingSlot:
    """One connection's place in the pending count; :meth:`release` is idempotent."""

    __slots__ = ("held", "limits", "source")

    def __init__(self, limits: PendingLimits, source: Source) -> None:
        self.limits = limits
        self.source = source
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.limits.release(self.source)


@final
class _PeerWatch(trio.abc.Stream):
    """A stream that sets :attr:`ended` once its peer closed it or it broke (reads only).

    On a plain TCP stream, reads and writes are non-blocking system calls on
    its socket, waiting with trio's ``wait_readable`` / ``wait_writable`` only
    when the socket is not ready: a read with data waiting, or a write the
    socket takes whole, then costs no task switch (trio's stream reschedules
    the task on every call). TLS goes through the stream.
    """

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ended = trio.Event()
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None

    def _fd(self) -> int:
        """The socket's descriptor; -1 for a TLS stream or once the stream is closed."""
        return -1 if self._socket is None else self._socket.fileno()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        fd = self._fd()
        try:
            if fd >= 0:
                data: bytes | bytearray = await self._read(fd, max_bytes or RECEIVE_BYTES)
            else:
                data = await self.stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.ended.set()
            raise
        if not data:
            self.ended.set()
        return data

    async def _read(self, fd: int, size: int) -> bytes:
        """Read the socket; waits (a checkpoint) only when nothing is there yet."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return os.read(fd, size)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            fd = self._fd()
            if fd < 0:
                raise trio.ClosedResourceError("the node's socket was closed")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        fd = self._fd()
        if fd < 0:
            await self.stream.send_all(data)
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
                continue
            except BlockingIOError:
                await trio.lowlevel.wait_writable(fd)
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            fd = self._fd()
            if fd < 0:
                raise trio.ClosedResourceError("the node's socket was closed")

    def write_nowait(self, data: bytes) -> int:
        """Bytes of ``data`` the socket took now (none for a TLS stream, which is written by awaiting it).

        Raises:
            trio.BrokenResourceError: the socket failed.
        """
        fd = self._fd()
        if fd < 0:
            return 0
        try:
            return os.write(fd, data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        self.ended.set()
        await self.stream.aclose()


def _peer_host(stream: trio.abc.Stream) -> str | None:
    """The peer's IP address; None for a stream without a socket, or a peer already gone."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return None
    try:
        return str(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return None


async def _close(ws: NodeSocket, code: int, reason: str) -> None:
    with trio.move_on_after(1.0) as scope:
        scope.shield = True
        try:
            await ws.aclose(code, reason)
        except ConnectionClosed:
            pass


def _problem(
    message: Register, peer: _Peer, token_for: Callable[[str], str | None], links: dict[str, NodeLink]
) -> _Rejection | None:
    """Why ``message`` from ``peer`` cannot register now (None: it can)."""
    node_id = message.node_id
    if len(node_id) > MAX_NODE_ID_CHARS or not node_id.isprintable():
        return _Rejection("unknown_node", "the node id is too long or not printable", node_id)
    if message.protocol not in PROTOCOL_VERSIONS:
        spoken = ", ".join(map(str, PROTOCOL_VERSIONS))
        reason = f"protocol {message.protocol} is not supported (edge speaks {spoken})"
        return _Rejection("protocol_mismatch", reason, node_id)
    expected = token_for(node_id)
    if expected is None:
        return _Rejection("unknown_node", f"node {node_id!r} is not configured", node_id)
    if peer.cert_names is not None and node_id not in peer.cert_names:
        reason = f"the client certificate is not issued to node {node_id!r}"
        return _Rejection("bad_token", reason, node_id, "cert_mismatch")
    if not hmac.compare_digest(expected.encode(), message.token.encode()):
        return _Rejection("bad_token", "invalid token", node_id)
    if node_id in links:
        return _Rejection("duplicate", f"node {node_id!r} already has a live connection", node_id)
    return None


@final
class NodeRegistry:
    """Accepts node connections and tracks the one live link per node.

    Args:
        admission: the pool; connect/disconnect are the only calls made on it.
        token_for: returns the token a node must present (None: unknown node).
            Read at each registration, so a refreshed config applies to new ones.
        heartbeat_timeout: seconds without any message before a node is dropped.
        max_message_bytes: limit for one frame from a node.
        limits: the pending caps and failure backoff of the node socket
            (default: 256 pending, 8 per source, backoff 0.1 s doubling to 5 s).
        handshake_timeout: seconds from accept to a valid ``register``.
        ssl_context: serve TLS with it (read at each accept, so replacing it
            changes new connections only). If it requires client certificates,
            a node must present one naming its node id (a DNS name in the
            subject alternative names).
        on_connect, on_disconnect: observers (metrics, logs); never used for state.
        on_pending_closed: observer called with why a pending connection was
            closed by the Edge (``max_pending``, ``max_pending_per_source``,
            ``handshake_timeout``).
        on_rejected: observer called with ``(code, address_class)`` for every
            rejected registration.
    """

    def __init__(
        self,
        admission: Admission,
        *,
        token_for: Callable[[str], str | None],
        heartbeat_timeout: float,
        max_message_bytes: int,
        limits: PendingLimits | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
        on_connect: Callable[[str, int], None] | None = None,
        on_disconnect: Callable[[str, int, DisconnectCause], None] | None = None,
        on_pending_closed: Callable[[str], None] | None = None,
        on_rejected: Callable[[str, str], None] | None = None,
    ) -> None:
        self.admission = admission
        self.token_for = token_for
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self.limits = limits if limits is not None else PendingLimits(max_pending=256, max_pending_per_source=8)
        self.handshake_timeout = handshake_timeout
        self.ssl_context = ssl_context
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._on_pending_closed = on_pending_closed
        self._on_rejected = on_rejected
        self._links: dict[str, NodeLink] = {}
        self._run_ids = itertools.count(1)
        self.fence = LeaderFence(hold=admission.hold)  # [epoch-fencing] moved with this Edge's leadership

    def link(self, node_id: str, generation: int) -> NodeLink:
        """The live connection of ``node_id`` in ``generation``.

        Raises:
            NodeGone: no such live connection.
        """
        link = self._links.get(node_id)
        if link is None or link.generation != generation:
            raise NodeGone(f"node {node_id} generation {generation} is not connected")
        return link

    def links(self) -> tuple[NodeLink, ...]:
        """Every live connection."""
        return tuple(self._links.values())

    def new_run_id(self) -> str:
        """A run id unique for the life of this Edge."""
        return f"r{next(self._run_ids)}"

    # ------------------------------------------------------------- serving

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one accepted TCP connection of the node socket, from accept to close.

        The connection is *pending* until it registers: counted against the
        caps of :attr:`limits` (refused and closed at once beyond them), and
        closed if the WebSocket handshake and a valid ``register`` do not
        arrive within :attr:`handshake_timeout`. A stream that is not a socket
        (the simulation's in-memory ones) comes from one ``unknown`` source: its
        per-source cap counts them all. Never raises for what the peer does. Checkpoints (it runs for the life of the connection);
        cancellation closes the connection and disconnects its node.
        """
        source = source_of(_peer_host(stream))
        refusal = self.limits.open(source)
        if refusal is not None:
            self._pending_closed(refusal)
            await trio.aclose_forcefully(stream)
            return
        slot = _PendingSlot(self.limits, source)
        deadline = trio.current_time() + self.handshake_timeout
        try:
            peer = await self._secure(stream, source, deadline)
            if peer.stream is not None:
                watched = _PeerWatch(peer.stream)
                peer = peer._replace(stream=watched)
                ws = await self._handshake(watched, deadline)
                if ws is not None:
                    await self._serve_ws(ws, peer, slot, deadline)
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # The peer broke the connection mid-handshake: its end, not the listener's.
            logger.debug("node socket: connection from %s broke: %r", source.key, exc)
        finally:
            slot.release()
            await trio.aclose_forcefully(stream)

    async def _secure(self, stream: trio.abc.Stream, source: Source, deadline: float) -> _Peer:
        """The TLS handshake by ``deadline`` when TLS is on; a peer whose ``stream`` is None failed it."""
        context = self.ssl_context
        if context is None:
            return _Peer(source, stream, None)
        tls = trio.SSLStream(stream, context, server_side=True)
        with trio.move_on_at(deadline) as timer:
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                logger.info("node socket: TLS handshake with %s failed: %s", source.key, exc.__cause__ or exc)
                self._pending_closed("tls_handshake")
                return _Peer(source, None, None)
        if timer.cancelled_caught:
            self._pending_closed("handshake_timeout")
            return _Peer(source, None, None)
        if context.verify_mode != ssl.CERT_REQUIRED:
            return _Peer(source, tls, None)
        cert = tls.getpeercert() or {}
        names = frozenset(str(value) for kind, value in cert.get("subjectAltName", ()) if kind == "DNS")
        return _Peer(source, tls, names)

    async def _handshake(self, watched: _PeerWatch, deadline: float) -> NodeSocket | None:
        """The WebSocket handshake on ``watched`` by ``deadline``; None if the peer left, failed it or was too slow."""
        ws = NodeSocket(watched, self.max_message_bytes)
        with trio.move_on_at(deadline):
            return ws if await ws.handshake() else None
        self._pending_closed("handshake_timeout")
        return None

    async def _serve_ws(self, ws: NodeSocket, peer: _Peer, slot: _PendingSlot, deadline: float) -> None:
        link: NodeLink | None = None
        try:
            link = await self._register(ws, peer, deadline)
            if link is None:
                return
            slot.release()  # registered: never counted against the pending caps again
            await link._serve(self.heartbeat_timeout)
        finally:
            if link is not None:
                self._release(link)
            if not ws.closed:
                await _close(ws, CLOSE_GOING_AWAY, "edge closing connection")

    # -------------------------------------------------------- registration

    async def _register(self, ws: NodeSocket, peer: _Peer, deadline: float) -> NodeLink | None:
        """Read ``register`` by ``deadline`` and register the node, or reject it (then None)."""
        message: Register | _Rejection | None = None
        with trio.move_on_at(deadline) as timer:
            message = await self._read_register(ws)
        if timer.cancelled_caught:
            self._pending_closed("handshake_timeout")
            await _close(ws, CLOSE_POLICY, "register timeout")
            return None
        if message is None:
            return None
        rejection = message if isinstance(message, _Rejection) else _problem(message, peer, self.token_for, self._links)
        if rejection is not None:
            await self._reject(ws, rejection, peer.source)
            return None
        assert isinstance(message, Register)
        return self._connect(ws, message)

    async def _read_register(self, ws: NodeSocket) -> Register | _Rejection | None:
        """The first message: a ``register``, a rejection, or None (connection closed)."""
        try:
            text = await ws.get_message()
        except ConnectionClosed:
            return None
        try:
            message = decode(text, max_bytes=self.max_message_bytes)
        except ProtocolError as exc:
            await _close(ws, exc.close_code, exc.close_reason)
            return None
        if type(message) is not Register:
            return _Rejection("bad_message", "the first message must be register", None)
        return message

    def _connect(self, ws: NodeSocket, message: Register) -> NodeLink:
        node_id = message.node_id
        generation = self.admission.connect(node_id)
        link = NodeLink(self, node_id, generation, ws, message.protocol)
        link.providers = tuple(p.id for p in message.providers)
        self._links[node_id] = link
        interval_ms = max(1, int(self.heartbeat_timeout * 1000 / 3))
        link._queue(encode(Registered(node_id, generation, interval_ms)))
        self.fence.greet(link)
        logger.info(
            "node %s registered: generation %d, wire v%d, providers %s",
            node_id,
            generation,
            link.protocol,
            ", ".join(map(_loggable, link.providers)) or "none",
        )
        if self._on_connect is not None:
            self._on_connect(node_id, generation)
        return link

    async def _reject(self, ws: NodeSocket, rejection: _Rejection, source: Source) -> None:
        """Answer ``rejected`` and close; a failed credential is answered after its source's backoff.

        The token is never logged. Checkpoints; the delay is bounded by the
        limits' ``backoff_max``, the answer and the close by 1 s each.
        """
        code = rejection.code
        delay = self.limits.failed(source, trio.current_time()) if code in _BACKOFF_CODES else 0.0
        logger.warning(
            "rejected node registration %s from %s: %s (%s)%s",
            "?" if rejection.node_id is None else _loggable(rejection.node_id),
            source.key,
            rejection.reason,
            code,
            f"; answering in {delay:.2f} s" if delay else "",
        )
        if self._on_rejected is not None:
            self._on_rejected(rejection.metric_reason or code, source.address_class)
        await trio.sleep(delay)
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            try:
                await ws.send_message(encode(Rejected(code, rejection.reason, code == "duplicate")))
            except ConnectionClosed:
                pass
        await _close(ws, CLOSE_POLICY, code)

    def _pending_closed(self, reason: str) -> None:
        logger.debug("node socket: closing a pending connection (%s)", reason)
        if self._on_pending_closed is not None:
            self._on_pending_closed(reason)

    def _release(self, link: NodeLink) -> None:
        """The connection ended: disconnect its generation (a stale one changes nothing)."""
        if self._links.get(link.node_id) is link:
            del self._links[link.node_id]
        link._end_runs()
        if self.admission.disconnect(link.node_id, link.generation):
            self.fence.forget(link.node_id)
            logger.info("node %s generation %d disconnected (%s)", link.node_id, link.generation, link.cause)
            if self._on_disconnect is not None:
                self._on_disconnect(link.node_id, link.generation, link.cause)

    def node_status(self, node_ids: list[str]) -> tuple[NodeStatus, ...]:
        """Per configured node: connected, generation, last heartbeat age, active runs (no secrets)."""
        return tuple(NodeStatus(**row) for row in self.node_rows(node_ids))

    def node_rows(self, node_ids: list[str]) -> list[NodeRow]:
        """:meth:`node_status` as plain dicts (:data:`~iop_edge.status.NodeRow`), without the objects."""
        now = trio.current_time()
        generation = self.admission.generation
        links = self._links
        out = []
        for node_id in node_ids:
            link = links.get(node_id)
            out.append(
                {
                    "node_id": node_id,
                    "connected": link is not None,
                    "generation": generation(node_id),
                    "last_heartbeat_age": None if link is None else round(max(0.0, now - link.last_seen), 3),
                    "active_runs": 0 if link is None else link.active_runs,
                }
            )
        return out

    def close_all(self) -> None:
        """Drop every node connection at once (the fallback when the Edge is cancelled)."""
        for link in tuple(self._links.values()):
            link.cause = "graceful"
            link.abort()

    async def aclose_all(self) -> None:
        """Close every node connection with 1001 (going away), all at once.

        Call it before cancelling the server: the close handshake needs the
        connections' reader tasks alive to see each node's reply. Checkpoints;
        each close is bounded (1 s) and shielded.
        """
        async with trio.open_nursery() as nursery:
            for link in tuple(self._links.values()):
                link.cause = "graceful"
                nursery.start_soon(_close, link.ws, CLOSE_GOING_AWAY, "edge shutting down")
