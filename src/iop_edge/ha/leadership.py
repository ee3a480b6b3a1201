"""Leadership of one Edge among its replicas: who leads, at which epoch, until when.

Sans-I/O, like h11: no clock and no I/O of its own; the election task
(:mod:`iop_edge.ha.election`) passes ``now`` in and acts on the answers. The
rule that fences a leader cut off from etcd is here, where it can be tested on
numbers alone ([ha-step-down]): a leader counts its lease from the moment it
*sent* its last successful renewal (etcd may have started the TTL then), and
stops leading ``margin`` before that count runs out, so it has stopped
admitting before etcd can expire its key and let a successor win.
"""

from __future__ import annotations

import math
from typing import Literal, final

import attrs

Role = Literal["standby", "leader"]


@final
@attrs.frozen
class LeaderInfo:
    """What an Edge knows of the current leader (``/status``'s ``ha`` block)."""

    name: str | None
    """The leader's advertised address, or ``None`` when no one is known to lead."""
    epoch: int
    """The leader's epoch: the revision etcd gave its election key (0 when unknown)."""
    since: float | None
    """When this Edge learned of that term (its wall clock, seconds since the epoch)."""


@final
@attrs.define(eq=False)
class Leadership:
    """This Edge's role, the epoch of its term and the deadline of its lease.

    Args:
        name: this Edge's advertised address.
        ttl: the etcd lease's time to live, seconds.
        margin: how long before the lease can expire in etcd the leader steps down.
    """

    name: str
    ttl: float
    margin: float
    role: Role = "standby"
    epoch: int = 0
    """This Edge's epoch while it leads; the last one it saw a leader hold while it stands by."""
    leader: str | None = None
    _deadline: float = 0.0
    admits_until: float = -math.inf
    """Until when this Edge may admit: its deadline while it leads, ``-inf`` while it stands by. One
    comparison with the clock answers "may it admit now" ([ha-step-down], asked per request)."""
    elections_won: int = 0
    step_downs: int = 0

    def __attrs_post_init__(self) -> None:
        if not 0 < self.margin < self.ttl:
            raise ValueError(f"margin must be in (0, ttl): {self.margin!r} with ttl {self.ttl!r}")

    @property
    def leading(self) -> bool:
        return self.role == "leader"

    def won(self, epoch: int, renewal_sent_at: float) -> None:
        """The campaign's transaction created the key at revision ``epoch``."""
        self.role = "leader"
        self.epoch = epoch
        self.leader = self.name
        self._deadline = self.admits_until = renewal_sent_at + self.ttl - self.margin
        self.elections_won += 1

    def renewed(self, sent_at: float, ttl: float) -> None:
        """A keepalive sent at ``sent_at`` came back alive with ``ttl`` seconds."""
        if self.leading:
            self._deadline = self.admits_until = max(self._deadline, sent_at + ttl - self.margin)

    def must_step_down(self, now: float) -> bool:
        """True when the leader's own count of its lease has run out."""
        return self.leading and now >= self._deadline

    def deadline(self) -> float:
        """When the leader steps down unless it renews (meaningless on a standby)."""
        return self._deadline

    def stepped_down(self) -> None:
        """Stop leading: the caller refuses new work from now on."""
        if self.leading:
            self.step_downs += 1
        self.role = "standby"
        self.leader = None
        self.admits_until = -math.inf

    def saw_leader(self, name: str | None, epoch: int) -> None:
        """A standby read the election key: ``name`` leads at ``epoch`` (``None``: the key is gone)."""
        if not self.leading:
            self.leader = name
            if name is not None:
                self.epoch = max(self.epoch, epoch)
