"""The listener's pacer: paused connections left unread until they are due, woken by one task.

A pause is a wait in one :class:`iop_io.DueQueue`, not a timer of its own:
:meth:`Pacer.run` wakes every connection due (up to :data:`PACING_BATCH` a
scheduling round) and may answer a refused client's retry itself (the
``answer`` callback of :meth:`Pacer.pause`) without waking the connection's
task. It also remembers refused requests by their bytes (:meth:`Pacer.remember`),
so a flood's identical retries are refused without being parsed again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import final

from iop_io import Answer, DueQueue

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


@final
class Pacer:
    """The paused connections of one listener, woken at their times by one task.

    A pause is a wait in one :class:`iop_io.DueQueue` (quantum
    :data:`PACING_QUANTUM`, batch :data:`PACING_BATCH`), not a timer per
    connection: a flood of paced refusals costs one timer wake-up per bunch,
    and each connection one task wake-up; a bunch larger than the batch is
    woken over several scheduling rounds, so the loop never runs a whole
    bunch of refusals in one pass. A pause may come with an ``answer`` (the
    due queue's): it answers the client itself, without its task, and says
    when to look again. The requests refused before, by their exact bytes, are
    kept here for those answers (:meth:`remember`, :meth:`recall`).
    """

    __slots__ = ("due", "heads")

    def __init__(self) -> None:
        self.due = DueQueue(quantum=PACING_QUANTUM, batch=PACING_BATCH)
        self.heads: dict[bytes, Head] = {}

    def __repr__(self) -> str:
        return f"<Pacer {len(self.due)} paused>"

    def remember(self, request: bytes, head: Head) -> None:
        """Keep ``head``, parsed from exactly the bytes ``request`` (a whole request, body included), refused."""
        if len(request) <= REMEMBERED_BYTES and len(self.heads) < REMEMBERED_HEADS:
            self.heads[request] = head

    def recall(self, request: bytes) -> Head | None:
        """The head remembered for exactly the bytes ``request``, or None."""
        return self.heads.get(request)

    async def pause(self, until: float, answer: Answer | None = None) -> None:
        """Wait until ``until`` (trio's clock), or somewhat less (:data:`PACING_QUANTUM`); when due,
        ``answer()`` (if given) may extend the pause by returning a later time. Checkpoints."""
        await self.due.wait_until(until, answer)

    async def run(self) -> None:
        """Wake paused connections when due, until cancelled. Checkpoints."""
        await self.due.run()


def step_after(due: float, at: float) -> float:
    """The first of ``due`` plus whole :data:`RECHECK_AFTER` steps (one at least) later than ``at``."""
    return due + max(1, math.floor((at - due) / RECHECK_AFTER) + 1) * RECHECK_AFTER
