"""Edge admission over real sockets: shared capacity, fairness, long slots, cancel, send failure.

[cross-model-tests]: ``ornith:35b`` and ``ornith-fast`` share the capacity-1
provider ``node-a/gpu0``. The Edge runs in-process; nodes are fake (exact
control of when a run ends) or real in-process Nodes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.harness import (
    BIG,
    FAST,
    Edge,
    EdgeLayout,
    chat_chunk,
    eventually,
    fake_node,
    mock_provider,
    node_config,
    real_node,
    running_edge,
    sse_events,
)
from iop_mock import MockBackend, serve_mock_backend
from iop_node import ProviderConfig
from iop_wire import Cancel, RunEnd


def _post_into(
    nursery: trio.Nursery, edge: Edge, results: dict[str, httpx.Response], name: str, model: str, **fields: Any
) -> None:
    """Start a chat request whose message content is ``name``; its response lands in ``results[name]``."""

    async def post() -> None:
        results[name] = await edge.chat(model, name, **fields)

    nursery.start_soon(post)


@pytest.mark.req("provider-state", "cross-model-tests")
async def test_two_keys_share_one_dispatch_on_gpu0_fake_node(tmp_path: Path) -> None:
    """[provider-state] [cross-model-tests] both keys at once: the node sees one run, the other waits."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                _post_into(nursery, edge, results, "big", BIG)
                _post_into(nursery, edge, results, "fast", FAST)
                first = await node.next_run()
                await eventually(lambda: edge.queue_depth == 1)
                status = await edge.status()
                assert status["queue_depth"] == 1
                gpu0 = next(p for p in status["providers"] if p["provider_id"] == "gpu0")
                assert (gpu0["in_flight"], gpu0["queued"], gpu0["capacity"]) == (1, 1, 1)
                assert next(n for n in status["nodes"] if n["node_id"] == "node-a")["active_runs"] == 1
                await node.answer(first)
                second = await node.next_run()
                assert {first.body["model"], second.body["model"]} == {"qwen3:35b", "qwen3:35b-fast"}
                await node.answer(second)
            assert results["big"].status_code == results["fast"].status_code == 200
            assert results["big"].headers["x-iop-provider"] == "node-a/gpu0"
            assert results["fast"].headers["x-iop-provider"] == "node-a/gpu0"
            assert all(int(r.headers["x-iop-queue-ms"]) >= 0 for r in results.values())
            await edge.assert_drained()


@pytest.mark.req("provider-state", "capacity-smoke")
async def test_two_keys_real_node_backend_peak_one(tmp_path: Path) -> None:
    """[provider-state] [capacity-smoke] real Node + openai adapter: backend peak concurrency 1."""
    with trio.fail_after(15):
        backend = MockBackend(latency=0.2, tokens_per_second=0.0)
        async with trio.open_nursery() as outer:
            port = await outer.start(serve_mock_backend, backend)
            async with running_edge(tmp_path) as edge:
                gpu0 = ProviderConfig(id="gpu0", adapter="openai", capacity=1, base_url=f"http://127.0.0.1:{port}/v1")
                async with real_node(edge, node_config(edge, "node-a", [gpu0])):
                    results: dict[str, httpx.Response] = {}
                    async with trio.open_nursery() as nursery:
                        _post_into(nursery, edge, results, "big", BIG)
                        _post_into(nursery, edge, results, "fast", FAST, stream=True)
                    assert results["big"].status_code == 200
                    assert results["big"].json()["object"] == "chat.completion"
                    assert results["fast"].status_code == 200
                    assert sse_events(results["fast"].text)[-1] == "[DONE]"
                    assert backend.stats()["peak_in_flight"] == 1
                    assert backend.stats()["total"] == 2
                    await edge.assert_drained()
            outer.cancel_scope.cancel()


