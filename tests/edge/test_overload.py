"""Overload: the shedding decisions (a pure unit, MockClock), Retry-After from the queue, and a
real-socket flood of fast-retrying clients while ``/healthz`` and an admitted request complete.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import h11
import httpx
import pytest
import trio
import trio.testing

from edge.harness import BIG, FAST, EdgeLayout, eventually, fake_node, running_edge, start_chat
from iop_config import ConfigFileError
from iop_edge.config import load_edge_config
from iop_edge.front_door.overload import (
    PASSING_WINDOW,
    RETURN_GRACE,
    RETURN_GRID,
    FrontDoor,
    LoadShedder,
    OverloadPolicy,
    ReturnSchedule,
    drain_time,
    grid_step,
    watch_loop_lag,
)
from iop_edge.status import OverloadStatus

POLICY = OverloadPolicy(shed_loop_lag=0.1, shed_connections=100, max_connections=200, max_retry_after=30)


@pytest.mark.req("overload-shed")
def test_lag_sheds_only_when_requests_already_wait() -> None:
    """[overload-shed] Lag over the threshold sheds new requests -- but only while the queue
    holds waiters: a request that could run at once is never shed."""
    shedder = LoadShedder(POLICY)
    assert shedder.action(open_connections=1, waiting=5) == "admit"
    shedder.observe_lag(0.25)
    assert shedder.action(open_connections=1, waiting=0) == "admit"
    assert shedder.action(open_connections=1, waiting=1) == "shed"
    assert (shedder.shed_total, shedder.last_reason) == (1, "loop_lag")


@pytest.mark.req("overload-shed")
def test_requests_about_to_be_granted_a_free_slot_do_not_count_as_waiting() -> None:
    """[overload-shed] Requests asking for a lease while slots are free (``waiting``, granted
    within a pass of the loop) are not waiters: under lag, only a queue in admission sheds."""
    door = FrontDoor(POLICY)
    for _ in range(300):
        door.enter()
    door.shedder.observe_lag(0.25)
    assert not door.shed(queue_depth=0)
    assert door.shed(queue_depth=1)
    assert door.shedder.shed_total == 1


@pytest.mark.req("overload-shed")
def test_lag_shedding_has_hysteresis() -> None:
    """[overload-shed] Shedding starts above the lag threshold and ends only under half of it."""
    shedder = LoadShedder(POLICY)
    decisions = []
    for lag in (0.05, 0.11, 0.08, 0.06, 0.049, 0.09):
        shedder.observe_lag(lag)
        decisions.append(shedder.action(open_connections=0, waiting=3))
    assert decisions == ["admit", "shed", "shed", "shed", "admit", "admit"]


@pytest.mark.req("overload-shed")
def test_open_connections_over_the_threshold_shed() -> None:
    """[overload-shed] More open connections than ``shed_connections`` sheds (while requests wait)."""
    shedder = LoadShedder(POLICY)
    assert shedder.action(open_connections=100, waiting=2) == "admit"
    assert shedder.action(open_connections=101, waiting=2) == "shed"
    assert shedder.action(open_connections=101, waiting=0) == "admit"
    assert shedder.last_reason == "connections"


def test_drain_time_follows_the_queue() -> None:
    """The queue ahead drains in (waiting + 1) x service time / capacity; no capacity: never."""
    assert drain_time(0, 0.1, 8) == pytest.approx(0.0125)
    assert drain_time(63, 1.0, 8) == pytest.approx(8.0)  # 64 x 1 s over 8 slots
    assert drain_time(5, 1.0, 0) == math.inf
    shedder = LoadShedder(POLICY, initial_service_time=1.0)
    for _ in range(200):
        shedder.observe_service(3.0)
    assert shedder.service_time == pytest.approx(3.0, abs=0.01)


@pytest.mark.req("overload-admitted-first")
def test_return_times_are_spread_by_the_refusal_rate() -> None:
    """[overload-admitted-first] Each refusal books a return time 1 / rate after the one before,
    never before the queue can drain, never past the ceiling; once booked times have passed,
    the drain time is the floor again."""
    schedule = ReturnSchedule(rate=100, ceiling=30)
    delays = [schedule.book(now=10.0, drain=0.5) for _ in range(500)]
    assert delays[0] == pytest.approx(0.5)
    assert delays[1] - delays[0] == pytest.approx(0.01)
    assert delays[-1] == pytest.approx(0.5 + 499 * 0.01)  # 500 returns spread over 5 s
    assert schedule.book(now=20.0, drain=0.5) == pytest.approx(0.5)  # the queue is the floor again
    assert schedule.book(now=20.0, drain=0.0) == pytest.approx(0.51)  # after the last booked one
    capped = ReturnSchedule(rate=1, ceiling=3)
    assert [capped.book(now=0.0, drain=0.0) for _ in range(5)] == pytest.approx([0.0, 1.0, 2.0, 3.0, 3.0])


@pytest.mark.req("overload-admitted-first")
def test_refusal_gives_a_retry_after_no_shorter_than_the_pause() -> None:
    """[overload-admitted-first] A refusal's Retry-After is the booked delay or the drain time,
    whichever is longer, rounded up (at least 1 s, at most the ceiling); the connection is left
    unread until the first multiple of ``RETURN_GRID`` after the booked delay rounded up to whole
    seconds plus ``RETURN_GRACE`` (a client that honours Retry-After has sent its request by
    then), and waits for a long drain time only up to 1 s (a client retrying after a second is
    held only as the refusal rate requires). With 1,000 clients refused at once at 1,000/s they
    are told 1 s; with 5,000, up to 5 s."""
    door = FrontDoor(attrs.evolve(POLICY, refusal_rate=1000))
    door.waiting = 63
    door.shedder.service_time = 0.1  # drain: 64 x 0.1 s / 8 slots = 0.8 s
    now = 5.003
    answers = [door.refusal(now=now, capacity=8) for _ in range(5000)]
    assert answers[0] == (1, pytest.approx(6.02 - now))  # 5.003 + 1 + 0.01, up to the grid: 6.02
    for retry, pause in answers:
        assert retry + RETURN_GRACE <= pause < retry + RETURN_GRACE + RETURN_GRID
        assert (now + pause) / RETURN_GRID == pytest.approx(round((now + pause) / RETURN_GRID))
    assert max(retry for retry, _ in answers[:200]) == 1
    assert answers[-1][0] == 6  # booked 0.8 + 4.999 s
    door.shedder.service_time = 0.5  # drain: 64 x 0.5 s / 8 = 4 s
    retry, pause = door.refusal(now=100.0, capacity=8)
    assert (retry, pause) == (4, pytest.approx(1.02))  # told the drain time, held about 1 s
    door.waiting = 0
    assert door.refusal(now=200.0, capacity=0) == (30, pytest.approx(1.02))  # no capacity: the ceiling


def test_a_visit_gives_back_each_count_exactly_once() -> None:
    """A request counts as waiting until its first grant, then as running until it leaves;
    retries, a refusal after the grant and a second leave change nothing."""
    door = FrontDoor(POLICY)
    refused, served = door.enter(), door.enter()
    assert (door.waiting, door.running) == (2, 0)
    served.grant()
    served.grant()  # a retry's grant
    assert (door.waiting, door.running) == (1, 1)
    refused.stop_asking()
    served.stop_asking()
    assert (door.waiting, door.running) == (0, 1)
    for visit in (refused, served, served):
        visit.leave()
    assert (door.waiting, door.running) == (0, 0)


@pytest.mark.req("overload-cheap-reject")
def test_queue_full_counts_requests_already_asking_against_the_free_slots() -> None:
    """[overload-cheap-reject] A new request is refused before its body while the queue is full
    and the requests already asking fill it and every free slot -- also in the moment after a
    lease ended, when the slot is granted but the granted request's task has not run yet."""
    door = FrontDoor(POLICY)
    door.running, door.waiting = 8, 64
    assert door.queue_full(max_queue=64, capacity=8, queue_depth=64, now=0.0)
    assert not door.queue_full(max_queue=64, capacity=8, queue_depth=63, now=0.0)  # room in the queue
    door.running = 7  # a lease ended; its slot went to a waiter still counted as waiting
    assert not door.queue_full(max_queue=64, capacity=8, queue_depth=64, now=0.0)
    door.waiting = 65  # ... and one more is asking: the queue and the free slot are spoken for
    assert door.queue_full(max_queue=64, capacity=8, queue_depth=64, now=0.0)
    door.running, door.waiting = 0, 64  # every slot free: the newcomer may run at once
    assert not door.queue_full(max_queue=64, capacity=8, queue_depth=64, now=0.0)


