"""The Edge process's garbage-collector policy [reconnect-storm].

A full (oldest-generation) collection walks every tracked object while holding
the GIL, so the Edge's loop stops for its whole length: nothing is relayed, no
heartbeat is read. At 10,000 nodes the Edge holds millions of long-lived
objects (the parsed config, the pool, each node's connection). CPython starts
a full collection when the oldest generation has grown by a quarter since the
last one, and it grows by every object still alive at a young collection
(every 700 allocations by default): the objects of each pending connection
and each queued request. With the default policy one benchmark pass at 10,000
nodes ran 51 full collections, 86 s in all and up to 5.3 s each (box shared),
which let connections miss their registration deadline and the
single-candidate key fall to tens of requests/s.

With :data:`YOUNG_THRESHOLD` allocations between young collections, those
short-lived objects are mostly gone before a collection looks at them, so far
fewer are promoted (the same pass: one full collection, 70 ms). A young
collection then scans up to that many objects (a few ms).

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
