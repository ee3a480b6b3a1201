"""The queue page's memory ([queue-page]): its chart series of the last minutes, and grants and
refusals per configured model key.

The Edge keeps both from its start while the page is enabled (:meth:`QueuePage.run
<iop_edge.ui.page.QueuePage.run>`), so a page opened during an incident shows the minutes
before it. Both are bounded whatever clients send: :data:`HISTORY_SECONDS` samples of four
integers, and one activity row per configured model key plus one for every other name
(a request for a model that does not exist is refused under the client's own name: those
names are never kept, only counted together).

Pure: no I/O, no clock; the caller samples once a second.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from typing import final

HISTORY_SECONDS = 300
"""One sample a second, five minutes: what the page's charts span."""

RECENT = 5
"""Samples carried by every view, so that a view skipped or late loses no point of the charts."""


@final
class ChartHistory:
    """The last :data:`HISTORY_SECONDS` samples: ``[seq, in_flight, waiting, grants, refusals]``.

    ``seq`` counts samples since the Edge started; ``grants`` and ``refusals`` are those of
    the second the sample closes (every model key, unknown names included).
    """

    def __init__(self, seconds: int = HISTORY_SECONDS) -> None:
        self._samples: deque[tuple[int, int, int, int, int]] = deque(maxlen=seconds)
        self._seq = 0

    def add(self, in_flight: int, waiting: int, grants: int, refusals: int) -> None:
        """Keep one more sample (the oldest goes when the history is full)."""
        self._seq += 1
        self._samples.append((self._seq, in_flight, waiting, grants, refusals))

    def samples(self, last: int | None = None) -> list[tuple[int, int, int, int, int]]:
        """The samples kept, oldest first; only the ``last`` ones if given."""
        if last is None or last >= len(self._samples):
            return list(self._samples)
        return [self._samples[i] for i in range(len(self._samples) - last, len(self._samples))]

    def __len__(self) -> int:
        return len(self._samples)


@final
class Activity:
    """Grants and refusals per configured model key since counting began, and for the rest.

    The map holds the model keys configured when each was counted: :meth:`keep_only` drops the
    keys a reload removed, so it never holds more than the configured keys of the current and
    the previous config.
    """

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._unknown = [0, 0]
        self.grants = 0
        """Grants counted, every model key."""
        self.refusals = 0
        """Refusals counted, every model key and unknown name."""

    def count(self, model: str | None, granted: bool, configured: Container[str]) -> None:
        """Count one grant (``granted``) or one refusal of a request for ``model``."""
        counts = self._counts.get(model) if model is not None else None
        if counts is None:
            if model is not None and model in configured:
                counts = self._counts[model] = [0, 0]
            else:
                counts = self._unknown
        if granted:
            counts[0] += 1
            self.grants += 1
        else:
            counts[1] += 1
            self.refusals += 1

    def keep_only(self, configured: Container[str]) -> None:
        """Forget the model keys no longer configured."""
        for model in [m for m in self._counts if m not in configured]:
            del self._counts[model]

    def by_model(self, model: str = "") -> dict[str, dict[str, int]]:
        """The view's ``activity``: ``{key: {"grants": n, "refusals": n}}`` for the configured keys
        counted (only ``model``'s if given)."""
        return {
            key: {"grants": grants, "refusals": refusals}
            for key, (grants, refusals) in self._counts.items()
            if not model or key == model
        }

    def unknown(self) -> dict[str, int]:
        """The view's ``unknown_model``: the counts of every name that is no configured model key."""
        return {"grants": self._unknown[0], "refusals": self._unknown[1]}

    def __len__(self) -> int:
        return len(self._counts)
