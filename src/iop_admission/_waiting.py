"""Read-only views of the queued waiters, for a live queue page ([queue-page]).

Taken in the same synchronous step as :meth:`Admission.snapshot`, the waiters
and the provider counters describe one instant of the state admission decides on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import final

import attrs

from ._config import ModelGroup, ProviderKey
from ._state import Waiter


@final
@attrs.frozen
class WaiterSnapshot:
    """One queued request as admission sees it: never its body.

    ``position`` counts from 1 among the queued requests of the same model key
    and kind (normal or long) in arrival order: the order in which they are
    granted once one of their candidates has room. ``order`` is the 1-based
    place in the whole queue (all model keys). ``age`` is the seconds since it
    was queued, ``candidates`` the providers it may still use, in preference
    order (a retry excludes the providers it already tried).
    """

    seq: int
    order: int
    position: int
    model: str
    long: bool
    age: float
    attempt: int
    candidates: tuple[ProviderKey, ...]


def waiter_snapshots(
    waiters: Iterable[Waiter], now: float, models: Mapping[str, ModelGroup]
) -> tuple[WaiterSnapshot, ...]:
    """Every queued waiter of ``waiters`` (in arrival order) as a :class:`WaiterSnapshot` at ``now``.

    A first attempt's candidates are its model key's in ``models`` (the config in
    force): the waiters of one key share that one tuple, so 10,000 waiters cost
    10,000 small objects, not 10,000 copies of the candidate list.
    """
    positions: dict[tuple[str, bool], int] = {}
    found: list[WaiterSnapshot] = []
    for order, w in enumerate(sorted(waiters, key=_seq), start=1):
        kind = (w.model, w.long)
        position = positions.get(kind, 0) + 1
        positions[kind] = position
        age = max(0.0, now - w.enqueue_time)
        group = models.get(w.model)
        candidates = group.candidates if group is not None and not w.tried else w.candidates
        found.append(WaiterSnapshot(w.seq, order, position, w.model, w.long, age, w.attempt, candidates))
    return tuple(found)


def _seq(w: Waiter) -> int:
    return w.seq
