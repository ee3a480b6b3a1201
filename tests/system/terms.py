"""The whole-system check's step-down promise: every leader steps down within its TTL of losing its lease.

A leader's lease lives in etcd for the TTL from the last renewal etcd answered; a leader that
cannot renew it (etcd killed or stopped, the leader stopped, cut off) must have stepped down by
then, or a successor may lead beside it ([ha-step-down], docs/ha.md). The Edges' own logs say
when (each line has the wall-clock time, to the millisecond): ``leading at epoch N`` opens a
term, each ``renewed the lease of epoch N`` (a renewal etcd answered, logged at DEBUG: the
cluster runs its Edges with ``--log-level debug``) renews it, ``stepped down (epoch N)`` ends it.

:func:`terms_of` reads one Edge process's log into its :class:`Term` values;
:func:`stepped_down_in_time` checks that no term ran longer than the TTL after a renewal
without the next one or its step-down. The time an Edge spent stopped by the nemesis
(:class:`Stop`: SIGSTOP to SIGCONT) does not count: a stopped leader admits and sends nothing
(the fence checks its deadline at every grant when it wakes, docs/ha.md); what counts is that it
steps down promptly once it runs again. A killed Edge's term ends with its last line. Pure
functions over values, tested on logs written by hand.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from datetime import datetime

import attrs

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ (\S+): (.*)$")
_WON = re.compile(r"leading at epoch (\d+)$")
_DOWN = re.compile(r"stepped down \(epoch (\d+)\)$")
_RENEWED = re.compile(r"renewed the lease of epoch \d+")


@attrs.frozen
class Term:
    """One term of one Edge process, from its log (wall-clock seconds)."""

    edge: str
    epoch: int
    alive: tuple[float, ...]
    """When it won, then each renewal etcd answered, in order."""
    end: float
    """Its step-down; for a term still open when the log ends (the Edge killed, or the run over), the last line."""
    stepped_down: bool


@attrs.frozen
class Stop:
    """An Edge stopped (SIGSTOP) from ``start`` to ``end`` (SIGCONT), wall-clock seconds."""

    edge: str
    start: float
    end: float


def terms_of(edge: str, log: str) -> list[Term]:
    """The terms in one Edge process's ``log`` (its stderr as written)."""
    terms: list[Term] = []
    epoch: int | None = None
    alive: list[float] = []
    last = 0.0
    for line in log.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        stamp, logger, text = match.groups()
        last = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if logger == "iop_edge.ha" and (won := _WON.search(text)):
            epoch, alive = int(won[1]), [last]
        elif epoch is not None and logger == "iop_edge.ha" and _DOWN.search(text):
            terms.append(Term(edge, epoch, tuple(alive), last, stepped_down=True))
            epoch = None
        elif epoch is not None and logger == "iop_edge.ha" and _RENEWED.search(text):
            alive.append(last)
    if epoch is not None:
        terms.append(Term(edge, epoch, tuple(alive), last, stepped_down=False))
    return terms


def running(edge: str, start: float, end: float, stops: Iterable[Stop]) -> float:
    """Seconds from ``start`` to ``end`` that ``edge`` was not stopped."""
    stopped = sum(max(0.0, min(end, s.end) - max(start, s.start)) for s in stops if s.edge == edge)
    return end - start - stopped


def stepped_down_in_time(terms: Iterable[Term], stops: Iterable[Stop], ttl: float) -> list[str]:
    """Every term that went on past ``ttl`` seconds (of running time) after a renewal without
    another renewal or its step-down."""
    stops = list(stops)
    found = []
    for term in terms:
        points = [*term.alive, term.end]
        for renewed, after in itertools.pairwise(points):
            ran = running(term.edge, renewed, after, stops)
            if ran > ttl:
                what = "stepped down" if after == term.end and term.stepped_down else "went on"
                found.append(
                    f"{term.edge} led epoch {term.epoch} {ran:.3f} s past a renewal (TTL {ttl:g} s) before it {what}"
                )
                break
    return found
