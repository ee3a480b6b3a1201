"""One timer for every paced stream of a mock backend.

A ``trio.sleep`` per token per stream costs a cancel scope with a deadline, its expiry and
the ``Cancelled`` it raises and catches: at 512 streams x 20 tokens/s that was most of the
mock's CPU once its HTTP layer was cheap. :class:`Pacer` keeps the waiting tasks in a heap by
due time; one ticker task sleeps until the earliest due time and then wakes every task due
within ``slack`` of it, so tokens due close together share one timer and one pass of trio's
run loop. The earliest token of a pass goes out at its due time exactly, the others at most
``slack`` early.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator

import attrs
import trio

__all__ = ["Pacer"]

DEFAULT_SLACK = 0.001
"""Seconds a token may go out before its due time to share a wake-up with an earlier one."""


@attrs.define(eq=False)
class _Waiter:
    due: float
    seq: int
    task: trio.lowlevel.Task | None

    def __lt__(self, other: _Waiter) -> bool:
        return (self.due, self.seq) < (other.due, other.seq)


@attrs.define(eq=False)
class Pacer:
    """Wakes tasks at their due times (trio's clock) from one ticker task.

    The ticker is a trio system task, started by the first wait of each ``trio.run`` and
    cancelled with that run; between waits it sleeps without a deadline.
    """

    slack: float = attrs.field(default=DEFAULT_SLACK, validator=attrs.validators.ge(0.0))
    _heap: list[_Waiter] = attrs.field(factory=list, init=False)
    _seq: Iterator[int] = attrs.field(factory=itertools.count, init=False)
    _sleep: trio.CancelScope = attrs.field(factory=trio.CancelScope, init=False)
    _run: trio.lowlevel.Task | None = attrs.field(default=None, init=False)

    async def wait_until(self, due: float) -> None:
        """Return at ``due`` (at most ``slack`` earlier when other tasks are due then too).

        Checkpoints (returns at once, after a schedule point, if ``due`` has passed).
        Cancellation-safe: a cancelled wait leaves no trace but a stale heap entry.
        """
        root = trio.lowlevel.current_root_task()
        if self._run is not root:  # the first wait in this trio.run: start its ticker
            self._run, self._heap = root, []
            trio.lowlevel.spawn_system_task(self._tick, name="iop_mock pacer")
        waiter = _Waiter(due, next(self._seq), trio.lowlevel.current_task())
        heapq.heappush(self._heap, waiter)
        if due < self._sleep.deadline:
            self._sleep.deadline = due

        def abort(_: object) -> trio.lowlevel.Abort:
            waiter.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def _tick(self) -> None:
        """Sleep until the earliest due time, wake everything due by then + ``slack``, repeat."""
        heap = self._heap
        while True:
            with trio.CancelScope(deadline=heap[0].due if heap else math.inf) as self._sleep:
                await trio.sleep_forever()
            horizon = trio.current_time() + self.slack
            while heap and heap[0].due <= horizon:
                task = heapq.heappop(heap).task
                if task is not None:
                    trio.lowlevel.reschedule(task)
