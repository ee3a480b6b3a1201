"""One timer for every paced stream of a mock backend: :class:`iop_io.DueQueue`, started per ``trio.run``.

A ``trio.sleep`` per token per stream costs a cancel scope with a deadline, its expiry and
the ``Cancelled`` it raises and catches: at 512 streams x 20 tokens/s that was most of the
mock's CPU once its HTTP layer was cheap. Every stream waits on one due queue instead;
tokens due within ``slack`` of each other share one timer and one pass of trio's run loop.
The earliest token of a pass goes out at its due time exactly, the others at most
``slack`` early.
"""

from __future__ import annotations

import attrs
import trio

from iop_io import DueQueue

__all__ = ["Pacer"]

DEFAULT_SLACK = 0.001
"""Seconds a token may go out before its due time to share a wake-up with an earlier one."""


@attrs.define(eq=False)
class Pacer:
    """Wakes tasks at their due times (trio's clock) from one runner task.

    The runner is a trio system task, started by the first wait of each ``trio.run`` and
    cancelled with that run (a backend object may serve several runs: tests).
    """

    slack: float = attrs.field(default=DEFAULT_SLACK, validator=attrs.validators.ge(0.0))
    _queue: DueQueue | None = attrs.field(default=None, init=False)
    _run: trio.lowlevel.Task | None = attrs.field(default=None, init=False)

    async def wait_until(self, due: float) -> None:
        """Return at ``due`` (at most ``slack`` earlier when other tasks are due then too).

        Checkpoints (returns after a schedule point if ``due`` has passed).
        Cancellation-safe: a cancelled wait leaves no trace but a dropped entry.
        """
        root = trio.lowlevel.current_root_task()
        queue = self._queue
        if queue is None or self._run is not root:  # the first wait in this trio.run: start its runner
            queue = self._queue = DueQueue(quantum=self.slack)
            self._run = root
            trio.lowlevel.spawn_system_task(queue.run, name="iop_mock pacer")
        await queue.wait_until(due)