@pytest.mark.req("overload-cheap-reject")
def test_requests_let_through_on_their_heads_count_until_they_ask() -> None:
    """[overload-cheap-reject] A request let through on its head counts against the queue and the
    free slots until it asks for a lease: of the connections decided on in one pass after a lease
    ended, one is let through, the others refused on their heads. The count lapses after
    PASSING_WINDOW (a request let through that never asks holds no place for longer)."""
    door = FrontDoor(POLICY)
    door.running, door.waiting = 7, 64  # a lease ended; its slot went to a waiter not yet running
    now = 100.0
    assert not door.queue_full(max_queue=64, capacity=8, queue_depth=63, now=now)
    door.let_through(now)
    assert door.queue_full(max_queue=64, capacity=8, queue_depth=63, now=now)
    assert door.queue_full(max_queue=64, capacity=8, queue_depth=63, now=now + PASSING_WINDOW)
    door.enter()  # it asks: counted as waiting, no longer as passing
    assert (door.waiting, door.passing) == (65, 0)
    assert door.queue_full(max_queue=64, capacity=8, queue_depth=64, now=now)
    door.waiting = 64
    door.let_through(now)  # let through, and never asks (a 404, say)
    assert door.queue_full(max_queue=64, capacity=8, queue_depth=63, now=now)
    assert not door.queue_full(max_queue=64, capacity=8, queue_depth=63, now=now + PASSING_WINDOW * 1.5)
    door.let_through(now + PASSING_WINDOW * 1.5)  # a new window: the lapsed count is dropped
    assert door.passing == 1
    door.gave_up()  # it ended before asking (a bad body): no longer passing
    assert door.passing == 0
    door.gave_up()  # never below nothing
    assert door.passing == 0


