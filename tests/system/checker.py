"""The whole-system check's checker: a recorded history against the promises, as Jepsen's checkers do.

Two records make the history: what the clients saw (:class:`Attempt`: one per request sent to an
Edge, each with a unique marker) and what the backends ran (:class:`Execution`: one per request a
backend received, with its marker). The promises, each a function returning its violations:

- :func:`at_most_once`: no marker executed twice, whatever was lost meanwhile: a run sent to a
  node the Edge then lost (killed, stopped, cut off) is never failed over, since the node may have
  run it (docs/openai-api.md, Failover before the first byte);
- :func:`answered_once`: a 200 answer means exactly one execution of its marker;
- :func:`refused_never_ran`: an attempt refused before its run (a 429 or 503 with an admission
  code) has no execution;
- :func:`within_capacity`: at no instant does a provider run more requests than its capacity.

Pure functions over values: unit-tested with histories built by hand, each with a control that
breaks it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

NOT_RUN_CODES = frozenset(
    {"not_leader", "queue_full", "queue_timeout", "overloaded", "unavailable", "tenant_max_queue", "tenant_shed"}
)
"""Error codes of refusals made before a run was sent: an attempt refused so never reached a backend."""


@attrs.frozen
class Execution:
    """One request a backend received."""

    marker: str
    provider: str
    arrival: float
    end: float
    outcome: str  # "answered" or "abandoned" (its client left first)


@attrs.frozen
class Loss:
    """A node lost for a while (killed, stopped, or its link to an Edge cut), on the backends' clock:
    part of a run's history (kept with a failing schedule to read it by), excusing nothing."""

    provider: str
    start: float
    end: float


@attrs.frozen
class Attempt:
    """One request a client sent to an Edge, and what came back."""

    marker: str
    edge: str
    start: float
    end: float
    status: int | None  # None: no answer (connection refused, cut, timed out)
    code: str | None = None  # the OpenAI error code of an error answer


def read_executions(paths: Iterable[Path]) -> list[Execution]:
    """Every backend's log, as executions (a line cut by a SIGKILL mid-write is left out)."""
    found = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                found.append(Execution(**json.loads(line)))
            except (ValueError, TypeError):
                continue
    return found


def at_most_once(executions: Iterable[Execution]) -> list[str]:
    counts = Counter(e.marker for e in executions)
    return [f"marker {m!r} executed {n} times" for m, n in sorted(counts.items()) if n > 1]


def answered_once(attempts: Iterable[Attempt], executions: Iterable[Execution]) -> list[str]:
    counts = Counter(e.marker for e in executions)
    return [
        f"marker {a.marker!r} answered 200 by {a.edge} but executed {counts[a.marker]} times"
        for a in attempts
        if a.status == 200 and counts[a.marker] != 1
    ]


def refused_never_ran(attempts: Iterable[Attempt], executions: Iterable[Execution]) -> list[str]:
    ran = {e.marker for e in executions}
    return [
        f"marker {a.marker!r} refused {a.status} {a.code} by {a.edge} yet executed"
        for a in attempts
        if a.status in (429, 503) and a.code in NOT_RUN_CODES and a.marker in ran
    ]


def within_capacity(executions: Iterable[Execution], capacity: Mapping[str, int]) -> list[str]:
    """Sweep each provider's arrivals and ends in time order; an end at the same instant as an
    arrival counts first (the slot was free)."""
    by_provider: dict[str, list[tuple[float, int, str]]] = {}
    for e in executions:
        points = by_provider.setdefault(e.provider, [])
        points.append((e.arrival, 1, e.marker))
        points.append((e.end, -1, e.marker))
    found = []
    for provider, points in sorted(by_provider.items()):
        running = peak = 0
        for when, step, marker in sorted(points, key=lambda p: (p[0], p[1])):
            running += step
            if running > capacity[provider] and running > peak:
                found.append(
                    f"{provider} ran {running} at once at {when:.3f} (capacity {capacity[provider]}; {marker!r})"
                )
            peak = max(peak, running)
    return found


def violations(
    attempts: Iterable[Attempt],
    executions: Iterable[Execution],
    capacity: Mapping[str, int],
) -> list[str]:
    """Every promise broken by the history (empty: it holds)."""
    attempts, executions = list(attempts), list(executions)
    return [
        *at_most_once(executions),
        *answered_once(attempts, executions),
        *refused_never_ran(attempts, executions),
        *within_capacity(executions, capacity),
    ]
