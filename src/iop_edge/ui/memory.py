"""The queue page's memory ([queue-page]): kept by the Edge from its start, whether or not
anyone watches, so that a page opened during an incident shows the minutes before it.

One task (:meth:`PageMemory.run`) counts grants and refusals from admission's events
(:class:`~iop_edge.ui.history.Activity`) and takes one chart sample a second
(:class:`~iop_edge.ui.history.ChartHistory`) while ``ui.enabled`` holds.
"""

from __future__ import annotations

from typing import final

import trio

from iop_edge._off_loop import rows_in_slices
from iop_edge.ui.history import Activity, ChartHistory
from iop_edge.ui.parts import PageParts

SAMPLE_S = 1.0
"""One chart sample a second."""
_ROWS_PER_SECOND = 2000  # provider rows read a second, at most (about)


@final
class PageMemory:
    """The chart series and the activity counts of one Edge's page."""

    def __init__(self, parts: PageParts) -> None:
        self._parts = parts
        self.activity = Activity()
        """The grants and refusals counted so far."""
        self.history = ChartHistory()
        """The chart series kept so far."""

    async def run(self) -> None:
        """Keep the memory while the page is enabled, until cancelled.

        The Edge starts it once, with its other tasks. While ``ui.enabled`` holds: grants and
        refusals counted from admission's events (:meth:`_count`), and one chart sample a
        second. While it does not: only a look at the config each second. Checkpoints;
        cancellation ends it.
        """
        while True:
            if self._parts.config.ui.enabled:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._count)
                    await self._sample_while_enabled()
                    nursery.cancel_scope.cancel()
            await trio.sleep(SAMPLE_S)

    async def _sample_while_enabled(self) -> None:
        """One chart sample a second (the in-flight total, the queue depth, the second's grants and
        refusals) until ``ui.enabled`` turns false. Checkpoints.

        The in-flight total needs every provider's row: they are read a slice per loop turn
        (:func:`rows_in_slices`, as ``/status`` reads them), and at most about
        :data:`_ROWS_PER_SECOND` a second: a pool of more providers is read every few seconds,
        its last total kept between.
        """
        activity, admission = self.activity, self._parts.admission
        grants, refusals = activity.grants, activity.refusals
        in_flight, read_in = 0, 0  # the last total, and the samples until the next reading
        due = trio.current_time() + SAMPLE_S
        while True:
            await trio.sleep_until(due)
            if not self._parts.config.ui.enabled:
                return
            due = max(due + SAMPLE_S, trio.current_time())  # a late wake-up does not pile up samples
            if read_in <= 0:
                _, rows = await rows_in_slices(admission)
                in_flight = sum(row["in_flight"] for row in rows)
                read_in = -(-len(rows) // _ROWS_PER_SECOND)
            read_in -= 1
            self.history.add(in_flight, admission.queue_depth, activity.grants - grants, activity.refusals - refusals)
            grants, refusals = activity.grants, activity.refusals
            activity.keep_only(admission.config.models)

    async def _count(self) -> None:
        """Count grants and refusals per model key from admission's events, until cancelled.

        Only configured model keys get a row of their own; a refusal of any other name (a
        client's made-up model) is counted in one ``unknown_model`` row. Best effort, like
        every subscriber: a full buffer drops events (the page's rates then read low for
        that second).
        """
        admission, activity = self._parts.admission, self.activity
        async with admission.subscribe(buffer=1024) as events:
            async for event in events:
                kind = event.kind
                if kind == "granted":
                    activity.count(event.model, True, admission.config.models)
                elif kind in ("rejected", "timed_out"):
                    activity.count(event.model, False, admission.config.models)
