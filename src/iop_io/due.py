"""Tasks that wait for a time on trio's clock, woken by one runner task: one timer for all of them.

A ``trio.sleep`` per waiter costs a cancel scope with a deadline, its expiry and
the ``Cancelled`` it raises and catches. At 512 paced streams x 20 tokens/s (the
mock backend) or a flood of paced refusals (the Edge's listener), that was most
of the process's CPU. A :class:`DueQueue` keeps the waiting tasks in a heap by
due time; its :meth:`~DueQueue.run` task sleeps until the earliest due time,
then wakes every waiter due within ``quantum`` of it (one timer wake-up for a
bunch), at most ``batch`` woken or answered per scheduling round (so a bunch due at once never
holds the loop for one long pass).

A wait may come with an ``answer`` callable, asked when the wait is due (with
its due time): it returns a later time to keep waiting until (it did the
waiter's work itself, without waking its task), or None (wake the task). An
``answer`` that raises wakes the task, and is logged.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, Final, final

import trio

__all__ = ["Answer", "DueQueue"]

logger = logging.getLogger("iop_io")

Answer = Callable[[float], "float | None"]
"""Asked when a wait is due, with its due time: a later time to wait until, or None to wake the task."""

_DUE: Final = 0
_TASK: Final = 2
_ANSWER: Final = 3


@final
class DueQueue:
    """Waiters woken at their due times (trio's clock) by the :meth:`run` task.

    Args:
        quantum: seconds; waiters due within this of the earliest are woken with it
            (up to ``quantum`` early).
        batch: waiters woken per scheduling round, at most (0: no bound).

    Run :meth:`run` in a task (a nursery's, or a system task) for as long as
    waiters may come; without it, nothing wakes.
    """

    __slots__ = ("quantum", "batch", "_heap", "_seq", "_timer")

    def __init__(self, quantum: float = 0.0, batch: int = 0) -> None:
        if quantum < 0 or batch < 0:
            raise ValueError("quantum and batch must be >= 0")
        self.quantum = quantum
        self.batch = batch
        self._heap: list[list[Any]] = []  # [due, seq, task or None (cancelled), answer or None]
        self._seq: Iterator[int] = itertools.count()
        self._timer: trio.CancelScope | None = None

    def __len__(self) -> int:
        """Waits in the queue (cancelled ones not yet dropped included)."""
        return len(self._heap)

    def __repr__(self) -> str:
        return f"<DueQueue {len(self._heap)} waiting>"

    async def wait_until(self, due: float, answer: Answer | None = None) -> None:
        """Return at ``due`` (up to ``quantum`` earlier), or later if ``answer`` keeps the wait going.

        Checkpoints: it always parks, even when ``due`` has passed (the next
        pass of :meth:`run` wakes it). Cancellation ends the wait and leaves only
        a dropped entry behind.
        """
        entry: list[Any] = [due, next(self._seq), trio.lowlevel.current_task(), answer]
        self._push(entry)

        def abort(_: object) -> trio.lowlevel.Abort:
            entry[_TASK] = None  # run() drops the entry when it comes due
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _push(self, entry: list[Any]) -> None:
        heapq.heappush(self._heap, entry)
        timer = self._timer
        if timer is not None and entry[_DUE] < timer.deadline:
            timer.deadline = entry[_DUE]

    async def run(self) -> None:
        """Wake waiters when due, until cancelled. Checkpoints."""
        heap = self._heap
        while True:
            with trio.CancelScope(deadline=heap[0][_DUE] if heap else math.inf) as timer:
                self._timer = timer
                await trio.sleep_forever()
            self._timer = None
            horizon = trio.current_time() + self.quantum
            woken = 0
            while heap and heap[0][_DUE] <= horizon:
                entry = heapq.heappop(heap)
                task, answer = entry[_TASK], entry[_ANSWER]
                if task is None:
                    continue
                again = _asked(answer, entry[_DUE]) if answer is not None else None
                if again is not None and again > horizon:
                    entry[_DUE] = again  # answered without the task: waiting again
                    heapq.heappush(heap, entry)
                else:
                    trio.lowlevel.reschedule(task)
                woken += 1  # an answer is work done in this round too
                if woken == self.batch:  # the rest wake in the next scheduling round
                    await trio.lowlevel.checkpoint()
                    woken = 0


def _asked(answer: Answer, due: float) -> float | None:
    """``answer(due)``; None (wake the task) if it raised: one bad answer must not stop the queue."""
    try:
        return answer(due)
    except Exception:
        logger.exception("error in a due queue's answer: its task is woken instead")
        return None
