"""One timer for every paced stream of a mock backend: :class:`iop_io.DueQueue`, started per ``trio.run``.

A ``trio.sleep`` per token per stream costs a cancel scope with a deadline, its expiry and
the ``Cancelled`` it raises and catches: at 512 streams x 20 tokens/s that was most of the
mock's CPU once its HTTP layer was cheap. Every stream waits on one due queue instead;
tokens due within ``slack`` of each other share one timer and one pass of trio's run loop.
The earliest token of a pass goes out at its due time exactly, the others at most
``slack`` early.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import attrs
import trio

from iop_io import DueQueue

from .framing import Send

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

    async def stream(
        self,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        frames: Iterator[bytes],
        n_tokens: int,
        *,
        head: int,
        trailer: bytes,
        tokens_per_second: float,
        hang_after: int | None,
    ) -> None:
        """Send a streamed response paced like a real generation.

        The headers and the ``head`` frames (the role chunk); then the ``n_tokens`` token
        frames, token ``k`` at ``k / tokens_per_second`` after the head (a schedule anchored on
        the head, so time spent sending does not slow the rate down; a stream more than one
        interval late starts its schedule again from now rather than sending a burst; a token
        may go out up to ``slack`` early to share a wake-up with another stream's); then the
        remaining frames (finish chunk, usage chunk) with ``trailer`` in one message. With
        ``tokens_per_second == 0`` the whole body is one message. ``hang_after``: send that
        many tokens, then nothing (``POST /fault`` ``mid_stream``).
        """
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if not tokens_per_second and hang_after is None:
            await send({"type": "http.response.body", "body": b"".join(frames) + trailer})
            return
        first = b"".join(itertools.islice(frames, head))
        await send({"type": "http.response.body", "body": first, "more_body": True})
        interval = 1.0 / tokens_per_second if tokens_per_second else 0.0
        due = trio.current_time()
        for sent, frame in enumerate(itertools.islice(frames, n_tokens)):
            if sent == hang_after:
                await trio.sleep_forever()
            if interval:
                due += interval
                await self.wait_until(due)
                if (late := trio.current_time() - due) > interval:
                    due += late
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"".join(frames) + trailer})
