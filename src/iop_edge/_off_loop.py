"""Run long pure-Python work in a worker thread without stalling the event loop.

A worker thread alone is not enough: the thread and the loop share the GIL.
Each time the loop thread makes a system call it lets the GIL go, the worker
takes it, and the loop then waits up to the interpreter's switch interval
(5 ms by default) to get it back -- several times per request it answers. A
full garbage collection started by the worker's allocations holds the GIL for
the whole heap (over a second with 10,000 nodes configured). So while any
such work runs, the switch interval is short and automatic collection is off;
both are restored when the last one ends.

Collection back on, the objects a reload left (its new config: some
300,000 of them at 10,000 nodes) would all be young: the next allocation on
the loop would start a young-generation collection over all of them, then a
middle one, then a full one (130, 60 and 260 ms measured on a loaded box).
So after work that keeps what it made (``keeps_objects``), everything tracked
is moved to the oldest generation first
(``gc.freeze()`` then ``gc.unfreeze()``, O(1) each): nothing is scanned now,
garbage among those objects is still found by the next full collection, and
the full collections come no sooner than they would have.

Only objects the loop will not touch meanwhile may be handed to the work
(a snapshot taken on the loop, a file path): the loop keeps running.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import trio

from iop_admission import Admission, ProviderRow, ProviderSnapshot, Snapshot

T = TypeVar("T")
R = TypeVar("R")

SWITCH_INTERVAL = 0.0005
"""GIL switch interval (s) while work runs off the loop: the loop thread, back from a
system call, waits at most this long for the GIL."""

SNAPSHOT_SLICE = 500
"""Providers read per loop turn by :func:`snapshot_in_slices` (about 1.5 ms of CPU)."""

ROW_SLICE = 1000
"""Providers read per loop turn by :func:`rows_in_slices` (a plain row costs about half
an object: about the time of a :data:`SNAPSHOT_SLICE`)."""

NODE_SLICE = 1000
"""Nodes whose connection state ``/status`` reads per loop turn (a node's row costs about
a third of a provider's, so about the time of a :data:`SNAPSHOT_SLICE`)."""

_running = 0
_saved: tuple[float, bool] = (0.005, True)
_promote = False


async def run_off_loop(work: Callable[[], T], *, keeps_objects: bool = False) -> T:
    """``work()`` in a worker thread, with a short switch interval and automatic GC off meanwhile.

    ``keeps_objects``: the result holds many new objects that will live on (a
    config); they join the oldest generation when collection is switched back on.

    Checkpoints (it waits for the thread). Cancelled, it returns at once and the
    thread's result is dropped (the thread runs to its end). Raises what
    ``work`` raises.
    """
    global _running, _saved, _promote
    if _running == 0:
        _saved = (sys.getswitchinterval(), gc.isenabled())
        sys.setswitchinterval(min(_saved[0], SWITCH_INTERVAL))
        gc.disable()
    _running += 1
    try:
        return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
    finally:
        _running -= 1
        _promote = _promote or keeps_objects
        if _running == 0:
            sys.setswitchinterval(_saved[0])
            if _saved[1]:
                if _promote:
                    gc.freeze()  # every generation to the permanent one,
                    gc.unfreeze()  # and all of it back as the oldest: no young scan of the new objects
                gc.enable()
            _promote = False


async def snapshot_in_slices(admission: Admission, size: int = SNAPSHOT_SLICE) -> Snapshot:
    """``admission.snapshot()``, read ``size`` providers per loop turn ([status-at-size]).

    At 10,000 providers a whole snapshot holds the loop about 30 ms (a stream's
    events wait that long); a slice about 1.5 ms. The Edge-wide fields are read
    with the first slice; each provider's row is read at once, rows of different
    slices a few loop turns apart. A config refresh between two slices starts
    the reading again, so the rows are always those of one config; after three
    such restarts the rest is read in one go. Checkpoints (between slices).
    """

    def first_slice(count: int | None) -> tuple[Snapshot, Sequence[ProviderSnapshot]]:
        head = admission.snapshot(count=count)
        return head, head.providers

    head, rows = await _in_slices(
        admission, first_slice, lambda first, count: admission.snapshot(first=first, count=count).providers, size
    )
    return attrs.evolve(head, providers=tuple(rows))


async def rows_in_slices(admission: Admission, size: int = ROW_SLICE) -> tuple[Snapshot, list[ProviderRow]]:
    """The snapshot's Edge-wide fields (``providers`` empty) and its providers as
    :meth:`~iop_admission.Admission.provider_rows`, read as :func:`snapshot_in_slices` reads
    (``size`` per loop turn). Checkpoints (between slices)."""
    return await _in_slices(
        admission,
        lambda count: (admission.snapshot(count=0), admission.provider_rows(count=count)),
        lambda first, count: admission.provider_rows(first=first, count=count),
        size,
    )


async def _in_slices(
    admission: Admission,
    first_slice: Callable[[int | None], tuple[Snapshot, Sequence[R]]],
    read: Callable[[int, int], Sequence[R]],
    size: int,
) -> tuple[Snapshot, list[R]]:
    """The Edge-wide fields and every provider's row, ``size`` per loop turn, all of one config
    (see :func:`snapshot_in_slices`): ``first_slice(count)`` reads both for the first ``count``
    providers (None: all), ``read(first, count)`` the rows of the next. Checkpoints."""
    for _ in range(3):
        config = admission.config
        head, first_rows = first_slice(size)
        rows = list(first_rows)
        for first in range(size, len(config.providers), size):
            await trio.lowlevel.checkpoint()
            if admission.config is not config:
                break
            rows.extend(read(first, size))
        else:
            return head, rows
    head, all_rows = first_slice(None)
    return head, list(all_rows)
