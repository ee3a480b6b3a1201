"""The Edge's side of epoch fencing [epoch-fencing] (docs/wire.md, docs/ha.md).

:class:`LeaderFence` holds the epoch this Edge stamps on its runs while it leads,
refuses to stamp (so to send) a run while this Edge cannot prove it leads
[ha-step-down], announces a won term to every node connection with
``leader``, and keeps what the nodes answered
(``in_flight``: the runs the previous leader left running on each node, which
it counts against the providers' capacities until the nodes report them ended
[held-elsewhere]) and how many of this Edge's runs nodes refused as ``stale_epoch``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol, final

import attrs

from iop_admission import ProviderKey
from iop_wire import InFlight, Leader, encode

logger = logging.getLogger("iop_edge.ha")


class NotLeading(Exception):
    """This Edge cannot prove it leads (it stands by, or its own count of its lease ran out): it sends no run."""


class Announced(Protocol):
    """What the fence needs of a node connection (:class:`~iop_edge.nodes.link.NodeLink`)."""

    node_id: str

    def send_frame(self, frame: str) -> None: ...


@final
@attrs.define(eq=False)
class LeaderFence:
    """This Edge's epoch while it leads, and the nodes' answers.

    Attributes:
        epoch: stamped on every run and tunnel request; None
            while this Edge does not lead.
        leads: with ``ha:``, whether this Edge may send a run now
            (:meth:`iop_edge.ha.EdgeHa.admits`: it leads and its count of its lease
            has not run out); asked at every :meth:`stamp`. None: no ``ha:``, runs
            go unstamped.
        inherited: per node, ``{provider: (runs, long runs)}`` it last reported in
            flight that this Edge did not send (the previous term's, on the node's one
            gate).
        stale_refused: this Edge's runs the nodes refused as ``stale_epoch``.
        hold: counts runs held elsewhere against a provider's capacity and the long
            ones against its long slots (``Admission.hold``); None: they are only kept here.
    """

    epoch: int | None = None
    inherited: dict[str, dict[str, tuple[int, int]]] = attrs.field(factory=dict)
    stale_refused: int = 0
    hold: Callable[[ProviderKey, int, int], None] | None = None
    leads: Callable[[], bool] | None = None

    def lead(self, epoch: int, links: Iterable[Announced]) -> None:
        """This Edge won a term at ``epoch``: announce it to every node connection."""
        self.epoch = epoch
        self._forget_all()
        for link in links:
            self.greet(link)

    def stand_by(self) -> None:
        """This Edge no longer leads: it stamps nothing (it admits nothing either)."""
        self.epoch = None
        self._forget_all()

    def greet(self, link: Announced) -> None:
        """Announce the term to one connection (while leading): at a win, or at its registration."""
        if self.epoch is not None:
            link.send_frame(encode(Leader(self.epoch)))

    def stamp(self) -> int | None:
        """The epoch for a run about to be sent.

        [epoch-fencing] [ha-step-down] The last check before a run leaves: with ``ha:``
        every run carries this term's epoch, and none is sent unless this Edge can prove it leads now -- a leader woken
        from a pause past its deadline, whose election task has not run yet, sends
        nothing, with an epoch or without. Does not checkpoint.

        Raises:
            NotLeading: with ``ha:``, this Edge does not lead, or cannot prove it still does.
        """
        if self.leads is None:
            return None
        if not self.may_send():
            raise NotLeading("this Edge does not lead: it sends no run")
        return self.epoch

    def may_send(self) -> bool:
        """Whether a run stamped earlier may leave now: no ``ha:``, or this Edge can prove it leads."""
        return self.leads is None or (self.epoch is not None and self.leads())

    def answered(self, node_id: str, message: InFlight) -> None:
        """A node's ``in_flight``: the load the previous term left on it (a stale answer is dropped)."""
        if message.epoch != self.epoch:
            return
        runs = _counts(message)
        before = self.inherited.pop(node_id, {})
        if runs:
            self.inherited[node_id] = runs
            if not before:
                logger.info("node %s has runs of the previous term in flight (runs, long): %s", node_id, runs)
        if self.hold is not None:
            for provider in before.keys() | runs.keys():
                counts = runs.get(provider, (0, 0))
                if before.get(provider, (0, 0)) != counts:
                    self.hold(ProviderKey(node_id, provider), *counts)

    def forget(self, node_id: str) -> None:
        """The node's connection ended: what it reported goes with it (its generation's holds too)."""
        self.inherited.pop(node_id, None)

    def _forget_all(self) -> None:
        """A new term, or none: the last term's reports count no more."""
        if self.hold is not None:
            for node_id, runs in self.inherited.items():
                for provider in runs:
                    self.hold(ProviderKey(node_id, provider), 0, 0)
        self.inherited.clear()

    def refused(self, node_id: str) -> None:
        """A node refused one of this Edge's runs as ``stale_epoch``: another Edge leads at a newer epoch."""
        self.stale_refused += 1
        logger.warning("node %s refused a run of epoch %s: a newer leader exists", node_id, self.epoch)

    @property
    def inherited_runs(self) -> int:
        """Runs in flight on the nodes at this term's start, as they reported."""
        return sum(runs for counts in self.inherited.values() for runs, _ in counts.values())


def _counts(message: InFlight) -> dict[str, tuple[int, int]]:
    """``{provider: (runs, long runs)}`` of a node's report, each count made sense of: none below 0,
    never more long runs than runs (a node's bad count is not the Edge's error)."""
    long = dict(message.long_runs)
    counts = {}
    for provider, runs in message.runs:
        runs = max(runs, 0)
        if runs:
            counts[provider] = (runs, min(max(long.get(provider, 0), 0), runs))
    return counts
