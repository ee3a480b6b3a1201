"""The Edge process's garbage-collector policy [reconnect-storm].

A full (oldest-generation) collection walks every tracked object while holding
the GIL, so the Edge's loop stops for its whole length: nothing is relayed, no
heartbeat is read. At 10,000 nodes the Edge holds millions of long-lived
objects (the parsed config, the pool, each node's connection). CPython starts
a full collection when the oldest generation has grown by a quarter since the
last one, and it grows by every object still alive at a young collection
(every 700 allocations by default): the objects of each pending connection
and each queued request. With the default policy, full collections of seconds
each came again and again at fleet size, letting connections miss their
registration deadline.

With :data:`YOUNG_THRESHOLD` allocations between young collections, those
short-lived objects are mostly gone before a collection looks at them, so far
fewer are promoted. A young collection then scans up to that many objects.

Process-wide (the collector is); set by the ``iop-edge`` entry point, not by
:class:`~iop_edge.EdgeService`, so an Edge embedded in another program or a
test keeps that program's policy.
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG_THRESHOLD: Final = 50_000
"""Allocations (net of deallocations) between two young collections (CPython's default: 700)."""


def tune() -> None:
    """Set the young generation's threshold to :data:`YOUNG_THRESHOLD`; the older ones keep theirs."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
