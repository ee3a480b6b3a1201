"""Candidate choice by a scan, for the paths the choice index does not serve.

Panic mode and queued retries (their own candidate lists) choose by the rule
-- highest priority, then lowest ``in_flight / capacity``, then candidate
order -- scanning the candidates; the rest reads why a request cannot run.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING

from iop_admission._config import ProviderKey

if TYPE_CHECKING:
    from .records import Waiter
    from .slots import ModelGroup, ProviderSlot


GROUP = operator.itemgetter(0)
"""The group of a ``ProviderSlot.groups`` entry ``(group, position)`` (``map(GROUP, p.groups)``)."""


def groups_of(providers: Iterable[ProviderSlot], also: Iterable[ModelGroup] = ()) -> list[ModelGroup]:
    """The model groups listing any of ``providers``, each once (and ``also`` these)."""
    seen: dict[int, ModelGroup] = {id(g): g for g in also}
    for p in providers:
        for g, _ in p.groups:
            seen.setdefault(id(g), g)
    return list(seen.values())


def choose(
    candidates: tuple[ProviderSlot, ...],
    long: bool,
    panic: bool,
    tokens: int | None = None,
    seq: int | None = None,
) -> ProviderSlot | None:
    """The rule by a scan (panic mode, retries, token budgets): highest priority, then lowest load, then order.

    Only admitting candidates count unless ``panic``; only those the request's
    ``tokens`` fit (:meth:`ProviderSlot.fits`, ``seq`` the waiter asking).
    """
    best = None
    best_prio = 0
    best_load = 0.0
    for p in candidates:
        if not p.eligible or p.in_flight >= p.capacity or not (p.admitting or panic):
            continue
        if long and p.long_in_flight >= p.long_capacity:
            continue
        if p.budgeted and not p.fits(tokens, long, seq):
            continue
        prio = p.priority
        load = p.in_flight / p.capacity
        if best is None or prio > best_prio or (prio == best_prio and load < best_load):
            best, best_prio, best_load = p, prio, load
    return best


def panic(candidates: tuple[ProviderSlot, ...], long: bool) -> bool:
    """Panic mode: some candidate could run the request, and every such one is non-admitting."""
    found = False
    for p in candidates:
        if not p.eligible or (long and p.long_capacity < 1):
            continue
        if p.admitting:
            return False
        found = True
    return found


def best_of(
    candidates: tuple[ProviderSlot, ...], long: bool, tokens: int | None = None, seq: int | None = None
) -> ProviderSlot | None:
    """A retry's choice among its own (untried) candidates, panic mode included."""
    best = choose(candidates, long, False, tokens, seq)
    if best is None and panic(candidates, long):
        best = choose(candidates, long, True, tokens, seq)
    return best


def could_run(candidates: tuple[ProviderSlot, ...], long: bool, tokens: int | None = None) -> bool:
    """Whether some candidate could ever run the request without a config change (its tokens too)."""
    return any(p.eligible and (not long or p.long_capacity >= 1) and p.could_fit(tokens, long) for p in candidates)


def reasons(
    candidates: tuple[ProviderSlot, ...], long: bool, tried: tuple[ProviderKey, ...], tokens: int | None = None
) -> tuple[str, ...]:
    """Why each candidate cannot take the request: the detail of an ``Unavailable``."""
    out = []
    for p in candidates:
        if p.key in tried:
            why = "already tried by this request"
        elif not p.configured:
            why = "removed from the configuration"
        elif not p.spec.enabled:
            why = "disabled (enabled=False)"
        elif not p.node.connected:
            why = f"node {p.node.node_id!r} is not connected (call connect({p.node.node_id!r}))"
        elif long and p.long_capacity < 1:
            why = "runs no long requests (long_context_capacity=0)"
        elif not p.could_fit(tokens, long):
            assert p.ledger is not None
            why = f"budget of {p.ledger.budget} context tokens (total_context_tokens) < the {p.need(tokens, long)} reserved"
        else:
            why = "eligible"
        out.append(f"{p.key}: {why}")
    return tuple(out)


def untried(candidates: tuple[ProviderSlot, ...], tried: tuple[ProviderKey, ...]) -> tuple[ProviderSlot, ...]:
    return tuple(p for p in candidates if p.key not in tried)


def by_seq(waiter: Waiter) -> int:
    return waiter.seq
