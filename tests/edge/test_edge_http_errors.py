"""The Edge's HTTP error contract (docs/openai-api.md): every status and code, auth, limits.

[contract-spec-sync] [offline-snapshot] [cross-model-tests]. Each error body is
the OpenAI shape ``{"error": {"message", "type", "code"}}`` with
``x-iop-reject-reason``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.harness import (
    ADMIN_TOKEN,
    BIG,
    FAST,
    TOKEN_A,
    TOKEN_B,
    EdgeLayout,
    chat_chunk,
    eventually,
    fake_node,
    mock_provider,
    node_config,
    real_node,
    running_edge,
    sse_events,
    start_chat,
)
from iop_edge.api import responder as _responder
from iop_edge.api.rejections import RequestRejected
from iop_edge.front_door import overload as _overload
from iop_wire import RunEnd


def assert_error(response: httpx.Response, status: int, code: str, type_: str, reason: str | None = None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "code"}
    assert (body["error"]["code"], body["error"]["type"]) == (code, type_)
    assert body["error"]["message"]
    assert response.headers["x-iop-reject-reason"] == (reason or code)
    assert response.headers["content-type"] == "application/json"


async def test_model_not_found_and_unavailable(tmp_path: Path) -> None:
    """404 model_not_found; 503 unavailable at once when no candidate's node is connected."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            assert_error(await edge.chat("no-such-model"), 404, "model_not_found", "invalid_request_error")
            assert_error(await edge.chat(BIG), 503, "unavailable", "service_unavailable")
            assert_error(await edge.chat(FAST, stream=True), 503, "unavailable", "service_unavailable")
            assert edge.queue_depth == 0


def assert_retry_after(response: httpx.Response) -> None:
    """A ``Retry-After`` in whole seconds within the Edge's bounds. Its value follows the return
    schedule (tests/edge/test_overload.py pins it on a virtual clock); here, on real time, a refusal
    booked just after another may round up to 2 s on a loaded machine."""
    assert 1 <= int(response.headers["retry-after"]) <= _overload.OverloadPolicy().max_retry_after


