"""The trio layer's event fan-out: bounded memory channels, best effort.

A full channel drops the event and counts it; admission never waits for a
subscriber, and no correctness path reads events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import final

import trio

from iop_admission.core import Lease

from .events import AdmissionEvent, lease_event, rejected_event

__all__ = ["EventFanout", "now_or_none"]


def now_or_none() -> float | None:
    """``trio.current_time()``, or None outside trio."""
    try:
        return trio.current_time()
    except RuntimeError:
        return None


@final
class EventFanout:
    """The subscribers' channels and the count of events they dropped.

    ``subscribers`` is truthy only while someone listens: callers test it
    before building an event, so an unobserved admission pays nothing.
    """

    __slots__ = ("subscribers", "dropped")

    def __init__(self) -> None:
        self.subscribers: list[trio.MemorySendChannel[AdmissionEvent]] = []
        self.dropped = 0

    @asynccontextmanager
    async def subscribe(self, buffer: int) -> AsyncIterator[trio.MemoryReceiveChannel[AdmissionEvent]]:
        """A channel receiving every event emitted while the block runs (up to ``buffer`` unread)."""
        send, receive = trio.open_memory_channel[AdmissionEvent](buffer)
        self.subscribers.append(send)
        try:
            async with receive:
                yield receive
        finally:
            self.subscribers.remove(send)
            send.close()

    def emit(self, event: AdmissionEvent) -> None:
        """Offer ``event`` to every subscriber; a full channel drops it (counted)."""
        for channel in self.subscribers:
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                self.dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    def rejected(self, model: str, long: bool, exc: BaseException) -> None:
        """Emit ``rejected`` for a request on ``model`` that failed with ``exc``."""
        self.emit(rejected_event(now_or_none(), model, long, exc))

    def lease(
        self,
        kind: str,
        lease: Lease,
        *,
        waited: float | None = None,
        attempt: int | None = None,
        reason: str | None = None,
    ) -> None:
        """Emit the event ``kind`` about ``lease``."""
        self.emit(lease_event(kind, now_or_none(), lease, waited=waited, attempt=attempt, reason=reason))
