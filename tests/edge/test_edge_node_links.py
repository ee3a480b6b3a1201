"""The Edge's node socket over real WebSockets: registration, close, heartbeat timeout, generations.

[disconnect-exclusion] [disconnect-queue-resolution] [offline-snapshot]
[cross-model-tests]: fake nodes written with ``trio_websocket`` drive every
connection event exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from edge.harness import (
    BIG,
    FAST,
    TOKEN_A,
    EdgeLayout,
    chat_response,
    eventually,
    fake_node,
    running_edge,
    start_chat,
)
from iop_edge.api.relay import first_message as _first_message
from iop_edge.nodes.connection import NodeSocket
from iop_edge.nodes.peer_watch import PeerWatch
from iop_edge.nodes.runs import RUN_BUFFER, NodeGone, RunChannel
from iop_wire import Rejected, Run, RunData, RunEnd, TunnelChunk, TunnelStart


def _offline(entry: dict[str, object]) -> bool:
    return (entry["connected"], entry["status"], entry["health"]) == (False, "unavailable", "offline")


@pytest.mark.req("disconnect-exclusion", "disconnect-queue-resolution", "offline-snapshot")
async def test_graceful_close_answers_waiters_at_once(tmp_path: Path) -> None:
    """[disconnect-exclusion] [disconnect-queue-resolution] [offline-snapshot] close 1001 from the
    node: the running request gets 502, the waiter with no other candidate 503 unavailable at once
    (long before queue_timeout), /status shows the provider offline."""
    layout = EdgeLayout(queue_timeout_ms=600_000)
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge:
            results: dict[str, httpx.Response] = {}
            async with fake_node(edge) as node, trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "running", BIG)
                await node.next_run()
                start_chat(nursery, edge, results, "waiter", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                await node.ws.aclose(1001, "node shutting down")
            assert results["waiter"].status_code == 503
            assert results["waiter"].json()["error"] == {
                "message": results["waiter"].json()["error"]["message"],
                "type": "service_unavailable",
                "code": "unavailable",
            }
            assert results["waiter"].headers["x-iop-reject-reason"] == "unavailable"
            assert results["running"].status_code == 502
            status = await edge.status()
            gpu0 = next(p for p in status["providers"] if p["provider_id"] == "gpu0")
            assert _offline(gpu0)
            assert (gpu0["effective_capacity"], gpu0["in_flight"], gpu0["queued"]) == (0, 0, 0)
            node_a = next(n for n in status["nodes"] if n["node_id"] == "node-a")
            assert node_a == {
                "node_id": "node-a",
                "connected": False,
                "generation": 1,
                "last_heartbeat_age": None,
                "active_runs": 0,
            }
            # a new request for a model with no eligible candidate: 503 at once, never queued
            response = await edge.chat(FAST)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "unavailable"
            await edge.assert_drained()


@pytest.mark.req("disconnect-queue-resolution", "cross-model-tests")
async def test_graceful_close_waiter_falls_back_to_gpu1(tmp_path: Path) -> None:
    """[disconnect-queue-resolution] [cross-model-tests] a waiter of ornith:35b falls back to
    node-b/gpu1 when node-a closes, while the ornith-fast waiter is answered unavailable."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge, "node-b", providers=["gpu1"]) as node_b:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "b-busy", BIG)
                async with fake_node(edge) as node_a:
                    start_chat(nursery, edge, results, "a-busy", FAST)
                    a_run = await node_a.next_run()
                    # gpu0 busy: this one runs on gpu1 (lower priority but free) or waits for it
                    b_run = await node_b.next_run()
                    assert {a_run.body["messages"][0]["content"], b_run.body["messages"][0]["content"]} == {
                        "b-busy",
                        "a-busy",
                    }
                    start_chat(nursery, edge, results, "big-waiter", BIG)
                    start_chat(nursery, edge, results, "fast-waiter", FAST)
                    await eventually(lambda: edge.queue_depth == 2)
                    await node_a.ws.aclose(1001, "bye")
                await eventually(lambda: "fast-waiter" in results)
                assert results["fast-waiter"].status_code == 503
                await node_b.answer(b_run)
                fallback = await node_b.next_run()
                assert fallback.body["messages"][0]["content"] == "big-waiter"
                assert fallback.body["model"] == "qwen3:35b-b"
                await node_b.answer(fallback)
            assert results["big-waiter"].status_code == 200
            assert results["big-waiter"].headers["x-iop-provider"] == "node-b/gpu1"
            await edge.assert_drained()


