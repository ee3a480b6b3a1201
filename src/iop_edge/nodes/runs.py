"""One run's messages from its node: :class:`RunChannel`, and :class:`NodeGone`.

The link's reader never blocks on a consumer: events for a run go into that run's bounded
channel with ``send_nowait``. A run whose client cannot keep up overflows its channel and is
cancelled (the handler answers ``client_too_slow``); heartbeats and other runs keep flowing. Once
a stream's relay has written everything it received, it attaches its client's writer
(:meth:`RunChannel.attach`): data records then go from the reader to the client's socket without
a task switch, and a client too far behind overflows the run the same way. A non-stream answer
whose records and end arrive before its relay took any of them is written to the client by the
reader too, whole (:meth:`RunChannel.answer_whole`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, final

import trio

from iop_edge.nodes.states import (
    END,
    LEAVE,
    LOSE,
    OPEN,
    OVERFLOW,
    OVERFLOWED,
    READ_END,
    RUN_ANSWERED,
    RUN_READ_END,
    RUN_RECEIVING,
    TAKE,
    WRITE_WHOLE,
    next_run_state,
)
from iop_io import ParkedTask
from iop_wire import (
    RunData,
    RunEnd,
    TunnelChunk,
    TunnelEnd,
    TunnelStart,
)

logger = logging.getLogger("iop_edge.nodes")

CANCEL_SETTLE_TIMEOUT = 2.0
"""Seconds a run left before its end waits for the node to confirm the cancel."""
RUN_BUFFER = 1024
"""Messages buffered for one run before its client counts as too slow."""

WHOLE_ANSWER_BYTES = 1024 * 1024
"""The largest answer the node link's reader writes to its client itself (:meth:`RunChannel.answer_whole`):
about one frame of the node's, so the reader never joins a large answer on the loop; a larger one is
written by its relay, piece by piece."""

RunMessage = RunData | RunEnd | TunnelStart | TunnelChunk | TunnelEnd
"""What a run's channel carries: data records and the JSON messages of runs and tunnels."""


class NodeGone(Exception):
    """The node connection that should carry a run is gone (or not there)."""


class RunNotSent(Exception):
    """A run's frame cannot go to its node (it is not text, or it is over the node's message limit).

    Raised before the run is registered: nothing to release, the connection untouched.
    ``status`` and ``code`` are the client's answer (400 ``bad_request``, 413 ``request_too_large``).
    """

    def __init__(self, message: str, *, status: int = 400, code: str = "bad_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class RunLink(Protocol):
    """What a run asks of its node connection (:class:`~iop_edge.nodes.link.NodeLink`) when its relay leaves it."""

    def cancel_run(self, run_id: str) -> bool: ...

    def forget_run(self, run_id: str) -> None: ...


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
    cost a visible share of the Edge's CPU per request.

    Where the run stands is one :class:`~iop_edge.nodes.states.RunState`
    (:attr:`state`), moved only through its table (:func:`~iop_edge.nodes.states.next_run_state`).
    """

    __slots__ = (
        "run_id",
        "link",
        "_queue",
        "_waiter",
        "state",
        "next_seq",
        "_sink",
        "_whole",
    )

    def __init__(self, run_id: str, link: RunLink) -> None:
        self.run_id = run_id
        self.link = link
        self._queue: collections.deque[RunMessage] = collections.deque()
        self._waiter = ParkedTask()  # the relay, in :meth:`next`
        self.state = OPEN
        self.next_seq = 0
        """The number the run's next data record must carry (its node link checks and counts)."""
        self._sink: Callable[[bytes], bool] | None = None
        self._whole: Callable[[bytes], bool] | None = None

    @property
    def ended(self) -> bool:
        """Whether the relay has read the run's end."""
        return self.state in RUN_READ_END

    @property
    def overflowed(self) -> bool:
        """Whether the run was dropped because its client fell too far behind."""
        return self.state is OVERFLOWED

    @property
    def answered(self) -> bool:
        """Whether the node link's reader wrote the whole answer to the client (:meth:`answer_whole`)."""
        return self.state in RUN_ANSWERED

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
        ended = self.ended
        self.state = next_run_state(self.state, LEAVE)
        self._queue.clear()
        if not ended:
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
        state = self.state
        if state not in RUN_RECEIVING:
            return False
        if len(self._queue) >= RUN_BUFFER:
            return self._overflow()
        self._queue.append(message)
        if type(message) is RunEnd or type(message) is TunnelEnd:
            self.state = next_run_state(self.state, END)
            if self._whole is not None and state is OPEN:  # the relay took nothing yet
                self._answer_whole(message)
        self._waiter.wake()
        return True

    def answer_whole(self, writer: Callable[[bytes], bool]) -> None:
        """Let the node link's reader answer a non-stream run itself: ``writer(body)`` writes it whole.

        When the run's end arrives (``ok``) with every data record of the run
        still buffered, at most :data:`WHOLE_ANSWER_BYTES` of them -- the relay took none of them, the usual case, since the
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
        size = 0
        for index, message in enumerate(self._queue):
            if type(message) is RunData:
                parts.append(message.data)
                size += len(message.data)
            elif index < len(self._queue) - 1:  # only data records before the end (else: the relay)
                return
        if size > WHOLE_ANSWER_BYTES:  # its relay writes it, never joined
            return
        try:
            written = self._whole is not None and self._whole(b"".join(parts))
        except Exception:  # the reader serves every run of its node: one answer must not stop it
            logger.exception("run %s: writing its answer failed; its relay answers", self.run_id)
            return
        if written:
            self.state = next_run_state(self.state, WRITE_WHOLE)

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
        self.state = next_run_state(self.state, OVERFLOW)
        self._waiter.wake()
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
        self.state = next_run_state(self.state, LOSE)
        self._waiter.wake()

    async def next(self) -> RunMessage:
        """The next message of this run.

        Checkpoints; cancellation leaves the run open (leave the ``with`` block
        to cancel it).

        Raises:
            NodeGone: the connection ended (or the run overflowed) before the end message.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._queue or self.state not in RUN_RECEIVING:
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._waiter.park()
        if not self._queue:
            raise NodeGone("run dropped: client too slow" if self.overflowed else "node connection lost")
        return self._take()

    def _take(self) -> RunMessage:
        message = self._queue.popleft()
        end = type(message) is RunEnd or type(message) is TunnelEnd
        self.state = next_run_state(self.state, READ_END if end else TAKE)
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
            messages.append(self._take())
        return messages
