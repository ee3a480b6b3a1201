"""The Edge's side of epoch fencing [epoch-fencing] (wire v3, docs/ha.md).

:class:`LeaderFence` holds the epoch this Edge stamps on its runs while it leads
(None while it stands by, and always without ``ha:``), announces a won term to
every v3 node connection with ``leader``, and keeps what the nodes answered
(``in_flight``: the runs the previous leader left running on each node) and how
many of this Edge's runs nodes refused as ``stale_epoch``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol, final

import attrs

from iop_wire import InFlight, Leader, encode

logger = logging.getLogger("iop_edge.ha")

FENCED_PROTOCOL = 3
"""The first wire version that carries epochs."""


class Announced(Protocol):
    """What the fence needs of a node connection (:class:`~iop_edge._links.NodeLink`)."""

    node_id: str
    protocol: int

    def send_frame(self, frame: str) -> None: ...


@final
@attrs.define(eq=False)
class LeaderFence:
    """This Edge's epoch while it leads, and the nodes' answers.

    Attributes:
        epoch: stamped on every run and tunnel request of a v3 connection; None
            while this Edge does not lead.
        inherited: per node, ``{provider: runs}`` it reported in flight at this
            term's start (runs of any Edge, on the node's one gate).
        stale_refused: this Edge's runs the nodes refused as ``stale_epoch``.
    """

    epoch: int | None = None
    inherited: dict[str, dict[str, int]] = attrs.field(factory=dict)
    stale_refused: int = 0

    def lead(self, epoch: int, links: Iterable[Announced]) -> None:
        """This Edge won a term at ``epoch``: announce it to every v3 node connection."""
        self.epoch = epoch
        self.inherited.clear()
        for link in links:
            self.greet(link)

    def stand_by(self) -> None:
        """This Edge no longer leads: it stamps nothing (it admits nothing either)."""
        self.epoch = None

    def greet(self, link: Announced) -> None:
        """Announce the term to one connection (a v3 one, while leading): at a win, or at its registration."""
        if self.epoch is not None and link.protocol >= FENCED_PROTOCOL:
            link.send_frame(encode(Leader(self.epoch)))

    def stamp(self, protocol: int) -> int | None:
        """The epoch for a run on a connection of ``protocol`` (None below v3 or while not leading)."""
        return self.epoch if protocol >= FENCED_PROTOCOL else None

    def answered(self, node_id: str, message: InFlight) -> None:
        """A node's ``in_flight``: the load the previous term left on it (a stale answer is dropped)."""
        if message.epoch != self.epoch:
            return
        self.inherited[node_id] = dict(message.runs)
        if message.runs:
            logger.info("node %s has runs of the previous term in flight: %s", node_id, dict(message.runs))

    def refused(self, node_id: str) -> None:
        """A node refused one of this Edge's runs as ``stale_epoch``: another Edge leads at a newer epoch."""
        self.stale_refused += 1
        logger.warning("node %s refused a run of epoch %s: a newer leader exists", node_id, self.epoch)

    @property
    def inherited_runs(self) -> int:
        """Runs in flight on the nodes at this term's start, as they reported."""
        return sum(sum(runs.values()) for runs in self.inherited.values())