@pytest.mark.req("disconnect-exclusion", "cross-model-tests")
async def test_heartbeat_timeout_drops_silent_node(tmp_path: Path) -> None:
    """[disconnect-exclusion] [cross-model-tests] a node that goes silent (TCP still open) is dropped
    after heartbeat_timeout_ms; a duplicate registration meanwhile is rejected (duplicate,
    retryable) and changes nothing; afterwards the node registers as generation 2."""
    # The silent node must outlive the steps before it goes quiet (a run, a duplicate's refusal):
    # 1.5 s holds them on a loaded machine, where 300 ms once did not.
    layout = EdgeLayout(heartbeat_timeout_ms=1500)
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge:
            results: dict[str, httpx.Response] = {}
            async with fake_node(edge) as silent, trio.open_nursery() as nursery:
                assert silent.registered is not None
                assert silent.registered.heartbeat_interval_ms == 500
                start_chat(nursery, edge, results, "running", BIG)
                await silent.next_run()
                async with fake_node(edge, register=False) as duplicate:
                    answer = await duplicate.register(TOKEN_A, ["gpu0"])
                    assert answer == Rejected("duplicate", answer.reason, True)
                assert edge.service.admission.generation("node-a") == 1
                assert edge.provider("node-a", "gpu0")["connected"] is True
                assert edge.provider("node-a", "gpu0")["in_flight"] == 1
                # say nothing: the Edge drops the node by itself
                await eventually(lambda: "running" in results)
                assert edge.provider("node-a", "gpu0")["connected"] is False
            assert results["running"].status_code == 502
            assert results["running"].json()["error"]["code"] == "node_disconnected"
            async with fake_node(edge) as again:
                assert again.registered is not None
                assert again.registered.generation == 2
                status = await edge.status()
                gpu0 = next(p for p in status["providers"] if p["provider_id"] == "gpu0")
                assert (gpu0["connected"], gpu0["status"], gpu0["health"], gpu0["generation"]) == (
                    True,
                    "available",
                    "online",
                    2,
                )
            await edge.assert_drained()


@pytest.mark.req("disconnect-exclusion")
async def test_heartbeats_keep_a_node_alive(tmp_path: Path) -> None:
    """[disconnect-exclusion] any message counts as liveness: heartbeats every 100 ms keep the node."""
    layout = EdgeLayout(heartbeat_timeout_ms=300)
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge) as node:
            for seq in range(8):  # 0.8 s, well past the timeout
                await node.heartbeat(seq)
                await trio.sleep(0.1)
            assert edge.service.admission.is_connected("node-a")
            assert edge.service.admission.generation("node-a") == 1


