"""Read-only views of the queued waiters, for a live queue page ([queue-page]).

Taken in the same synchronous step as :meth:`Admission.snapshot`, the waiters
and the provider counters describe one instant of the state admission decides on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from ._config import ModelGroup, ProviderKey
from ._core.records import Waiter


class WaiterSnapshot(NamedTuple):
    """One queued request as admission sees it: never its body. A named tuple: 10,000 of
    them are made in a few milliseconds.

    ``position`` counts from 1 among the queued requests of the same model key
    and kind (normal or long) in arrival order: the order in which they are
    granted once one of their candidates has room. ``order`` is the 1-based
    place in the whole queue (all model keys). ``age`` is the seconds since it
    was queued, ``candidates`` the providers it may still use, in preference
    order (a retry excludes the providers it already tried). ``tenant`` is the
    tenant it is charged to ([tenant-fair-share]; ``"default"`` without tenants).
    """

    seq: int
    order: int
    position: int
    model: str
    long: bool
    age: float
    attempt: int
    candidates: tuple[ProviderKey, ...]
    tenant: str = "default"


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
    shared = {name: group.candidates for name, group in models.items()}
    for order, w in enumerate(sorted(waiters, key=_seq), start=1):
        model, long = w.model, w.long
        position = positions[model, long] = positions.get((model, long), 0) + 1
        candidates = w.candidates if w.tried or model not in shared else shared[model]
        age = now - w.enqueue_time
        found.append(
            WaiterSnapshot(
                w.seq, order, position, model, long, age if age > 0 else 0.0, w.attempt, candidates, w.tenant
            )
        )
    return tuple(found)


def _seq(w: Waiter) -> int:
    return w.seq