@pytest.mark.req("cross-group-wakeup", "cross-model-tests")
async def test_queue_fairness_across_keys(tmp_path: Path) -> None:
    """[cross-group-wakeup] [cross-model-tests] grants follow global arrival order across both keys."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            order = ["w1", "w2", "w3", "w4"]
            async with trio.open_nursery() as nursery:
                _post_into(nursery, edge, results, "w0", BIG)
                running = await node.next_run()
                for i, name in enumerate(order, start=1):
                    _post_into(nursery, edge, results, name, FAST if i % 2 else BIG)
                    await eventually(lambda i=i: edge.queue_depth == i)
                granted = []
                for _ in order:
                    await node.answer(running)
                    running = await node.next_run()
                    granted.append(running.body["messages"][0]["content"])
                await node.answer(running)
            assert granted == order
            assert all(r.status_code == 200 for r in results.values())
            await edge.assert_drained()


@pytest.mark.req("long-state", "cross-group-wakeup")
async def test_long_slots_shared_across_keys(tmp_path: Path) -> None:
    """[long-state] [cross-group-wakeup] long requests of both keys share gpu0's one long slot;
    a normal request behind a blocked long one still runs (no head-of-line blocking)."""
    with trio.fail_after(10):
        async with running_edge(tmp_path, EdgeLayout(gpu0_capacity=2)) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                # long by max_tokens: 0 + 200 > 100
                _post_into(nursery, edge, results, "long-big", BIG, max_tokens=200)
                long_big = await node.next_run()
                _post_into(nursery, edge, results, "long-fast", FAST, max_completion_tokens=101)
                await eventually(lambda: edge.queue_depth == 1)
                gpu0 = edge.provider("node-a", "gpu0")
                assert (gpu0["in_flight"], gpu0["long_in_flight"], gpu0["long_queued"]) == (1, 1, 1)
                # not long: 400 chars // 4 = 100 tokens, not above the threshold
                _post_into(nursery, edge, results, "x" * 400, FAST)
                normal = await node.next_run()
                assert normal.body["messages"][0]["content"] == "x" * 400
                gpu0 = edge.provider("node-a", "gpu0")
                assert (gpu0["in_flight"], gpu0["long_in_flight"], edge.queue_depth) == (2, 1, 1)
                await node.answer(normal)
                await node.answer(long_big)
                long_fast = await node.next_run()
                assert long_fast.body["messages"][0]["content"] == "long-fast"
                assert edge.provider("node-a", "gpu0")["long_in_flight"] == 1
                await node.answer(long_fast)
            assert {r.status_code for r in results.values()} == {200}
            await edge.assert_drained()


@pytest.mark.req("long-state")
async def test_long_classification_by_prompt_chars(tmp_path: Path) -> None:
    """[long-state] classification: prompt chars // 4 + max_tokens above the threshold is long."""
    with trio.fail_after(10):
        async with running_edge(tmp_path, EdgeLayout(gpu0_capacity=2)) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                _post_into(nursery, edge, results, "y" * 404, FAST)  # 101 tokens: long
                first = await node.next_run()
                assert edge.provider("node-a", "gpu0")["long_in_flight"] == 1
                # completions: prompt 4 chars + max_tokens 100 = 101 tokens: long too -> queued
                nursery.start_soon(
                    lambda: edge.http.post("/v1/completions", json={"model": BIG, "prompt": "abcd", "max_tokens": 100})
                )
                await eventually(lambda: edge.queue_depth == 1)
                assert edge.provider("node-a", "gpu0")["long_queued"] == 1
                await node.answer(first)
                second = await node.next_run()
                assert second.endpoint == "completions"
                await node.send_json(second.run_id, {"object": "text_completion", "choices": []})
                await node.send(RunEnd(second.run_id, "ok"))
            await edge.assert_drained()


@pytest.mark.req("lease-lifecycle", "cross-model-tests")
async def test_client_cancel_mid_stream_releases_and_cancels_run(tmp_path: Path) -> None:
    """[lease-lifecycle] [cross-model-tests] a client closing its stream early releases the lease;
    the node gets ``cancel`` for the run, and a queued request of the other key runs next."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                first_lines: list[str] = []
                nursery.start_soon(_stream_first_line_then_leave, edge, first_lines)
                run = await node.next_run()
                assert run.stream is True
                _post_into(nursery, edge, results, "queued", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                await node.send_json(run.run_id, chat_chunk("first"))
                # the client is gone: the node is told to cancel, the waiter gets gpu0
                assert await node.receive() == Cancel(run.run_id)
                queued = await node.next_run()
                assert queued.body["messages"][0]["content"] == "queued"
                await node.answer(queued)
            assert results["queued"].status_code == 200
            assert "first" in first_lines[0]
            await edge.assert_drained()


async def _stream_first_line_then_leave(edge: Edge, first_lines: list[str]) -> None:
    """Open a streaming chat on a raw socket, read up to its first SSE event, then hang up.

    (A raw HTTP/1.1 client: httpx's nested byte iterators cannot be closed
    early without leaving async generators to the garbage collector.)
    """
    body = json.dumps({"model": BIG, "messages": [{"role": "user", "content": "s"}], "stream": True}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
    async with stream:
        await stream.send_all(head + body)
        received = b""
        while b"data: " not in received or b"\n\n" not in received.partition(b"data: ")[2]:
            chunk = await stream.receive_some()
            assert chunk, "the Edge closed the stream early"
            received += chunk
    first_lines.append(received.partition(b"data: ")[2].partition(b"\n\n")[0].decode())


@pytest.mark.req("lease-lifecycle")
async def test_queued_client_leaving_is_removed_from_queue(tmp_path: Path) -> None:
    """[lease-lifecycle] a queued request whose client leaves is removed from the queue at once."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                _post_into(nursery, edge, results, "running", BIG)
                running = await node.next_run()
                with trio.CancelScope() as leaver:
                    nursery.start_soon(_leave_when_queued, edge, leaver)
                    await edge.chat(FAST, "leaver")
                assert leaver.cancelled_caught
                await eventually(lambda: edge.queue_depth == 0)
                assert edge.provider("node-a", "gpu0")["queued"] == 0
                await node.answer(running)
                # the next run the node sees is a new request, never the one that left
                _post_into(nursery, edge, results, "after", FAST)
                after = await node.next_run()
                assert after.body["messages"][0]["content"] == "after"
                await node.answer(after)
            assert results["running"].status_code == results["after"].status_code == 200
            await edge.assert_drained()


