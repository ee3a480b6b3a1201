"""One task parked until another wakes it: the single-consumer wait of a queue.

A queue with exactly one reader (a run's relay, a node link's writer, a
connection's disconnect watch) needs no more than this: :meth:`ParkedTask.wake`
reschedules that task (it never waits and never allocates), and a cancelled
wait leaves nothing behind. ``trio.lowlevel.ParkingLot`` does the same for any
number of tasks, at the price of an ordered dict per lot and a statistics
object; these queues are on the relay's per-token path.
"""

from __future__ import annotations

from typing import final

import trio

__all__ = ["ParkedTask"]


@final
class ParkedTask:
    """The one task waiting for a wake-up, if any.

    ``task`` is the parked task (None when nothing waits). A second task that
    parks while one is parked replaces it as the one :meth:`wake` reschedules:
    the owner guarantees one consumer.
    """

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None

    def __repr__(self) -> str:
        return f"<ParkedTask {'parked' if self.task is not None else 'idle'}>"

    async def park(self) -> None:
        """Wait until :meth:`wake`. Checkpoints: a schedule point, and a cancel point (cancellation ends
        the wait and unparks the task)."""
        self.task = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self.task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def wake(self) -> bool:
        """Let the parked task run; whether one was parked. Never waits."""
        task, self.task = self.task, None
        if task is None:
            return False
        trio.lowlevel.reschedule(task)
        return True
