"""The node's epoch fence [epoch-fencing]: the highest leader epoch seen, across every Edge connection.

Edges of an HA group (docs/ha.md) put their leader's epoch on each run (docs/wire.md,
Epoch fencing). The node keeps one fence for all its connections, in its
:class:`~iop_node.NodeRuntime`: a run of an older epoch than one already seen
comes from an Edge that no longer leads (paused, or cut off from etcd) and is
refused with ``stale_epoch`` before it takes a permit. So is a run without an
epoch once one has been seen: the node serves an HA group, and an Edge of it
sends no epoch only when it cannot vouch for its term.

Beside it, per connection, what a new leader is told of the runs held elsewhere
(:class:`RunsElsewhere`), told again at the end of any run of the node (:class:`RunEnds`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import NoReturn, final

import attrs
import trio

from iop_admission import LocalGate
from iop_node._errors import StaleEpoch
from iop_wire import InFlight, Leader

logger = logging.getLogger("iop_node")


@final
@attrs.define
class EpochFence:
    """The highest epoch seen, and how many runs it refused.

    Attributes:
        seen: the highest epoch seen in a ``leader`` message or a run (0: none yet).
        refused: runs and tunnel requests refused as ``stale_epoch`` so far.
    """

    seen: int = 0
    refused: int = 0

    def check(self, epoch: int | None) -> None:
        """Let a run of ``epoch`` through (raising the fence to it), or refuse it. Does not checkpoint.

        Raises:
            StaleEpoch: ``epoch`` is older than the fence, or None once the fence has seen one.
        """
        if not self.admits(epoch):
            what = "run without an epoch" if epoch is None else f"run of epoch {epoch}"
            logger.warning("%s refused: this node has seen epoch %d", what, self.seen)
            raise StaleEpoch(f"{what}; this node has seen epoch {self.seen}")

    def admits(self, epoch: int | None) -> bool:
        """Whether a run of ``epoch`` may run; raises the fence to it when it may.

        A run without an epoch (an Edge without ``ha:``) runs
        while the fence has seen none; once it has, the node serves an HA group and
        an epoch-less run is refused like a stale one (an Edge of the group that
        cannot vouch for its term, never a leader). Does not checkpoint.
        """
        if epoch is None:
            if self.seen:
                self.refused += 1
                return False
            return True
        if epoch < self.seen:
            self.refused += 1
            return False
        self.seen = epoch
        return True

    def raise_to(self, epoch: int) -> None:
        """A leader announced ``epoch``: the fence never goes down."""
        self.seen = max(self.seen, epoch)


@final
@attrs.define(eq=False)
class RunEnds:
    """The end of any run of the node, across its Edge connections: what the ``in_flight``
    reports (:class:`RunsElsewhere`) wait for between two reports."""

    _ended: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)
    _waiting: int = attrs.field(default=0, init=False, repr=False)

    def ended(self) -> None:
        """A run of any connection gave its permit back: wake the reports waiting.

        Every run's end calls it: without a report waiting it only reads a counter.
        """
        if self._waiting:
            self._ended.set()
            self._ended = trio.Event()

    async def wait(self) -> None:
        """Until the next :meth:`ended`."""
        self._waiting += 1
        try:
            await self._ended.wait()
        finally:
            self._waiting -= 1


@final
@attrs.define(eq=False)
class RunsElsewhere:
    """One Edge connection's ``in_flight`` reports [epoch-fencing] [held-elsewhere].

    A new leader's ``leader`` is answered with the runs holding a permit of
    the node's one gate per provider that this connection did not send (the
    previous leader's, a warm-up's): the leader counts them against the
    provider's capacity, and the long ones among them (a ``run`` marked
    ``long``) against its long-context slots. While any is left,
    each change is reported again, at the end of any run of the node (or at
    the latest every heartbeat interval), so the count goes down as they end
    and the last report is empty.

    Attributes:
        fence: the node's fence (raised by ``leader``).
        ends: the end of any run of the node (each change is reported then).
        gate: the node's one gate.
        long_in_use: the node's long runs in flight per provider, every connection's.
        own: this connection's permits, per provider.
        own_long: this connection's long runs, per provider.
        epoch: the epoch of the last ``leader`` on this connection (None: none yet).
        reported: the report last sent.
    """

    fence: EpochFence
    ends: RunEnds
    gate: LocalGate
    long_in_use: Counter[str] = attrs.field(factory=Counter)
    own: Counter[str] = attrs.field(factory=Counter)
    own_long: Counter[str] = attrs.field(factory=Counter)
    epoch: int | None = None
    reported: InFlight | None = None
    _due: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)

    def took(self, provider: str, long: bool = False) -> None:
        """This connection took a permit of ``provider`` (for a long run: ``long``)."""
        self.own[provider] += 1
        if long:
            self.own_long[provider] += 1
            self.long_in_use[provider] += 1

    def gave_back(self, provider: str, long: bool = False) -> None:
        """This connection's run on ``provider`` (a long one: ``long``) gave its permit back."""
        self.own[provider] -= 1
        if long:
            self.own_long[provider] -= 1
            self.long_in_use[provider] -= 1
        self.ends.ended()

    def runs(self) -> tuple[tuple[str, int], ...]:
        """``(provider, permits held)`` not held by this connection, providers with none left out."""
        return _others(self.gate.statistics().in_use, self.own)

    def long_runs(self) -> tuple[tuple[str, int], ...]:
        """``(provider, long runs)`` not of this connection, providers with none left out."""
        return _others(self.long_in_use, self.own_long)

    def _report(self, epoch: int) -> InFlight:
        return InFlight(epoch, self.runs(), self.long_runs())

    def lead(self, leader: Leader) -> InFlight:
        """A new leader on this connection: raise the fence, and the answer to send it."""
        self.fence.raise_to(leader.epoch)
        self.epoch = leader.epoch
        self.reported = self._report(leader.epoch)
        if self.reported.runs:
            self._due.set()
        return self.reported

    async def report(self, send: Callable[[InFlight], Awaitable[None]], interval: float) -> NoReturn:
        """Forever: while runs reported are left, send each change (at a run's end, or every ``interval``)."""
        while True:
            await self._due.wait()
            with trio.move_on_after(interval):
                await self.ends.wait()
            assert self.epoch is not None  # only lead() sets _due, after the epoch
            report = self._report(self.epoch)
            if not report.runs:
                self._due = trio.Event()
            if report != self.reported:
                self.reported = report
                await send(report)


def _others(in_use: Mapping[str, int], own: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """``(name, count)`` of ``in_use`` beyond ``own``, names with nothing beyond left out."""
    return tuple((name, used - own.get(name, 0)) for name, used in in_use.items() if used > own.get(name, 0))
