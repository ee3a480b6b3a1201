"""One subscription to admission's events for the Edge's observers: :func:`feed`.

Every observer of the Edge that follows admission's lifecycle (the request metrics, the
health log) is a plain function of one event, called in turn from this one task: a grant,
the commonest event, wakes one task whatever the number of observers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from iop_admission import Admission, AdmissionEvent

__all__ = ["Observer", "feed"]

Observer = Callable[[AdmissionEvent], None]
"""Called with each event, on the event loop; it must not block."""


async def feed(
    admission: Admission,
    observers: Sequence[Observer],
    *,
    buffer: int = 4096,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Give every event to each of ``observers``, in order, until cancelled.

    Subscribes with a ``buffer``-event channel, calls ``task_status.started()`` once
    subscribed (``await nursery.start(feed, admission, observers)``), then takes every
    event waiting at each wake-up. Best effort like every subscriber: a full buffer drops
    events (counted in the snapshot's ``events_dropped``). Cancellation closes the
    subscription, losing nothing but future events.
    """
    async with admission.subscribe(buffer=buffer) as events:
        task_status.started()
        async for event in events:
            for observe in observers:
                observe(event)
            while True:
                try:
                    event = events.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                for observe in observers:
                    observe(event)