@pytest.mark.req("overload-shed")
async def test_loop_lag_is_sampled_from_a_late_timer(autojump_clock: trio.testing.MockClock) -> None:
    """[overload-shed] The sampler reads lag as how late its timer fired (MockClock: a jump of
    0.3 s while it sleeps until the first step of the 20 ms grid 0.05 s on is a lag of 0.3 s less
    that sleep); the next on-time sample ends shedding."""
    shedder = LoadShedder(POLICY)
    start = trio.current_time()
    due = grid_step(start + 0.05)
    assert 0.05 <= due - start < 0.05 + RETURN_GRID
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_loop_lag, shedder, 0.05)
        await trio.testing.wait_all_tasks_blocked()
        autojump_clock.jump(0.3)
        await trio.testing.wait_all_tasks_blocked()
        assert shedder.loop_lag == pytest.approx(start + 0.3 - due)
        assert shedder.lag_shedding
        await trio.sleep(0.05 + RETURN_GRID)  # autojump: the next timer fires on time
        await trio.testing.wait_all_tasks_blocked()
        assert shedder.loop_lag == pytest.approx(0.0)
        assert not shedder.lag_shedding
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- real sockets


CHAT = json.dumps({"model": FAST, "messages": [{"role": "user", "content": "flood"}]}).encode()


async def _exchange(stream: trio.SocketStream, conn: h11.Connection, request: h11.Request, body: bytes) -> int:
    """One request/response over a kept-alive connection (h11, client side); returns the status."""
    data = conn.send(request) + (conn.send(h11.Data(data=body)) if body else b"") + conn.send(h11.EndOfMessage())
    await stream.send_all(data)
    status = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some())
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status


