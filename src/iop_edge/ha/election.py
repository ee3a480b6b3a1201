"""The election task: campaign on etcd, renew while leading, step down on time.

The trio layer over :class:`~iop_edge.ha.leadership.Leadership` (which decides)
and :class:`~iop_edge.ha.etcd.EtcdGateway` (which talks). One lease per Edge,
kept alive while it stands by as while it leads, so that winning costs one
transaction: the campaign is "create the election key under my lease if it
does not exist" (etcd's ``create_revision == 0`` compare), and the revision
that creates the key is the term's epoch. A standby retries every
``poll_interval`` seconds; the key disappears when its leader's lease expires
(etcd looks for expired leases every 500 ms) or is revoked, so a failover takes
at most the TTL, plus half a second, plus one poll.

Leading: renew every ``ttl / 3`` (each renewal etcd answered is logged at DEBUG, the
evidence the whole-system check reads; nothing at INFO: a line every third of the TTL
for as long as an Edge leads is noise, and its cost is HA's steady cost); stop leading when :meth:`Leadership.must_step_down`
says so (``margin`` before the lease can expire in etcd, counted from the last
renewal *sent*), when etcd says the lease is gone, or on shutdown (then the
lease is revoked, so a successor wins without waiting out the TTL). A leader
that stepped down cut off from etcd revokes its lease as soon as etcd answers
again, before anything else (a restarted etcd extends its leases).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from iop_edge.ha.etcd import EtcdUnavailable, KeyHolder
from iop_edge.ha.leadership import Leadership

log = logging.getLogger("iop_edge.ha")

RETRY_S = 0.2
"""How long the task waits before calling etcd again after a failed call."""
COMPLAIN_EVERY_S = 30.0
"""The same etcd error (etcd down, a wrong password) is logged again at most this often."""
REVOKE_BOUND_S = 1.0
"""How long a step-down waits for etcd to revoke its lease (best effort)."""


class ElectionStore(Protocol):
    """The calls the election makes: :class:`~iop_edge.ha.etcd.EtcdGateway` on etcd, or a stand-in.

    Each checkpoints and raises :class:`~iop_edge.ha.etcd.EtcdUnavailable` when the store does not
    answer. The seeded simulation (``tests/sim/_ha.py``) passes an in-memory one to
    :meth:`iop_edge.ha.EdgeHa.campaign`.
    """

    async def grant(self, ttl: int) -> int: ...

    async def keepalive(self, lease: int) -> int: ...

    async def revoke(self, lease: int) -> None:
        """Revoke ``lease``; one the store no longer has (expired, revoked) is no error."""
        ...

    async def create(self, key: str, value: str, lease: int) -> tuple[bool, KeyHolder | None]: ...


async def run_election(
    gateway: ElectionStore,
    leadership: Leadership,
    key: str,
    *,
    poll_interval: float,
    on_change: Callable[[Leadership], None] = lambda _: None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Campaign for ``key`` until cancelled; ``on_change`` runs at each win and step-down.

    Started with ``nursery.start``: started once the first campaign has been
    answered (this Edge leads or knows it stands by) or has failed once.
    Cancelling it steps down (``on_change`` runs) and revokes the lease under a
    shielded, bounded scope.
    """
    campaign = _Campaign(gateway, leadership, key)
    started = False
    try:
        while True:
            answered = await campaign.try_once()
            if not started:
                started = True
                task_status.started()
            if not answered:
                await trio.sleep(RETRY_S)
            elif leadership.leading:
                log.info("leading at epoch %d", leadership.epoch)
                on_change(leadership)
                campaign.abandoned = await _lead(gateway, leadership, campaign.lease, leadership.ttl / 3)
                campaign.lease = None
                leadership.stepped_down()
                log.warning("stepped down (epoch %d)", leadership.epoch)
                on_change(leadership)
            else:
                await trio.sleep(poll_interval)
    finally:
        if leadership.leading:
            leadership.stepped_down()
            on_change(leadership)
        await campaign.revoke()


