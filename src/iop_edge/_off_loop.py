"""The Edge's reading and freeing of large state a slice per loop turn; its off-loop work.

The worker-thread machinery (:func:`run_off_loop`, :func:`run_in_turns`,
:func:`yield_to_loop`, :func:`bulk_work`, :func:`paced`) is :mod:`iop_io.off_loop`'s,
named here too for the Edge's modules. What is the Edge's own:

- :func:`snapshot_in_slices`, :func:`rows_in_slices`: a large pool's snapshot read a
  slice of providers per loop turn ([status-at-size]).
- :func:`release_in_slices`: the last reference to a large config, dropped at once,
  frees all its objects in one go; here a slice per loop turn.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import attrs
import trio

from iop_admission import Admission, ProviderRow, ProviderSnapshot, Snapshot
from iop_io import bulk_work as bulk_work
from iop_io import paced as paced
from iop_io import run_in_turns as run_in_turns
from iop_io import run_off_loop as run_off_loop
from iop_io import yield_to_loop as yield_to_loop

T = TypeVar("T")
R = TypeVar("R")

SNAPSHOT_SLICE = 500
"""Providers read per loop turn by :func:`snapshot_in_slices`."""

ROW_SLICE = 1000
"""Providers read per loop turn by :func:`rows_in_slices` (a plain row costs about half
an object: about the time of a :data:`SNAPSHOT_SLICE`)."""

RELEASE_SLICE = 1000
"""References :func:`release_in_slices` drops per loop turn (about a millisecond for a
config's nodes)."""

NODE_SLICE = 1000
"""Nodes whose connection state ``/status`` reads per loop turn (a node's row costs about
a third of a provider's, so about the time of a :data:`SNAPSHOT_SLICE`)."""

ATOMS: Final = (str, bytes, int, float, bool, type(None))
"""Objects that hold no reference to another: never walked (:func:`release_in_slices`, the config
reader's pickles), freed with whatever holds them."""


async def release_in_slices(holder: list[object], size: int = RELEASE_SLICE) -> None:
    """Free the object ``holder`` holds (``holder`` must hold its only reference), about ``size``
    objects per loop turn.

    Dropped at once, the last reference to a large config frees all its
    objects in one go, holding the loop meanwhile. Here the objects reachable
    from it are first walked, ``size`` per loop turn, each held in a list in
    the order met (a container before what it holds); a tuple, list or mapping
    of more than ``size`` items is not walked into, its items are held right
    after it instead (each frees only what hangs from it: a node's few
    objects). Then the list is cut ``size`` references per loop turn from its
    start: each object dropped frees only itself, since what it refers to is
    still held further on.
    Checkpoints. Cancelled, the rest is freed at once.
    """
    root = holder.pop()
    held: list[object] = []
    stack = [root]
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        if type(obj) in ATOMS or id(obj) in seen:
            continue
        seen.add(id(obj))
        held.append(obj)
        if isinstance(obj, (dict, types.MappingProxyType, tuple, list)) and len(obj) > size:
            held.extend(obj)
            if isinstance(obj, (dict, types.MappingProxyType)):
                held.extend(obj.values())
        else:
            stack.extend(references(obj))
        if len(seen) % size == 0:
            await trio.lowlevel.checkpoint()
    del root, obj, stack, seen
    held.reverse()  # the first met last: cut from the end
    await drop_in_slices(held, size)


async def drop_in_slices(items: list[object], size: int = RELEASE_SLICE) -> None:
    """Empty ``items``, ``size`` references from its end per loop turn (the first slice at once,
    a checkpoint before each later one): many references dropped at once hold the loop even
    when nothing is freed."""
    del items[-size:]
    while items:
        await trio.lowlevel.checkpoint()
        del items[-size:]


def references(obj: Any) -> list[Any]:
    """The objects ``obj`` refers to, as pickle walks them: a container's items (a mapping's keys
    and values), an attrs instance's fields; none for anything else."""
    if isinstance(obj, (tuple, list, set, frozenset)):
        return list(obj)
    if isinstance(obj, (dict, types.MappingProxyType)):
        return [item for pair in obj.items() for item in pair]
    if attrs.has(type(obj)):
        return [getattr(obj, field.name) for field in attrs.fields(type(obj))]
    return []


async def snapshot_in_slices(admission: Admission, size: int = SNAPSHOT_SLICE) -> Snapshot:
    """``admission.snapshot()``, read ``size`` providers per loop turn ([status-at-size]).

    A whole snapshot of a large pool holds the loop as long as it takes (a
    stream's events wait that long); a slice far less. The Edge-wide fields are read
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