async def _client(port: int, requests: int, statuses: dict[int, int]) -> None:
    """A fast-retrying client: ``requests`` chats on one connection, 10 ms after each refusal."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    head = [(b"host", b"edge"), (b"content-type", b"application/json"), (b"content-length", b"%d" % len(CHAT))]
    async with stream:
        for _ in range(requests):
            request = h11.Request(method="POST", target="/v1/chat/completions", headers=head)
            status = await _exchange(stream, conn, request, CHAT)
            statuses[status] = statuses.get(status, 0) + 1
            await trio.sleep(0.01)


@pytest.mark.req("overload-shed", "overload-ops", "overload-admitted-first")
async def test_flood_is_shed_while_healthz_and_an_admitted_request_complete(tmp_path: Path) -> None:
    """[overload-shed] [overload-ops] [overload-admitted-first] 40 clients retrying every 10 ms
    while one request holds the only slot: the flood gets 503 overloaded (Retry-After) and 429s,
    and each refused connection is left unread until its client's return time (paced: at most
    ``max_retry_after_s``, here 1 s); /healthz /status /metrics answer on the same listener, the
    admitted request completes with 200 and is never cut; afterwards every counter is back to 0
    (no connection paused) and every connection closed."""
    layout = EdgeLayout(max_queue=2, queue_timeout_ms=300, shed_connections=0, max_retry_after_s=1)
    with trio.fail_after(60):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge) as node:
            door = edge.service.front_door
            async with trio.open_nursery() as nursery:
                admitted: dict[str, int] = {}

                async def admitted_request() -> None:
                    admitted["status"] = (await edge.chat(FAST, "admitted")).status_code

                nursery.start_soon(admitted_request)
                held = await node.next_run()
                statuses: dict[int, int] = {}
                async with trio.open_nursery() as flood:
                    for _ in range(40):
                        flood.start_soon(_client, edge.http_port, 4, statuses)
                    await eventually(lambda: door.shedder.shed_total > 0 and door.connections.paused > 0)
                    # A second client of its own, closed afterwards: only the admitted request's stays open.
                    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge.http_port}") as probe:
                        for path in ("/healthz", "/status", "/metrics"):
                            assert (await probe.get(path)).status_code == 200
                        shed = await probe.post("/v1/chat/completions", content=CHAT)
                assert edge.provider("node-a", "gpu0")["in_flight"] == 1  # capacity 1, never exceeded
                await node.answer(held, "admitted ok")
            assert admitted["status"] == 200
            assert statuses.get(503, 0) > 0 and set(statuses) <= {429, 503}, statuses
            metrics = (await edge.http.get("/metrics")).text
            overload = (await edge.status())["overload"]
            await edge.assert_drained()
            await eventually(lambda: door.connections.open == 1 and door.waiting == 0)
            assert door.connections.paused == 0
    assert shed.status_code in (429, 503)
    if shed.status_code == 503:
        assert shed.json()["error"]["code"] == "overloaded"
        assert 1 <= int(shed.headers["retry-after"]) <= 30
    assert 'iop_rejected_total{model="",reason="overloaded"}' in metrics
    assert "iop_http_connections_open" in metrics and "iop_loop_lag_seconds" in metrics
    assert overload["shed_requests"] == statuses[503] + (shed.status_code == 503)


def test_overload_keys_are_checked(tmp_path: Path) -> None:
    """``overload`` thresholds are validated like every limit (file:line: key: rule)."""
    path = tmp_path / "edge.yaml"
    path.write_text(EdgeLayout(shed_connections=9000, shed_loop_lag_ms=0).yaml())
    with pytest.raises(ConfigFileError) as caught:
        load_edge_config(path)
    errors = "\n".join(caught.value.errors)
    assert "overload.shed_connections: must be <= overload.max_connections (8192)" in errors
    assert "overload.shed_loop_lag_ms" in errors


@pytest.mark.req("overload-cheap-reject")
async def test_full_queue_with_every_slot_taken_is_refused_before_the_body(tmp_path: Path) -> None:
    """[overload-cheap-reject] With every configured slot leased and the queue full, a new request
    is answered 429 queue_full (Retry-After) before its body is read: a client that asked for
    ``100 Continue`` never gets it. Afterwards every counter drains."""
    with trio.fail_after(20):
        async with (
            running_edge(tmp_path, EdgeLayout(max_queue=1)) as edge,
            fake_node(edge, "node-a") as node_a,
            fake_node(edge, "node-b") as node_b,
            trio.open_nursery() as nursery,
        ):
            results: dict[str, httpx.Response] = {}
            start_chat(nursery, edge, results, "a", BIG)
            run_a = await node_a.next_run()
            start_chat(nursery, edge, results, "b", BIG)
            run_b = await node_b.next_run()
            start_chat(nursery, edge, results, "queued", FAST)
            await eventually(lambda: edge.queue_depth == 1)
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nexpect: 100-continue\r\n\r\n" % len(CHAT)
                )
                answer = b""
                while b"\r\n\r\n" not in answer or b"}}" not in answer:
                    answer += await stream.receive_some()
            assert answer.startswith(b"HTTP/1.1 429 "), answer
            assert b"retry-after: " in answer and b'"code":"queue_full"' in answer
            assert b"HTTP/1.1 100" not in answer
            for node, run in ((node_a, run_a), (node_b, run_b)):
                await node.answer(run)
            await node_a.answer(await node_a.next_run())  # the queued request, granted on gpu0
        assert {name: r.status_code for name, r in results.items()} == {"a": 200, "b": 200, "queued": 200}
        await edge.assert_drained()


@pytest.mark.req("overload-shed")
def test_status_reports_every_figure_of_the_front_door() -> None:
    """[overload-shed] ``/status``'s ``overload`` part: each figure from its own source, lag and
    service time in ms to 0.1; ``shedding`` while lag sheds or while the open connections are
    over ``shed_connections`` (not at it)."""
    door = FrontDoor(POLICY)
    door.shedder.observe_lag(0.01234)
    door.shedder.service_time = 0.25678
    door.shedder.shed_total = 4
    door.connections.open, door.connections.refused, door.connections.paused = 100, 2, 3
    door.enter()
    assert door.status() == OverloadStatus(
        shedding=False,
        loop_lag_ms=12.3,
        open_connections=100,
        refused_connections=2,
        shed_requests=4,
        waiting=1,
        service_time_ms=256.8,
        paused_connections=3,
    )
    door.connections.open = 101
    assert door.status().shedding
    door.connections.open = 1
    door.shedder.observe_lag(0.25)
    assert door.status().shedding


def test_reprs_show_the_state_in_ms() -> None:
    """The shedder's and the schedule's reprs (logs): state, lag and spacing in ms."""
    shedder = LoadShedder(POLICY)
    shedder.observe_lag(0.0125)
    assert repr(shedder) == "<LoadShedder admitting, lag 12.5 ms, 0 shed>"
    shedder.observe_lag(0.25)
    assert repr(shedder) == "<LoadShedder shedding, lag 250.0 ms, 0 shed>"
    schedule = ReturnSchedule(rate=500.0, ceiling=30.0)
    schedule.book(now=1.0, drain=0.0)
    assert repr(schedule) == "<ReturnSchedule every 2 ms, last 1.000>"


@pytest.mark.req("overload-shed")
def test_lag_thresholds_are_strict() -> None:
    """[overload-shed] A lag exactly at the threshold does not start shedding; exactly at half of
    it does not end it (both bounds strict); shedding ends as a plain False."""
    shedder = LoadShedder(POLICY)  # shed_loop_lag 0.1
    shedder.observe_lag(0.1)
    assert shedder.lag_shedding is False
    shedder.observe_lag(0.11)
    shedder.observe_lag(0.05)
    assert shedder.lag_shedding is True
    shedder.observe_lag(0.049)
    assert shedder.lag_shedding is False


def test_service_time_moves_a_tenth_of_the_way_to_each_duration() -> None:
    """The service time is a moving average with weight 0.1, short durations included."""
    shedder = LoadShedder(POLICY, initial_service_time=1.0)
    shedder.observe_service(0.5)
    assert shedder.service_time == pytest.approx(0.95)
    shedder.observe_service(-1.0)  # a negative duration counts as 0
    assert shedder.service_time == pytest.approx(0.855)


@pytest.mark.req("overload-cheap-reject")
def test_passing_counts_each_request_let_through_in_its_window() -> None:
    """[overload-cheap-reject] Requests let through in one window add up, up to its last
    instant included; a request that asks when none is passing leaves the count at 0."""
    door = FrontDoor(POLICY)
    door.enter()
    assert door.passing == 0
    door.let_through(1.0)
    door.let_through(1.0)
    door.let_through(door.passing_until)  # the window's last instant
    assert door.passing == 3


def test_a_visit_ends_with_plain_false_flags() -> None:
    """A visit's flags are booleans from start to end (``granted`` False, not merely falsy)."""
    door = FrontDoor(POLICY)
    visit = door.enter()
    assert visit.granted is False
    visit.grant()
    assert (visit.asking, visit.granted) == (False, True)
    assert visit.asking is False
    visit.leave()
    assert visit.granted is False
