"""[epoch-fencing] [ha-step-down] The Edge's stamp: every run of an HA Edge carries its term's epoch,
and none leaves an Edge that cannot prove it leads -- not at a grant, not at a retry, not from its
node link's outbox -- and its completions are refused ``not_leader`` on their head (sans-I/O, on a
mock clock)."""

from __future__ import annotations

import json
import math
import types
from typing import Any

import pytest
import trio
import trio.testing

from iop_edge.api.attempts import retry_hook
from iop_edge.api.not_leader import not_leader_on_head
from iop_edge.api.rejections import RequestRejected
from iop_edge.config import HaConfig
from iop_edge.ha import EdgeHa
from iop_edge.ha.fencing import LeaderFence, NotLeading
from iop_edge.nodes.link import _withhold_runs
from iop_edge.nodes.runs import RunChannel
from iop_wire import RunEnd

pytestmark = pytest.mark.req("epoch-fencing", "ha-step-down")


class Link:
    """A node connection as the fence sees it: the frames it was given."""

    def __init__(self) -> None:
        self.node_id = "node-a"
        self.frames: list[str] = []

    def send_frame(self, frame: str) -> None:
        self.frames.append(frame)


def test_without_ha_runs_go_unstamped_and_are_never_refused() -> None:
    fence = LeaderFence()
    assert fence.stamp() is None


def test_an_ha_edge_stamps_its_terms_epoch_and_sends_nothing_without_a_term() -> None:
    leads = [True]
    fence = LeaderFence(leads=lambda: leads[0])
    with pytest.raises(NotLeading):
        fence.stamp()  # never led: no epoch to stamp, nothing sent
    link = Link()
    fence.lead(7, [link])
    assert link.frames == ['{"type":"leader","epoch":7}']
    assert fence.stamp() == 7
    leads[0] = False  # the leader's count of its lease ran out; its election task has not run yet
    with pytest.raises(NotLeading):
        fence.stamp()
    leads[0] = True
    fence.stand_by()
    with pytest.raises(NotLeading):
        fence.stamp()  # stepped down: never an epoch-less run instead


def ha() -> EdgeHa:
    """An Edge's part in the election (TTL 2 s, margin a third of it), not campaigning."""
    return EdgeHa.of(HaConfig(endpoints=("http://127.0.0.1:1",), advertise="edge-a", ttl_s=2))


def test_a_leader_woken_past_its_deadline_stamps_nothing_before_its_election_task_runs() -> None:
    async def main() -> None:
        edge = ha()
        fence = LeaderFence(leads=edge.admits)
        edge.leadership.won(epoch=11, renewal_sent_at=trio.current_time())
        fence.lead(11, [])
        assert fence.stamp() == 11
        await trio.sleep(1.3)  # within TTL - margin of the last renewal sent
        assert fence.stamp() == 11
        await trio.sleep(0.1)  # SIGSTOP and SIGCONT look like this to the process: time jumped
        assert edge.leadership.leading  # its election task has not stepped down yet
        with pytest.raises(NotLeading):
            fence.stamp()
        assert edge.refusal_headers() == [("retry-after", "2")]  # it does not know its successor: no x-iop-leader

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_refusal_names_the_leader_only_when_it_is_another_edge() -> None:
    edge = ha()
    edge.leadership.saw_leader("edge-b", 4)
    assert edge.other_leader() == "edge-b"
    assert ("x-iop-leader", "edge-b") in edge.refusal_headers()
    edge.leadership.won(epoch=9, renewal_sent_at=0.0)
    assert edge.other_leader() is None


async def test_a_run_frame_left_in_the_outbox_is_withheld_when_the_edge_can_no_longer_prove_it_leads() -> None:
    """Stamped as its run opened, queued behind a busy writer, then the process paused past its deadline:
    when the writer takes it, it is dropped and its run ends ``stale_epoch`` here (503 not_leader)."""
    link: Any = None  # the channel touches its link only when its relay leaves it
    waited, sent_at_once = RunChannel("r1", link), RunChannel("r2", link)
    runs = {"r1": waited, "r2": sent_at_once}
    frames = ['{"type":"leader","epoch":7}', '{"type":"run","run_id":"r1"}', ""]  # "": r2's, sent without waiting
    unsent = {id(frames[1]): "r1"}
    assert _withhold_runs(frames, dict(unsent), dict(runs), may_send=True) == frames  # a leader sends all
    assert _withhold_runs(frames, unsent, runs, may_send=False) == [frames[0], ""]
    assert unsent == {} and runs == {"r2": sent_at_once}
    end = await waited.next()
    assert isinstance(end, RunEnd) and (end.code, end.failure) == ("stale_epoch", "stale_leader")


def test_a_leader_woken_past_its_deadline_refuses_completions_on_their_head_not_leader() -> None:
    """Not ``503 overloaded`` (a pause's backlog trips the shedder): the leader is what is gone."""

    async def main() -> None:
        edge = ha()
        edge.leadership.won(epoch=11, renewal_sent_at=trio.current_time())
        assert not_leader_on_head(edge, b"POST", b"/v1/chat/completions") is None  # it leads
        await trio.sleep(1.4)  # past TTL - margin: paused, its election task has not run
        refused = not_leader_on_head(edge, b"POST", b"/v1/chat/completions")
        assert refused is not None
        response, read_after = refused
        assert response.status == 503 and json.loads(response.body)["error"]["code"] == "not_leader"
        assert (b"retry-after", b"2") in response.headers and read_after == -math.inf  # go elsewhere now
        assert not any(name == b"x-iop-leader" for name, _ in response.headers)  # its successor is unknown
        assert not_leader_on_head(edge, b"GET", b"/readyz") is None  # /readyz answers for itself
        assert not_leader_on_head(None, b"POST", b"/v1/chat/completions") is None  # no ha:

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_leader_woken_past_its_deadline_asks_for_no_retry_and_answers_503() -> None:
    """Its node dropped a run during the pause: the retry is not asked for (no dispatch anywhere)."""

    class Metrics:
        def __init__(self) -> None:
            self.retries: list[str] = []

        def retried(self, model: str, reason: str) -> None:
            self.retries.append(reason)

    async def main() -> None:
        edge = ha()
        service: Any = types.SimpleNamespace(metrics=Metrics(), ha=edge)
        responder: Any = types.SimpleNamespace(run_sent=False)
        on_retry = retry_hook(service.metrics, service.ha, "m", responder)
        failed: Any = types.SimpleNamespace(provider="node-a/gpu0", attempt=1)
        edge.leadership.won(epoch=11, renewal_sent_at=trio.current_time())
        on_retry("node_disconnected", failed)  # it leads: the retry goes ahead, counted
        await trio.sleep(1.4)
        with pytest.raises(RequestRejected) as refused:
            on_retry("node_disconnected", failed)
        assert (refused.value.status, refused.value.code, refused.value.retry) == (503, "not_leader", None)
        responder.run_sent = True  # the failed attempt's run had been sent: it may have run
        with pytest.raises(RequestRejected) as refused:
            on_retry("node_disconnected", failed)
        assert (refused.value.status, refused.value.code) == (503, "leader_stepped_down")
        assert service.metrics.retries == ["node_disconnected"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