@pytest.mark.req("disconnect-exclusion", "offline-snapshot")
async def test_stale_close_and_reconnect(tmp_path: Path) -> None:
    """[disconnect-exclusion] [offline-snapshot] reconnect restores the same provider identity with a
    new generation; a late disconnect of the old generation (stale) changes nothing."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            async with fake_node(edge) as first:
                assert first.registered is not None and first.registered.generation == 1
            await eventually(lambda: not edge.service.admission.is_connected("node-a"))
            assert edge.provider("node-a", "gpu0")["status"] == "unavailable"
            async with fake_node(edge) as second:
                assert second.registered is not None and second.registered.generation == 2
                before = edge.service.admission.snapshot()
                # the old generation's close arriving late is ignored
                assert edge.service.admission.disconnect("node-a", 1) is False
                assert edge.service.admission.snapshot() == before
                results: dict[str, httpx.Response] = {}
                async with trio.open_nursery() as nursery:
                    start_chat(nursery, edge, results, "after", FAST)
                    run = await second.next_run()
                    await second.answer(run)
                assert results["after"].status_code == 200
                gpu0 = edge.provider("node-a", "gpu0")
                assert (gpu0["status"], gpu0["generation"], gpu0["node_id"], gpu0["provider_id"]) == (
                    "available",
                    2,
                    "node-a",
                    "gpu0",
                )
            await edge.assert_drained()


@pytest.mark.req("disconnect-exclusion")
async def test_rejected_duplicate_close_changes_nothing(tmp_path: Path) -> None:
    """[disconnect-exclusion] the close of a rejected duplicate leaves the owner's run and generation."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as owner:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "owner-run", FAST)
                run = await owner.next_run()
                for close in ("graceful", "drop"):
                    async with fake_node(edge, register=False) as dup:
                        answer = await dup.register(TOKEN_A, ["gpu0"])
                        assert isinstance(answer, Rejected) and answer.code == "duplicate" and answer.retryable
                        if close == "drop":
                            await dup.drop()
                assert edge.service.admission.generation("node-a") == 1
                assert edge.provider("node-a", "gpu0")["in_flight"] == 1
                await owner.answer(run)
            assert results["owner-run"].status_code == 200
            await edge.assert_drained()


@pytest.mark.req("disconnect-exclusion")
async def test_bad_and_missing_token_rejected_without_state_change(tmp_path: Path) -> None:
    """[disconnect-exclusion] wrong or empty token: rejected bad_token (not retryable); generation
    stays 0, the provider stays offline; an unknown node is rejected unknown_node."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            for token in ("wrong-token", ""):
                async with fake_node(edge, register=False) as node:
                    answer = await node.register(token, ["gpu0"])
                    assert isinstance(answer, Rejected)
                    assert (answer.code, answer.retryable) == ("bad_token", False)
                    assert TOKEN_A not in answer.reason
            async with fake_node(edge, "node-z", register=False) as stranger:
                answer = await stranger.register(TOKEN_A, ["gpu0"])
                assert isinstance(answer, Rejected) and answer.code == "unknown_node"
            assert edge.service.admission.generation("node-a") == 0
            assert _offline(edge.provider("node-a", "gpu0"))


@pytest.mark.req("disconnect-exclusion")
async def test_oversize_ws_message_closes_that_node_only(tmp_path: Path) -> None:
    """[disconnect-exclusion] a frame over max_ws_message_bytes from one node closes that connection
    only; the other node keeps serving."""
    layout = EdgeLayout(max_ws_message_bytes=4096)
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge, "node-b", providers=["gpu1"]) as node_b:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                async with fake_node(edge) as node_a:
                    start_chat(nursery, edge, results, "on-a", FAST)
                    run_a = await node_a.next_run()
                    await node_a.send_json(run_a.run_id, chat_response("z" * 10_000))
                    await eventually(lambda: "on-a" in results)
                assert results["on-a"].status_code == 502
                assert not edge.service.admission.is_connected("node-a")
                assert edge.service.admission.is_connected("node-b")
                start_chat(nursery, edge, results, "on-b", BIG)
                run_b = await node_b.next_run()
                await node_b.answer(run_b)
            assert results["on-b"].status_code == 200
            assert results["on-b"].headers["x-iop-provider"] == "node-b/gpu1"
            await edge.assert_drained()


@pytest.mark.req("lease-lifecycle", "cross-model-tests")
async def test_saturated_event_subscriber_changes_nothing(tmp_path: Path) -> None:
    """[lease-lifecycle] [cross-model-tests] a subscriber with buffer 1 that is never read: requests,
    a disconnect and a reconnect all behave the same; events are only counted as dropped."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, edge.service.admission.subscribe(buffer=1):
            results: dict[str, httpx.Response] = {}
            async with fake_node(edge) as node, trio.open_nursery() as nursery:
                for name, model in (("one", BIG), ("two", FAST), ("three", BIG)):
                    start_chat(nursery, edge, results, name, model)
                for _ in range(3):
                    run = await node.next_run()
                    await node.answer(run)
            assert {r.status_code for r in results.values()} == {200}
            await eventually(lambda: not edge.service.admission.is_connected("node-a"))
            async with fake_node(edge) as again:
                assert again.registered is not None and again.registered.generation == 2
            assert edge.service.admission.snapshot().events_dropped > 0
            await edge.assert_drained()


