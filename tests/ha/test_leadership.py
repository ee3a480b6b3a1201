"""[ha-step-down] The leader's own count of its lease, on numbers alone."""

from __future__ import annotations

import pytest

from iop_edge.ha import Leadership

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