async def _leave_when_queued(edge: Edge, scope: trio.CancelScope) -> None:
    await eventually(lambda: edge.queue_depth == 1)
    scope.cancel()


@pytest.mark.req("lease-lifecycle", "disconnect-exclusion")
async def test_node_socket_dies_mid_run(tmp_path: Path) -> None:
    """[lease-lifecycle] [disconnect-exclusion] send failure: the node's socket dies with a run in
    flight -> 502 node_disconnected; the waiter with no other candidate -> 503 at once; counters 0."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                _post_into(nursery, edge, results, "running", BIG)
                await node.next_run()
                _post_into(nursery, edge, results, "queued", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                await node.drop()
            running, queued = results["running"], results["queued"]
            assert running.status_code == 502
            assert running.json()["error"]["code"] == "node_disconnected"
            assert running.headers["x-iop-reject-reason"] == "node_disconnected"
            assert queued.status_code == 503
            assert queued.json()["error"]["code"] == "unavailable"
            await edge.assert_drained()
            assert edge.provider("node-a", "gpu0")["connected"] is False


@pytest.mark.req("lease-lifecycle")
async def test_node_socket_dies_mid_stream(tmp_path: Path) -> None:
    """[lease-lifecycle] a drop after the first streamed chunk ends the SSE stream with an error event."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                _post_into(nursery, edge, results, "s", BIG, stream=True)
                run = await node.next_run()
                await node.send_json(run.run_id, chat_chunk("part"))
                await eventually(lambda: "s" not in results and edge.service.registry.links()[0].active_runs == 1)
                await node.drop()
            response = results["s"]
            assert response.status_code == 200
            events = sse_events(response.text)
            assert events[0]["choices"][0]["delta"]["content"] == "part"
            assert events[-1]["error"]["code"] == "node_disconnected"
            assert "[DONE]" not in events
            await edge.assert_drained()


@pytest.mark.req("cross-group-wakeup")
async def test_real_mock_node_fallback_and_drain(tmp_path: Path) -> None:
    """[cross-group-wakeup] real mock-adapter nodes on gpu0 and gpu1: concurrent requests of both
    keys all succeed; ornith:35b may run on gpu1; counters return to 0."""
    with trio.fail_after(15):
        async with running_edge(tmp_path) as edge:
            a = node_config(edge, "node-a", [mock_provider("gpu0", latency_ms=50, tokens_per_second=200)])
            b = node_config(edge, "node-b", [mock_provider("gpu1", latency_ms=50, tokens_per_second=200)])
            async with real_node(edge, a), real_node(edge, b):
                results: dict[str, httpx.Response] = {}
                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        _post_into(nursery, edge, results, f"big{i}", BIG, max_tokens=4)
                        _post_into(nursery, edge, results, f"fast{i}", FAST, max_tokens=4, stream=True)
                assert {r.status_code for r in results.values()} == {200}
                assert {results[f"fast{i}"].headers["x-iop-provider"] for i in range(3)} == {"node-a/gpu0"}
                assert {results[f"big{i}"].headers["x-iop-provider"] for i in range(3)} <= {
                    "node-a/gpu0",
                    "node-b/gpu1",
                }
                await edge.assert_drained()