@pytest.mark.req("queue-ownership")
async def test_queue_full_and_queue_timeout(tmp_path: Path) -> None:
    """[queue-ownership] 429 queue_full (Retry-After) when the Edge-wide queue is full, for either
    key; 429 queue_timeout after queue_timeout_ms."""
    with trio.fail_after(10):
        async with (
            running_edge(tmp_path, EdgeLayout(max_queue=1, queue_timeout_ms=300)) as edge,
            fake_node(edge) as node,
        ):
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "running", BIG)
                running = await node.next_run()
                start_chat(nursery, edge, results, "waiter", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                for model in (BIG, FAST):
                    # connection: close -- a refused keep-alive connection is paced (left unread
                    # until its Retry-After), and the second chat must not wait for that.
                    full = await edge.chat(model, headers={"connection": "close"})
                    assert_error(full, 429, "queue_full", "rate_limit_error")
                    assert_retry_after(full)
                await eventually(lambda: "waiter" in results)
                await node.answer(running)
            assert_error(results["waiter"], 429, "queue_timeout", "rate_limit_error")
            assert_retry_after(results["waiter"])
            await edge.assert_drained()


async def test_provider_busy_when_node_rejects_concurrency(tmp_path: Path) -> None:
    """503 provider_busy: the node answers run_end error concurrency_limit; the lease is released."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "busy", FAST)
                run = await node.next_run()
                await node.send(RunEnd(run.run_id, "error", "concurrency_limit", "gate full"))
            assert_error(results["busy"], 503, "provider_busy", "service_unavailable")
            await edge.assert_drained()


@pytest.mark.parametrize(
    ("code", "upstream_status"),
    [("upstream_error", 500), ("upstream_unreachable", None), ("bad_request", None)],
)
async def test_upstream_errors_from_fake_node(tmp_path: Path, code: str, upstream_status: int | None) -> None:
    """502 upstream_error for every node-side run failure; x-iop-reject-reason carries the wire code."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "x", BIG)
                run = await node.next_run()
                await node.send(RunEnd(run.run_id, "error", code, "boom", upstream_status))
            assert_error(results["x"], 502, "upstream_error", "upstream_error", reason=code)
            if upstream_status is not None:
                assert "500" in results["x"].json()["error"]["message"]
            await edge.assert_drained()


async def test_node_side_cancel_and_missing_response(tmp_path: Path) -> None:
    """502 node_disconnected for a run the node cancelled; 502 upstream_error for an ok run_end
    without a response (non-stream)."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "cancelled", BIG)
                run = await node.next_run()
                await node.send(RunEnd(run.run_id, "cancelled", "cancelled"))
                await eventually(lambda: "cancelled" in results)
                start_chat(nursery, edge, results, "empty", FAST)
                run = await node.next_run()
                await node.send(RunEnd(run.run_id, "ok"))
            assert_error(results["cancelled"], 502, "node_disconnected", "upstream_error")
            assert_error(results["empty"], 502, "upstream_error", "upstream_error")
            await edge.assert_drained()


async def test_mid_stream_error_event(tmp_path: Path) -> None:
    """A run failing after streamed chunks ends the SSE stream with one error event, no [DONE]."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "s", FAST, stream=True)
                run = await node.next_run()
                await node.send_json(run.run_id, chat_chunk("a"))
                await node.send_json(run.run_id, chat_chunk("b"))
                await node.send(RunEnd(run.run_id, "error", "upstream_error", "backend died", 500))
            response = results["s"]
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["x-iop-provider"] == "node-a/gpu0"
            events = sse_events(response.text)
            assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["a", "b"]
            assert events[2]["error"]["code"] == "upstream_error"
            assert events[2]["error"]["type"] == "upstream_error"
            assert len(events) == 3
            await edge.assert_drained()


async def test_upstream_error_from_real_mock_node(tmp_path: Path) -> None:
    """502 upstream_error from a real Node's mock adapter (fail_after_chunks), non-stream and stream."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            config = node_config(edge, "node-a", [mock_provider("gpu0", fail_after_chunks=2)])
            async with real_node(edge, config):
                response = await edge.chat(FAST, max_tokens=4)
                assert_error(response, 502, "upstream_error", "upstream_error")
                streamed = await edge.chat(FAST, max_tokens=4, stream=True)
                events = sse_events(streamed.text)
                assert streamed.status_code == 200
                assert len(events) == 3
                assert events[-1]["error"]["code"] == "upstream_error"
                await edge.assert_drained()


async def test_bad_requests(tmp_path: Path) -> None:
    """400 bad_request (bad JSON, not an object, missing/invalid fields), 405, 404 route, 413."""
    with trio.fail_after(10):
        async with running_edge(tmp_path, EdgeLayout(max_body_bytes=1024)) as edge, fake_node(edge):
            http = edge.http
            bad = [
                ("/v1/chat/completions", b"{not json"),
                ("/v1/chat/completions", b"[1, 2]"),
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}'),
                ("/v1/chat/completions", b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}'),
                ("/v1/chat/completions", b'{"model": "ornith-fast"}'),
                ("/v1/chat/completions", b'{"model": "ornith-fast", "messages": []}'),
                (
                    "/v1/chat/completions",
                    b'{"model": "ornith-fast", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
                ),
                ("/v1/completions", b'{"model": "ornith-fast"}'),
                ("/v1/completions", b'{"model": "ornith-fast", "prompt": 7}'),
            ]
            for path, content in bad:
                response = await http.post(path, content=content, headers={"content-type": "application/json"})
                assert_error(response, 400, "bad_request", "invalid_request_error")
            assert_error(await http.get("/v1/chat/completions"), 405, "method_not_allowed", "invalid_request_error")
            assert_error(await http.post("/v1/models"), 405, "method_not_allowed", "invalid_request_error")
            assert_error(await http.get("/v2/nothing"), 404, "not_found", "invalid_request_error")
            big = {"model": FAST, "messages": [{"role": "user", "content": "x" * 2000}]}
            assert_error(
                await http.post("/v1/chat/completions", json=big), 413, "request_too_large", "invalid_request_error"
            )

            # a chunked body (no content-length) over the limit is refused too
            async def chunks() -> Any:
                for _ in range(4):
                    yield b" " * 400

            assert_error(
                await http.post("/v1/chat/completions", content=chunks()),
                413,
                "request_too_large",
                "invalid_request_error",
            )
            await edge.assert_drained()


@pytest.mark.req("overload-cheap-reject")
async def test_bad_requests_let_through_on_their_heads_do_not_fill_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[overload-cheap-reject] a request let through on its head that ends before it asks for a
    lease (a bad body) stops counting as passing: a burst of them, more than the queue and the
    free slots hold, all get their 400, none a 429 queue_full (the count's window held open here
    for the whole test, so how fast the box is does not matter)."""
    monkeypatch.setattr(_overload, "PASSING_WINDOW", 3600.0)
    with trio.fail_after(10):
        async with running_edge(tmp_path, EdgeLayout(max_queue=2)) as edge, fake_node(edge):
            for _ in range(10):
                response = await edge.http.post(
                    "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
                )
                assert_error(response, 400, "bad_request", "invalid_request_error")
            assert edge.service.front_door.passing == 0
            await edge.assert_drained()


async def test_api_keys(tmp_path: Path) -> None:
    """API keys: without or with a wrong key 401 invalid_api_key (OpenAI shape); the right key 200."""
    layout = EdgeLayout(api_keys=("key-one-sentinel", "key-two-sentinel"))
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge) as node:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "key-one-sentinel"}):
                assert_error(await edge.chat(FAST, headers=headers), 401, "invalid_api_key", "authentication_error")
                assert_error(
                    await edge.http.get("/v1/models", headers=headers), 401, "invalid_api_key", "authentication_error"
                )
            assert edge.queue_depth == 0
            results: dict[str, httpx.Response] = {}

            async def post() -> None:
                results["ok"] = await edge.chat(FAST, headers={"authorization": "Bearer key-two-sentinel"})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post)
                await node.answer(await node.next_run())
            assert results["ok"].status_code == 200
            models = await edge.http.get("/v1/models", headers={"authorization": "Bearer key-one-sentinel"})
            assert models.status_code == 200
            for path in ("/status", "/healthz", "/metrics"):
                text = (await edge.http.get(path)).text
                assert "key-one-sentinel" not in text and "key-two-sentinel" not in text
            await edge.assert_drained()


