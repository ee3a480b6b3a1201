"""[ha-step-down] The leader's own count of its lease, on numbers alone."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio
import trio.testing

from iop_edge.ha import Leadership
from iop_edge.ha.election import run_election
from iop_edge.ha.etcd import EtcdGateway

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

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    lead = Leadership("edge-a", ttl=2.0, margin=0.5)
    async with httpx.AsyncClient(transport=httpx.MockTransport(unreachable)) as client:
        gateway = EtcdGateway(client, ["http://etcd:2379"])
        with caplog.at_level(logging.WARNING, logger="iop_edge.ha"), trio.move_on_after(100):
            await run_election(gateway, lead, "/iop/election/x", poll_interval=0.1)
    logged = [r for r in caplog.records if r.getMessage().startswith("etcd: ")]
    assert len(logged) == 4, [r.getMessage() for r in logged]  # at 0, 30, 60 and 90 s
    assert lead.role == "standby" and lead.elections_won == 0