async def test_run_channel_sink_takes_data_only_until_another_message_comes() -> None:
    """A sink attached to a run takes its data records as they arrive; a message it cannot take
    (here a ``tunnel_chunk``) detaches it, so records after that message queue behind it, in order."""
    channel = RunChannel("r1", None)  # type: ignore[arg-type]  # the link is used only when leaving
    written: list[bytes] = []

    def sink(data: bytes) -> bool:
        written.append(data)
        return True

    assert channel.attach(sink)
    event = TunnelChunk("r1", "Mg==")
    for message in (RunData("r1", 0, b"1"), event, RunData("r1", 1, b"3"), RunEnd("r1", "ok")):
        assert channel.deliver(message)
    assert written == [b"1"]
    assert [await channel.next() for _ in range(3)] == [event, RunData("r1", 1, b"3"), RunEnd("r1", "ok")]


async def test_run_channel_sink_attaches_only_over_an_empty_buffer() -> None:
    """Attaching over buffered messages would let newer data overtake them: refused."""
    channel = RunChannel("r1", None)  # type: ignore[arg-type]
    assert channel.deliver(RunData("r1", 0, b"1"))
    assert not channel.attach(lambda data: True)
    assert await channel.next() == RunData("r1", 0, b"1")
    assert channel.attach(lambda data: True)


async def test_run_channel_parks_its_relay_until_a_message_and_keeps_order_past_a_cancelled_wait() -> None:
    """The relay parked in ``next`` wakes for the next message; a cancelled wait takes nothing, so a
    message delivered afterwards is the next one read; a full buffer overflows the run, and once the
    connection ends ``next`` gives what is buffered, then raises :class:`NodeGone`."""
    channel = RunChannel("r1", None)  # type: ignore[arg-type]
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            got: list[object] = []

            async def relay() -> None:
                got.append(await channel.next())

            nursery.start_soon(relay)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            assert channel.deliver(RunData("r1", 0, b"a"))
        assert got == [RunData("r1", 0, b"a")]
        with trio.move_on_after(0):
            await channel.next()
        assert channel.deliver(RunData("r1", 1, b"b"))
        assert await channel.next() == RunData("r1", 1, b"b")
        for seq in range(RUN_BUFFER):
            assert channel.deliver(RunData("r1", seq, b"x"))
        assert not channel.deliver(RunData("r1", RUN_BUFFER, b"x"))
        assert channel.overflowed
        assert len(channel.buffered()) == RUN_BUFFER
        with pytest.raises(NodeGone, match="client too slow"):
            await channel.next()
    gone = RunChannel("r2", None)  # type: ignore[arg-type]
    assert gone.deliver(RunData("r2", 0, b"a"))
    gone.close()
    assert not gone.deliver(RunData("r2", 1, b"b"))
    assert await gone.next() == RunData("r2", 0, b"a")
    with pytest.raises(NodeGone, match="connection lost"):
        await gone.next()


