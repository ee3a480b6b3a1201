"""The listener's pacer: paused connections left unread until they are due, woken by one task.

A pause is a place in one queue ordered by due time, not a timer of its own:
:meth:`Pacer.run` wakes every connection due (up to :data:`PACING_BATCH` a
scheduling round) and may answer a refused client's retry itself (the
``answer`` callback of :meth:`Pacer.pause`) without waking the connection's
task. It also remembers refused requests by their bytes (:meth:`Pacer.remember`),
so a flood's identical retries are refused without being parsed again.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, final

import trio

logger = logging.getLogger("iop_edge.http")

Headers = Sequence[tuple[bytes, bytes]]

PACING_QUANTUM = 0.005
"""Seconds: paused connections due within this of each other are woken together (one timer wake-up)."""


PACING_BATCH = 64
"""Paused connections woken in one scheduling round, at most: a bunch due at once is answered
over several rounds, with every other task (``/healthz``, admitted requests) running between them."""

RECHECK_AFTER = 0.02
"""Seconds after which the pacer looks again at a connection whose pause ended with nothing to read."""

RECHECKS = 10
"""Times the pacer looks again (:data:`RECHECK_AFTER` apart) before the connection's task waits for the socket."""

TOLD_GRACE = 0.01
"""Seconds after the time a refused client was told to come back (``Retry-After``) that the pacer
looks at its connection once more, when its pause ended sooner and nothing came meanwhile."""

REMEMBERED_HEADS = 256
"""Refused requests the pacer remembers by their bytes, at most (:meth:`Pacer.remember`)."""

REMEMBERED_BYTES = 16 * 1024
"""Longest request (head and body) the pacer remembers."""

Head = tuple[bytes, bytes, Headers]
"""A request head as ``refuse_head`` is asked about it: method, target, headers."""


def _due(entry: list[Any]) -> float:
    due: float = entry[0]
    return due


@final
class Pacer:
    """The paused connections of one listener, woken at their times by one task.

    A pause is an entry in a queue sorted by time (the Edge books return times
    in order, so an entry is nearly always appended), not a timer per
    connection: :meth:`run` sleeps until the earliest time, then resumes every
    connection due within :data:`PACING_QUANTUM`, so a flood of paced refusals
    costs one timer wake-up per batch, and each connection one task wake-up.
    A batch larger than :data:`PACING_BATCH` is woken over several scheduling
    rounds, so the loop never runs a whole bunch of refusals in one pass.

    A pause may come with an ``answer`` callable, asked first when the pause is
    due (with the time it was due): it returns a new time to stay paused until
    (it answered the client itself, without its task, or will look again) or
    None (wake the task). The requests refused
    before, by their exact bytes, are kept here for those answers
    (:meth:`remember`, :meth:`recall`).
    """

    __slots__ = ("queue", "timer", "heads")

    def __init__(self) -> None:
        self.queue: collections.deque[list[Any]] = collections.deque()  # [time, task or None, answer or None]
        self.timer: trio.CancelScope | None = None
        self.heads: dict[bytes, Head] = {}

    def __repr__(self) -> str:
        return f"<Pacer {len(self.queue)} paused>"

    def remember(self, request: bytes, head: Head) -> None:
        """Keep ``head``, parsed from exactly the bytes ``request`` (a whole request, body included), refused."""
        if len(request) <= REMEMBERED_BYTES and len(self.heads) < REMEMBERED_HEADS:
            self.heads[request] = head

    def recall(self, request: bytes) -> Head | None:
        """The head remembered for exactly the bytes ``request``, or None."""
        return self.heads.get(request)

    async def pause(self, until: float, answer: Callable[[float], float | None] | None = None) -> None:
        """Wait until ``until`` (trio's clock), or somewhat less (:data:`PACING_QUANTUM`); when due,
        ``answer()`` (if given) may extend the pause by returning a later time. Checkpoints."""
        entry: list[Any] = [until, trio.lowlevel.current_task(), answer]
        self._enqueue(entry)

        def abort(_: object) -> trio.lowlevel.Abort:
            entry[1] = None  # the waker drops the entry
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _enqueue(self, entry: list[Any]) -> None:
        until = entry[0]
        queue = self.queue
        if not queue or queue[-1][0] <= until:
            queue.append(entry)
        else:
            queue.insert(bisect.bisect_right(queue, until, key=_due), entry)
        timer = self.timer
        if timer is not None and until < timer.deadline:
            timer.deadline = until

    async def run(self) -> None:
        """Wake paused connections when due, until cancelled. Checkpoints."""
        queue = self.queue
        while True:
            with trio.CancelScope(deadline=queue[0][0] if queue else math.inf) as timer:
                self.timer = timer
                await trio.sleep_forever()
            self.timer = None
            horizon = trio.current_time() + PACING_QUANTUM
            woken = 0
            while queue and queue[0][0] <= horizon:
                entry = queue.popleft()
                task, answer = entry[1], entry[2]
                if task is None:
                    continue
                again = _answered(answer, entry[0]) if answer is not None else None
                if again is not None and again > horizon:
                    entry[0] = again  # answered without the task: paused again
                    self._enqueue(entry)
                else:
                    trio.lowlevel.reschedule(task)
                woken += 1
                if woken == PACING_BATCH:  # the rest wake in the next scheduling round
                    await trio.lowlevel.checkpoint()
                    woken = 0


def step_after(due: float, at: float) -> float:
    """The first of ``due`` plus whole :data:`RECHECK_AFTER` steps (one at least) later than ``at``."""
    return due + max(1, math.floor((at - due) / RECHECK_AFTER) + 1) * RECHECK_AFTER


def _answered(answer: Callable[[float], float | None], due: float) -> float | None:
    """``answer(due)``; None (wake the task) if it raised: a paused connection must not stop the pacer."""
    try:
        return answer(due)
    except Exception:
        logger.exception("error while answering a paused connection: its task takes over")
        return None