@attrs.define(eq=False)
class _Campaign:
    """A standby's lease and its attempts at the election key."""

    gateway: ElectionStore
    leadership: Leadership
    key: str
    lease: int | None = None
    abandoned: int | None = None
    """The lease of a term that ended cut off from etcd, not revoked yet: its key holds the election
    until etcd expires it, and etcd restarted extends every lease (by its election timeout), so it is
    revoked before anything else once etcd answers again, and a successor wins at the next poll."""
    last_sent: float = 0.0
    """When the last successful grant or keepalive of :attr:`lease` was sent."""
    last_error: str | None = None
    """The last etcd error logged (None once etcd answered again), and when."""
    logged_at: float = 0.0

    async def try_once(self) -> bool:
        """Keep the lease alive and try to create the key; False when etcd did not answer.

        Checkpoints. On a win, :attr:`leadership` leads, its lease counted from :attr:`last_sent`.
        """
        try:
            if self.abandoned is not None:
                await self.gateway.revoke(self.abandoned)
                self.abandoned = None
            if self.lease is None:
                self.last_sent = trio.current_time()
                self.lease = await self.gateway.grant(max(1, math.ceil(self.leadership.ttl)))
            elif trio.current_time() - self.last_sent >= self.leadership.ttl / 3:
                sent = trio.current_time()
                if await self.gateway.keepalive(self.lease) == 0:
                    self.lease = None
                    return await self.try_once()
                self.last_sent = sent
            won, holder = await self.gateway.create(self.key, self.leadership.name, self.lease)
        except EtcdUnavailable as error:
            self._complain(str(error))
            return False
        self.last_error = None
        if won and holder is not None:
            self.leadership.won(holder.create_revision, self.last_sent)
        else:
            self.leadership.saw_leader(holder.value if holder else None, holder.create_revision if holder else 0)
        return True

    def _complain(self, error: str) -> None:
        """Log an etcd error: a new one at once, the same one again every :data:`COMPLAIN_EVERY_S`."""
        now = trio.current_time()
        if error != self.last_error or now - self.logged_at >= COMPLAIN_EVERY_S:
            log.warning("etcd: %s", error)
            self.last_error, self.logged_at = error, now

    async def revoke(self) -> None:
        """Revoke the leases, if any, shielded and bounded (shutdown: a successor need not wait the TTL)."""
        with trio.CancelScope(shield=True), trio.move_on_after(REVOKE_BOUND_S):
            for lease in (self.abandoned, self.lease):
                if lease is not None:
                    try:
                        await self.gateway.revoke(lease)
                    except EtcdUnavailable:
                        pass


async def _lead(gateway: ElectionStore, leadership: Leadership, lease: int | None, renew_every: float) -> int | None:
    """Renew ``lease`` until this Edge must stop leading; returns the lease still to revoke, if any.

    Checkpoints; the renewals are cut at the leader's own deadline, so a call
    hanging on a partitioned etcd never keeps it leading. Past the deadline it
    returns at once (the step-down does not wait for etcd): the caller revokes
    the lease when etcd next answers.
    """
    assert lease is not None  # a leader won with a lease
    while not leadership.must_step_down(trio.current_time()):
        next_renew = trio.current_time() + renew_every
        with trio.move_on_at(leadership.deadline()):
            sent = trio.current_time()
            try:
                granted = await gateway.keepalive(lease)
            except EtcdUnavailable as error:
                log.warning("etcd renewal failed: %s", error)
                next_renew = trio.current_time() + RETRY_S
            else:
                if granted == 0:
                    return None  # the lease expired in etcd: the key is gone with it
                leadership.renewed(sent, granted)
                log.debug("renewed the lease of epoch %d for %d s", leadership.epoch, granted)
        await trio.sleep_until(min(next_renew, leadership.deadline()))
    return lease  # cut off from etcd for too long: revoked as soon as etcd answers, so a successor need not wait
