"""Cancellation reaches the backend ([cancel-upstream]): an in-process Edge, a real Node (``openai``
adapter) and a :class:`~iop_mock.MockBackend` that counts the requests it was let go of, all on
loopback sockets.

The backend holds ``gpu0``'s one slot: ``latency`` 60 s is a request that never produces a byte,
a slow ``tokens_per_second`` a stream under way. Every test waits for what the backend counts,
never for time to pass; how fast the backend is let go is measured in ``benchmarks/deadline.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
import trio

from edge.harness import BIG, FAST, Edge, eventually, node_config, real_node, running_edge, sse_events, start_chat
from iop_mock import MockBackend, serve_mock_backend
from iop_node import ProviderConfig

pytestmark = pytest.mark.req("cancel-upstream", "deadline")


@asynccontextmanager
async def _stack(tmp_path: Path, backend: MockBackend) -> AsyncIterator[Edge]:
    """An Edge and a Node whose ``gpu0`` (capacity 1) is ``backend``, served on loopback."""
    async with trio.open_nursery() as outer:
        port = await outer.start(serve_mock_backend, backend)
        async with running_edge(tmp_path) as edge:
            gpu0 = ProviderConfig(id="gpu0", adapter="openai", capacity=1, base_url=f"http://127.0.0.1:{port}/v1")
            async with real_node(edge, node_config(edge, "node-a", [gpu0])):
                yield edge
        outer.cancel_scope.cancel()


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_client_gone_lets_go_of_the_backend_before_the_next_request_runs(tmp_path: Path, stream: bool) -> None:
    """[cancel-upstream] a client that hangs up while the backend works on its request (no byte yet):
    the Node closes the backend request (the backend counts it aborted), and the request queued
    behind it reaches the backend only after that: the backend never sees two at once."""
    backend = MockBackend(latency=60.0)
    with trio.fail_after(20):
        async with _stack(tmp_path, backend) as edge:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as waiter:
                async with trio.open_nursery() as client:
                    start_chat(client, edge, {}, "hangs up", BIG, stream=stream)
                    await eventually(lambda: backend.stats()["in_flight"] == 1)
                    start_chat(waiter, edge, results, "next", FAST, max_tokens=1)
                    await eventually(lambda: edge.queue_depth == 1)
                    backend.latency = 0.0  # the next request is answered at once
                    client.cancel_scope.cancel()
            assert results["next"].status_code == 200, results["next"].text
            assert backend.stats() == {"in_flight": 0, "peak_in_flight": 1, "total": 2, "aborted": 1}
            await edge.assert_drained()


async def test_client_gone_mid_stream_lets_go_of_the_backend(tmp_path: Path) -> None:
    """[cancel-upstream] a client that hangs up after its first tokens: the backend stops generating."""
    backend = MockBackend(latency=0.0, tokens_per_second=20)
    with trio.fail_after(20):
        async with _stack(tmp_path, backend) as edge:
            body = json.dumps(_chat(FAST, stream=True)).encode()
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
            async with await trio.open_tcp_stream("127.0.0.1", edge.http_port) as client:
                await client.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
                received = b""
                while b"data: " not in received:
                    chunk = await client.receive_some()
                    assert chunk, received
                    received += chunk
                assert backend.stats()["aborted"] == 0
            await eventually(lambda: backend.stats()["aborted"] == 1)
            assert backend.stats()["in_flight"] == 0
            await edge.assert_drained()


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_deadline_lets_go_of_the_backend(tmp_path: Path, stream: bool) -> None:
    """[cancel-upstream] [deadline] the request's deadline passes while the backend has sent nothing:
    504 deadline_exceeded at the deadline, and the backend is let go of (the Edge does not wait for
    that to answer)."""
    backend = MockBackend(latency=60.0)
    with trio.fail_after(20):
        async with _stack(tmp_path, backend) as edge:
            response = await edge.http.post(
                "/v1/chat/completions", json=_chat(BIG, stream=stream), headers={"X-Request-Timeout": "0.5"}
            )
            assert response.status_code == 504, response.text
            assert response.headers["x-iop-error-class"] == "deadline_exceeded"
            await eventually(lambda: backend.stats()["aborted"] == 1)
            assert backend.stats() == {"in_flight": 0, "peak_in_flight": 1, "total": 1, "aborted": 1}
            await edge.assert_drained()


async def test_deadline_mid_stream_lets_go_of_the_backend(tmp_path: Path) -> None:
    """[cancel-upstream] [deadline] a stream still generating at its deadline: the client gets what came
    and a final deadline_exceeded event; the backend stops generating."""
    backend = MockBackend(latency=0.0, tokens_per_second=10)
    with trio.fail_after(20):
        async with _stack(tmp_path, backend) as edge:
            response = await edge.http.post(
                "/v1/chat/completions", json=_chat(FAST, stream=True), headers={"X-Request-Timeout": "0.5"}
            )
            events = sse_events(response.text)
            assert response.status_code == 200
            assert "choices" in events[0]
            assert events[-1]["error"]["code"] == "deadline_exceeded"
            await eventually(lambda: backend.stats()["aborted"] == 1)
            assert backend.stats() == {"in_flight": 0, "peak_in_flight": 1, "total": 1, "aborted": 1}
            await edge.assert_drained()


def _chat(model: str, *, stream: bool) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": stream}


async def test_openai_client_timeout_lets_go_of_the_backend(tmp_path: Path) -> None:
    """[cancel-upstream] [deadline] the official openai client with ``timeout=``: a backend that answers
    in time is relayed; one that does not is let go of once the client gave up (its read timeout is
    the request's deadline at the Edge too: whichever ends it first, the backend stops)."""
    backend = MockBackend(latency=60.0)
    with trio.fail_after(20):
        async with _stack(tmp_path, backend) as edge:
            base_url = f"http://127.0.0.1:{edge.http_port}/v1"
            async with openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=0.5) as client:
                # The client's timer and the Edge's deadline run out together: the client gives up,
                # or (its loop late on a busy machine) reads the Edge's 504 first.
                with pytest.raises((openai.APITimeoutError, openai.InternalServerError)):
                    await client.chat.completions.create(
                        model=BIG, messages=[{"role": "user", "content": "x"}], max_tokens=5
                    )
                await eventually(lambda: backend.stats()["aborted"] == 1)
                backend.latency = 0.0
                served = await client.chat.completions.create(
                    model=BIG, messages=[{"role": "user", "content": "x"}], max_tokens=5
                )
            assert served.choices[0].message.content
            assert backend.stats() == {"in_flight": 0, "peak_in_flight": 1, "total": 2, "aborted": 1}
            failures = (await edge.status())["failures"][BIG]
            assert sum(failures.values()) == 1 and set(failures) <= {"cancelled", "deadline_exceeded"}
            await edge.assert_drained()


async def test_a_healthy_stream_outlives_the_openai_read_timeout(tmp_path: Path) -> None:
    """[deadline] a stream whose only deadline is the openai client's read timeout (0.5 s, its first
    byte's bound) keeps going while tokens come (5 tokens at 5 a second): no timer cuts it."""
    backend = MockBackend(latency=0.0, tokens_per_second=5)
    with trio.fail_after(20):
        async with _stack(tmp_path, backend) as edge:
            started = trio.current_time()
            body = {**_chat(FAST, stream=True), "max_tokens": 5}
            response = await edge.http.post(
                "/v1/chat/completions", json=body, headers={"X-Stainless-Read-Timeout": "0.5"}
            )
            took = trio.current_time() - started
            events = sse_events(response.text)
            assert response.status_code == 200
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            assert took > 0.5  # it ran past the read timeout, whole
            assert backend.stats() == {"in_flight": 0, "peak_in_flight": 1, "total": 1, "aborted": 0}
            await edge.assert_drained()