async def test_a_whole_answer_buffered_at_its_end_is_written_by_the_reader() -> None:
    """A non-stream run whose data records are all still buffered when its ``ok`` end arrives is
    answered by the node link's reader (the writer gets the joined records, once); the relay still
    reads every message. Not when the relay took a record already, nor on an error end, nor for a
    first message that is not a data record; a writer that declines or fails leaves the answer to the relay."""
    written: list[bytes] = []

    def writer(body: bytes) -> bool:
        written.append(body)
        return True

    def failing(body: bytes) -> bool:
        raise RuntimeError("boom")

    whole = RunChannel("r1", None)  # type: ignore[arg-type]
    whole.answer_whole(writer)
    messages = [RunData("r1", 0, b"{"), RunData("r1", 1, b"}"), RunEnd("r1", "ok")]
    for message in messages:
        assert whole.deliver(message)
    assert written == [b"{}"] and whole.answered
    assert [await whole.next() for _ in range(3)] == messages

    taken = RunChannel("r2", None)  # type: ignore[arg-type]
    taken.answer_whole(writer)
    assert taken.deliver(RunData("r2", 0, b"{"))
    assert await taken.next() == RunData("r2", 0, b"{")
    assert taken.deliver(RunData("r2", 1, b"}")) and taken.deliver(RunEnd("r2", "ok"))
    assert not taken.answered

    for run_id, first, end, given in (
        ("r3", RunData("r3", 0, b"{}"), RunEnd("r3", "error", code="upstream_error"), writer),
        ("r4", TunnelStart("r4", 200, ()), RunEnd("r4", "ok"), writer),
        ("r5", RunData("r5", 0, b"{}"), RunEnd("r5", "ok"), lambda body: False),
        ("r6", RunData("r6", 0, b"{}"), RunEnd("r6", "ok"), failing),
    ):
        channel = RunChannel(run_id, None)  # type: ignore[arg-type]
        channel.answer_whole(given)
        assert channel.deliver(first) and channel.deliver(end)
        assert not channel.answered
        assert channel.buffered() == [first, end]
    assert written == [b"{}"]


async def test_frames_queued_in_one_round_reach_the_node_in_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run opened while the link's writer is idle leaves at once, written by the task that
    opens it; the runs opened behind it in the same scheduling round leave in ONE write (the
    writer's), in order, each frame intact; a run opened alone afterwards is written at once again."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            assert node.registered is not None
            link = edge.service.registry.link("node-a", node.registered.generation)
            assert isinstance(link.ws, NodeSocket) and isinstance(link.ws.stream, PeerWatch)
            plain = link.ws.stream.stream
            assert isinstance(plain, trio.SocketStream)
            fd = plain.socket.fileno()
            writes: list[int] = []
            real_write = os.write

            def counting_write(target: int, data: bytes | memoryview) -> int:
                if target == fd:
                    writes.append(len(data))
                return real_write(target, data)

            await trio.testing.wait_all_tasks_blocked()  # the writer is idle (it has seen to `registered`)
            monkeypatch.setattr(os, "write", counting_write)
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            runs = [Run(f"t{i}", "gpu0", "chat/completions", body, False) for i in range(3)]
            channels = [link.open_run(run) for run in runs]  # no checkpoint between them
            assert len(writes) == 1  # t0, before any checkpoint
            assert [(await node.next_run()).run_id for _ in runs] == ["t0", "t1", "t2"]
            assert len(writes) == 2
            channels.append(link.open_run(Run("t3", "gpu0", "chat/completions", body, False)))
            assert len(writes) == 3
            assert (await node.next_run()).run_id == "t3"
            monkeypatch.undo()
            for channel in channels:
                link.forget_run(channel.run_id)


@pytest.mark.req("first-token-timeout")
async def test_an_answer_arriving_as_the_first_token_timeout_ends_the_wait_counts_as_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """[first-token-timeout] The whole answer and its end arrive in the scheduling round whose
    deadline ended the relay's wait: the node link's reader wrote it to the client already, so the
    relay takes the answer (no ``first_token_timeout`` failure reported for a provider that answered)."""
    run = RunChannel("r1", None)  # type: ignore[arg-type]  # the link is used only when leaving
    written: list[bytes] = []
    run.answer_whole(lambda body: written.append(body) is None)
    relay_task: list[trio.lowlevel.Task] = []
    steps = 0

    class ArrivesWithTheDeadline(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            nonlocal steps
            if relay_task and task is relay_task[0]:
                steps += 1
                if steps == 1:  # woken by the deadline, not yet run: the answer comes now
                    assert run.deliver(RunData("r1", 0, b"{}")) and run.deliver(RunEnd("r1", "ok"))

    got: list[object] = []

    async def relay() -> None:
        relay_task.append(trio.lowlevel.current_task())
        got.append(await _first_message(run, 1.0))

    trio.lowlevel.add_instrument(ArrivesWithTheDeadline())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay)
    assert written == [b"{}"] and run.answered
    assert got == [RunData("r1", 0, b"{}")]
    assert run.buffered() == [RunEnd("r1", "ok")]
    assert trio.current_time() == pytest.approx(1.0)