async def test_a_wrong_api_key_is_refused_on_the_head_before_the_body(tmp_path: Path) -> None:
    """A completion request with a wrong key gets its 401 before it sends its body (the body is never
    asked for, the app never runs: nothing passes the front door, nothing queues); the connection then
    closes, since where the unsent body would end is the client's word only."""
    layout = EdgeLayout(api_keys=("key-one-sentinel",))
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge):
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer wrong\r\n"
                b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
            )
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                await stream.send_all(head)  # and not a byte of the body
                received = b""
                while chunk := await stream.receive_some():
                    received += chunk
            status_line, _, rest = received.partition(b"\r\n")
            assert status_line.startswith(b"HTTP/1.1 401 "), received
            assert b"connection: close" in rest.lower() and b'"invalid_api_key"' in rest
            assert edge.service.front_door.passing == 0 and edge.queue_depth == 0
            await edge.assert_drained()


async def test_status_healthz_metrics_never_show_secrets(tmp_path: Path) -> None:
    """/status, /healthz and /metrics never contain a node token or the admin token."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge), fake_node(edge, "node-b", providers=["gpu1"]):
            status = await edge.http.get("/status")
            assert status.status_code == 200
            body = status.json()
            assert set(body) >= {"queue_depth", "max_queue", "queue_timeout", "events_dropped", "providers", "nodes"}
            assert {n["node_id"] for n in body["nodes"]} == {"node-a", "node-b"}
            assert all(n["connected"] for n in body["nodes"])
            health = await edge.http.get("/healthz")
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            metrics = await edge.http.get("/metrics")
            assert metrics.status_code == 200
            assert metrics.headers["content-type"].startswith("text/plain")
            for response in (status, health, metrics):
                for secret in (TOKEN_A, TOKEN_B, ADMIN_TOKEN):
                    assert secret not in response.text
            assert TOKEN_A not in repr(edge.service.config)


@pytest.mark.req("offline-snapshot")
async def test_models_listed_while_offline(tmp_path: Path) -> None:
    """[offline-snapshot] /v1/models lists every model before any node connects and after a disconnect."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            expected = [BIG, FAST]

            async def listed() -> list[str]:
                response = await edge.http.get("/v1/models")
                assert response.status_code == 200
                body = response.json()
                assert body["object"] == "list"
                assert all(m["object"] == "model" for m in body["data"])
                return [m["id"] for m in body["data"]]

            assert await listed() == expected
            async with fake_node(edge):
                assert await listed() == expected
            await eventually(lambda: not edge.service.admission.is_connected("node-a"))
            assert await listed() == expected
            status = await edge.status()
            assert len(status["providers"]) == 2
            assert all(p["connected"] is False and p["health"] == "offline" for p in status["providers"])


@pytest.mark.req("ha-step-down")
async def test_a_rejection_is_answered_even_when_the_request_is_cancelled_as_it_is_written() -> None:
    """[ha-step-down] A leader stepping down cancels its requests; one whose error answer is being
    written at that moment (a node just refused its run as stale) still gets it, head and body,
    instead of nothing. Found by the seeded simulation's Edge replicas (docs/reliability.md)."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        await trio.lowlevel.checkpoint()  # a server's send may checkpoint
        sent.append(message)

    responder = _responder.Responder(send, {"type": "http"}, None, None)
    with trio.CancelScope() as term:
        term.cancel()  # the step-down, before the answer goes out
        await responder.reject(RequestRejected(503, "not_leader", "this Edge no longer leads"))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 503 and b"not_leader" in sent[1]["body"]
    assert responder.finished
