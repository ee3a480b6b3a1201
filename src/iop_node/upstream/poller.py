"""One task reads the answer bodies of every run of a session: :class:`BodyPoller`.

Why: a run task that waits for its own upstream socket costs, per token, a trio
wakeup of that task and the re-arm of the socket in trio's epoll
(``wait_readable`` registers it one-shot each time). Here every upstream
socket whose body is being relayed stays in ONE :class:`iop_io.ReadySet`
from the first body byte the run task did not read itself to the end of the
body, and one wakeup of the poller task reads every socket that has data,
feeds the answer's parser (:class:`iop_http.AnswerParser`) and queues the body bytes with the run's
:class:`RunOutput`, synchronously. The run task only sleeps until its body ends
(or fails, or the upstream is silent for the read timeout).

Linux only (:data:`iop_io.CAN_POLL`); elsewhere :func:`new_poller` returns None and runs
read their own sockets (:meth:`iop_node.upstream.http11.Answer.pump`).

Backpressure: before each wait the poller waits for room in the session's
outbox (a node whose Edge does not read stops reading its upstreams); that time
is not upstream silence for a run's read timeout.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Final, final

import httpx
import trio

from iop_io import CAN_POLL, PeerGone, ReadySet
from iop_node.upstream.connection import feed, read_error
from iop_node.upstream.http11 import Answer, Checkout, take_body

TICK: Final = 0.005
"""Seconds between two reads of the poller while data keeps coming (an idle poller, and a body's
first read by the poller, read at once)."""


def new_poller(nursery: trio.Nursery, wait_for_room: Callable[[], Awaitable[bool]]) -> BodyPoller | None:
    """A poller where the platform has epoll, else None; its task starts in ``nursery`` when first needed.

    ``wait_for_room``: see :meth:`BodyPoller.serve`.
    """
    if not CAN_POLL:
        return None
    poller = BodyPoller(lambda: nursery.start_soon(poller.serve, wait_for_room))
    return poller


@final
class RunOutput:
    """Where a run's relay hands the bytes the client receives.

    ``await output(chunk)`` queues a chunk (waiting for room if the outbox is full);
    :meth:`nowait` queues one at once, for the :class:`BodyPoller`, which waits for
    room itself. ``poller``: the session's poller, if it has one. ``last``: when
    set, a body that came whole with the answer's head is handed to it instead
    (the session sends it with the run's end: :meth:`BodyPoller.relay`).
    """

    __slots__ = ("_put", "_put_nowait", "poller", "last")

    def __init__(
        self,
        put: Callable[[bytes], Awaitable[None]],
        put_nowait: Callable[[bytes], None],
        poller: BodyPoller | None,
        last: Callable[[bytes], None] | None = None,
    ) -> None:
        self._put = put
        self._put_nowait = put_nowait
        self.poller = poller
        self.last = last

    async def __call__(self, chunk: bytes) -> None:
        """Queue ``chunk``. Checkpoints only when it waits for room; cancellation-atomic."""
        await self._put(chunk)

    def nowait(self, chunk: bytes) -> None:
        """Queue ``chunk`` now, room or not.

        Raises:
            trio.BrokenResourceError: the connection's writer is gone.
        """
        self._put_nowait(chunk)


@final
class _Body:
    """One answer body the poller reads."""

    __slots__ = ("checkout", "output", "done", "error", "last_read", "polled")

    def __init__(self, checkout: Checkout, output: RunOutput, now: float) -> None:
        self.checkout = checkout
        self.output = output
        self.done = trio.Event()
        self.error: BaseException | None = None
        self.last_read = now
        self.polled = False
        """Whether the poller has read this body yet (a first read does not wait for the tick)."""


@final
class BodyPoller:
    """Reads many upstream answer bodies from one task (see the module docstring)."""

    __slots__ = ("_bodies", "_paused", "_resumed", "_closed", "_start")

    def __init__(self, start: Callable[[], None] | None = None) -> None:
        self._bodies: ReadySet[_Body] = ReadySet()
        self._paused = False
        self._resumed = -math.inf
        self._closed = False
        self._start = start
        """Starts :meth:`serve` (called once, by the first :meth:`follow`); None: started by the owner."""

    def __repr__(self) -> str:
        return f"<BodyPoller reading {len(self._bodies)} bodies>"

    @property
    def reading(self) -> int:
        """Bodies being read now."""
        return len(self._bodies)

    async def serve(self, wait_for_room: Callable[[], Awaitable[bool]]) -> None:
        """Read every registered body until cancelled. Checkpoints.

        ``wait_for_room`` returns when the session's outbox has room: True if it had
        to wait, False (at once, without checkpointing) if it had room. When this ends
        (cancelled, or a failure), every body still registered fails with
        ``trio.BrokenResourceError``.
        """
        bodies = self._bodies
        next_poll = -math.inf
        ready: list[tuple[int, _Body]] = []
        try:
            while True:
                self._paused = True
                if await wait_for_room():
                    self._resumed = trio.current_time()
                self._paused = False
                ready = await self._wait(next_poll, busy=len(ready) > 1)
                now = trio.current_time()
                next_poll = now + TICK
                for fd, body in ready:
                    if bodies.get(fd) is body:  # not ended by an earlier step of this round
                        self._step(fd, body, now)
        finally:
            self._closed = True
            for fd, body in bodies.watched():
                self._end(fd, body, trio.BrokenResourceError("the connection's body poller is gone"))
            bodies.close()

    async def _wait(self, next_poll: float, *, busy: bool) -> list[tuple[int, _Body]]:
        """Wait until a socket has data (and, reading several bodies, until ``next_poll``);
        return the sockets ready. Checkpoints.

        ``busy`` (the last read found several sockets with data): sleep out the tick
        first and look without waiting for readiness (one task wakeup per tick);
        otherwise, or if nothing came during the tick, wait for readiness first (a
        poller that was idle, or that reads one body only, reads at once: a lone
        request's answer is never held back). Data for a body the poller has not read
        yet is read at once too: a new answer (a non-stream body behind its head)
        would otherwise wait up to a tick for nothing.
        """
        bodies = self._bodies
        if busy:
            await trio.sleep_until(next_poll)
            if ready := bodies.ready():
                return ready
        while True:
            await bodies.wait()
            ready = bodies.ready()
            if len(bodies) > 1 and trio.current_time() < next_poll and not any(not body.polled for _, body in ready):
                await trio.sleep_until(next_poll)  # let a tick's worth of data gather (module docstring)
                ready = bodies.ready()
            if ready:
                return ready

    def close(self) -> None:
        """Stop taking bodies and release the epoll set (for a poller whose task never started). Idempotent."""
        self._closed = True
        self._start = None
        if not self._bodies:
            self._bodies.close()

    def _step(self, fd: int, body: _Body, now: float) -> None:
        """Read what ``fd`` has, queue the body bytes parsed; end the body at its end or failure."""
        checkout = body.checkout
        connection = checkout.connection
        if connection is None:  # given back behind our back (cannot happen while registered)
            self._end(fd, body, None)
            return
        try:
            data = connection.io.receive_nowait()
        except PeerGone as exc:
            self._end(fd, body, read_error(exc))
            return
        if data is None:
            return
        body.last_read = now
        body.polled = True
        try:
            feed(connection.answer, data)
            chunk = take_body(checkout, connection)
            if chunk is not None:
                body.output.nowait(chunk)
        except Exception as exc:  # bad HTTP (httpx.RemoteProtocolError) or the writer gone
            self._end(fd, body, exc)
            return
        if checkout.connection is None:  # the body ended (and the connection went back to the pool)
            self._end(fd, body, None)

    def _end(self, fd: int, body: _Body, error: BaseException | None) -> None:
        self._bodies.discard(fd, body)
        if not body.done.is_set():
            body.error = error
            body.done.set()

    async def relay(self, answer: Answer, output: RunOutput) -> None:
        """Hand ``answer``'s body to ``output`` until its end: what was parsed already, then
        every read of the poller (the counterpart of :meth:`Answer.pump`).

        A body that came whole with the head (a non-stream answer, usually) goes to
        ``output.last`` when it is set, without queuing. Checkpoints (not when the body
        came whole with the head); cancellation closes the connection, as does a failure.

        Raises:
            httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError: reading failed.
            trio.BrokenResourceError: the poller or the connection's writer is gone.
        """
        checkout = answer.checkout
        try:
            connection = checkout.connection
            if connection is not None and (chunk := take_body(checkout, connection)) is not None:
                if checkout.connection is None and output.last is not None:  # the whole body
                    output.last(chunk)
                    return
                await output(chunk)
            if checkout.connection is not None:
                await self.follow(checkout, answer.read_timeout, output)
        except BaseException:
            checkout.give_back(reusable=False)
            raise

    async def follow(self, checkout: Checkout, read_timeout: float, output: RunOutput) -> None:
        """Have the poller read ``checkout``'s answer body to its end into ``output``.

        Sleeps until the body ends. Checkpoints. Cancellation stops the reading
        (the caller closes the connection).

        Raises:
            httpx.ReadTimeout: the upstream sent nothing for ``read_timeout`` seconds
                (time the poller waited for room in the outbox does not count).
            httpx.ReadError, httpx.RemoteProtocolError: reading failed.
            trio.BrokenResourceError: the poller or the connection's writer is gone.
        """
        connection = checkout.connection
        assert connection is not None
        if self._closed:
            raise trio.BrokenResourceError("the connection's body poller is gone")
        if self._start is not None:  # the first body: a session whose runs never need it has no poller task
            start, self._start = self._start, None
            start()
        fd = connection.io.fileno()
        body = _Body(checkout, output, trio.current_time())
        self._bodies.add(fd, body)
        try:
            while not body.done.is_set():
                with trio.CancelScope(deadline=self._silent_since(body) + read_timeout):
                    await body.done.wait()
                if not body.done.is_set() and trio.current_time() - self._silent_since(body) >= read_timeout:
                    raise httpx.ReadTimeout(f"no data from the upstream for {read_timeout:g} s")
        finally:
            self._end(fd, body, None)
        if body.error is not None:
            raise body.error

    def _silent_since(self, body: _Body) -> float:
        """When the upstream's current silence began, as far as the read timeout is concerned."""
        if self._paused:
            return trio.current_time()
        return max(body.last_read, self._resumed)
