"""[ha-step-down] The leader's own count of its lease, on numbers alone."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import trio
import trio.testing

from iop_edge.ha import Leadership
from iop_edge.ha.election import run_election
from iop_edge.ha.etcd import EtcdGateway, EtcdUnavailable, KeyHolder
from iop_edge.ha.etcd_http import CallFailed, Headers

pytestmark = pytest.mark.req("ha-step-down")


def test_a_leader_steps_down_a_margin_before_its_lease_can_expire() -> None:
    lead = Leadership("edge-a", ttl=2.0, margin=0.5)
    lead.won(epoch=7, renewal_sent_at=10.0)
    assert (lead.role, lead.epoch, lead.leader) == ("leader", 7, "edge-a")
    assert lead.deadline() == 11.5
    assert not lead.must_step_down(11.49)
    assert lead.must_step_down(11.5)


def test_a_renewal_counts_from_when_it_was_sent_and_never_moves_the_deadline_back() -> None:
    lead = Leadership("edge-a", ttl=2.0, margin=0.5)
    lead.won(epoch=3, renewal_sent_at=0.0)
    lead.renewed(sent_at=1.0, ttl=2)
    assert lead.deadline() == 2.5
    lead.renewed(sent_at=0.5, ttl=2)  # an older answer arriving late
    assert lead.deadline() == 2.5


def test_stepping_down_forgets_the_leader_and_counts_once() -> None:
    lead = Leadership("edge-a", ttl=2.0, margin=0.5)
    lead.won(epoch=3, renewal_sent_at=0.0)
    lead.stepped_down()
    lead.stepped_down()
    assert (lead.role, lead.leader, lead.step_downs, lead.elections_won) == ("standby", None, 1, 1)
    assert not lead.must_step_down(100.0)


def test_a_standby_tracks_the_leader_and_the_highest_epoch() -> None:
    lead = Leadership("edge-b", ttl=2.0, margin=0.5)
    lead.saw_leader("edge-a", 9)
    lead.saw_leader(None, 0)
    assert (lead.leader, lead.epoch) == (None, 9)


def test_the_margin_must_lie_inside_the_ttl() -> None:
    with pytest.raises(ValueError, match="margin"):
        Leadership("edge-a", ttl=2.0, margin=2.0)


async def test_the_same_etcd_error_is_logged_once_per_interval_not_per_retry(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd down (or a wrong password) for 100 s: the standby retries every 0.2 s but logs the error
    at once, then again every 30 s, not five times a second."""

    def unreachable(url: str, body: bytes) -> tuple[int, bytes]:
        raise CallFailed("http://etcd:2379: connection refused")

    lead = Leadership("edge-a", ttl=2.0, margin=0.5)
    gateway = EtcdGateway(Answering(unreachable), ["http://etcd:2379"])
    with caplog.at_level(logging.WARNING, logger="iop_edge.ha"), trio.move_on_after(100):
        await run_election(gateway, lead, "/iop/election/x", poll_interval=0.1)
    logged = [r for r in caplog.records if r.getMessage().startswith("etcd: ")]
    assert len(logged) == 4, [r.getMessage() for r in logged]  # at 0, 30, 60 and 90 s
    assert lead.role == "standby" and lead.elections_won == 0


class Store:
    """An in-memory election store whose leases never expire (the worst case: etcd restarted extends
    them); ``down``: every call fails as if etcd did not answer."""

    def __init__(self) -> None:
        self.down = False
        self.leases: set[int] = set()
        self.holder: tuple[KeyHolder, int] | None = None
        self.revision = 0
        self.calls: list[tuple[str, int]] = []

    async def _reach(self, call: str, lease: int = 0) -> None:
        await trio.lowlevel.checkpoint()
        if self.down:
            raise EtcdUnavailable("etcd is down")
        self.calls.append((call, lease))

    async def grant(self, ttl: int) -> int:
        await self._reach("grant")
        self.revision += 1
        self.leases.add(self.revision)
        return self.revision

    async def keepalive(self, lease: int) -> int:
        await self._reach("keepalive", lease)
        return 2 if lease in self.leases else 0

    async def revoke(self, lease: int) -> None:
        await self._reach("revoke", lease)
        self.leases.discard(lease)
        if self.holder is not None and self.holder[1] == lease:
            self.holder = None

    async def create(self, key: str, value: str, lease: int) -> tuple[bool, KeyHolder | None]:
        await self._reach("create", lease)
        if self.holder is None:
            self.revision += 1
            self.holder = (KeyHolder(value, self.revision), lease)
            return True, self.holder[0]
        return False, self.holder[0]


async def test_a_leader_cut_off_from_etcd_revokes_its_lease_first_when_etcd_answers_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """etcd down past the leader's deadline, then back with the old lease alive (a restarted etcd
    extends every lease by its election timeout): the stepped-down leader revokes it before anything
    else, so the key is free at once and the next poll wins, not the lease's TTL later."""
    store = Store()
    lead = Leadership("edge-a", ttl=2.0, margin=0.5)
    with trio.fail_after(60):  # virtual seconds: without the revoke the key is never free
        await _down_then_back(store, lead)
    assert store.calls[0][0] == "revoke"
    assert lead.elections_won == 2


async def _down_then_back(store: Store, lead: Leadership) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: run_election(store, lead, "/iop/election/x", poll_interval=0.1))
        while not lead.leading:
            await trio.sleep(0.01)
        first = store.holder
        assert first is not None
        store.down = True
        while lead.leading:  # steps down by its own count, without waiting for etcd
            await trio.sleep(0.01)
        await trio.sleep(5.0)
        store.calls.clear()
        store.down = False
        while not lead.leading:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert store.calls[0] == ("revoke", first[1])  # the lease of the term that ended cut off
    assert lead.epoch > first[0].create_revision


async def test_revoking_a_lease_etcd_no_longer_has_is_no_error() -> None:
    def answer(url: str, body: bytes) -> tuple[int, bytes]:
        if b'"7"' in body:  # etcd's answer, as its gateway gives it
            return 404, b'{"error":"etcdserver: requested lease not found","code":5}'
        return 500, b"etcdserver: request timed out"

    gateway = EtcdGateway(Answering(answer), ["http://etcd:2379"])
    await gateway.revoke(7)
    with pytest.raises(EtcdUnavailable):
        await gateway.revoke(8)


class Answering:
    """An HTTP client whose every POST ``answer`` answers (or fails)."""

    def __init__(self, answer: Callable[[str, bytes], tuple[int, bytes]]) -> None:
        self.answer = answer

    async def post(self, url: str, body: bytes, headers: Headers = ()) -> tuple[int, bytes]:
        await trio.lowlevel.checkpoint()
        return self.answer(url, body)
