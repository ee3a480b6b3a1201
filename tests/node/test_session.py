"""The node against a fake Edge over real sockets, with the mock backend upstream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest
import trio

from iop_node import MockAdapter, ProviderConfig
from iop_wire import (
    PROTOCOL_VERSION,
    PROTOCOL_VERSIONS,
    Cancel,
    Heartbeat,
    ProviderInfo,
    Run,
    RunData,
    RunEnd,
    TunnelEnd,
    TunnelRequest,
    TunnelStart,
)
from node.harness import TOKEN, Backend, FakeEdge, node_config, openai_provider, running_node

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chat_run(run_id: str, provider: str = "gpu0", *, stream: bool = True, max_tokens: int = 3) -> Run:
    return Run(run_id, provider, "chat/completions", {**CHAT, "max_tokens": max_tokens, "stream": stream}, stream)


async def test_register_then_registered(edge: FakeEdge, backend: Backend) -> None:
    """The first message is register with node id, token, protocol and providers."""
    config = node_config(edge.url, openai_provider(backend.port, capacity=2))
    with trio.fail_after(5):
        async with running_node(config) as node:
            conn = await edge.next_connection()
            assert conn.register.node_id == "node-a"
            assert conn.register.token == TOKEN
            assert conn.register.protocol == PROTOCOL_VERSION
            assert conn.register.providers == (ProviderInfo("gpu0", "openai", 2),)
            assert TOKEN not in repr(conn.register)
            while node.client.session is None or node.client.session.registered is None:
                await trio.sleep(0.01)
            assert node.client.session.registered.generation == 1


async def test_heartbeat_uses_the_edge_interval_when_smaller(edge: FakeEdge, backend: Backend) -> None:
    """min(config 60 s, registered 20 ms): heartbeats with seq 1, 2, 3 arrive."""
    edge.heartbeat_interval_ms = 20
    config = node_config(edge.url, openai_provider(backend.port))
    with trio.fail_after(5):
        async with running_node(config):
            conn = await edge.next_connection()
            assert [await conn.receive() for _ in range(3)] == [Heartbeat(1), Heartbeat(2), Heartbeat(3)]


def chunks_of(messages: list[Any]) -> list[dict[str, Any]]:
    """The chunk objects of a streamed run: the SSE events of the data records' bytes, which
    must end with ``data: [DONE]``."""
    assert all(isinstance(m, RunData) for m in messages)
    assert [m.seq for m in messages] == list(range(len(messages)))
    body = b"".join(m.data for m in messages)
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.req("wire-versioning")
@pytest.mark.parametrize("protocol", PROTOCOL_VERSIONS)
async def test_streamed_run_end_to_end(edge: FakeEdge, backend: Backend, protocol: int) -> None:
    """A streamed chat run through the openai adapter: the backend's SSE bytes in data records,
    then ok. [wire-versioning] An Edge of the previous version gets it from the node, after one
    refused offer of the current one."""
    edge.protocols = (protocol,)
    with trio.fail_after(5):
        async with running_node(node_config(edge.url, openai_provider(backend.port))):
            conn = await edge.next_connection()
            assert conn.register.protocol == protocol
            offered = [PROTOCOL_VERSION] if protocol == PROTOCOL_VERSION else [PROTOCOL_VERSION, protocol]
            assert [r.protocol for r in edge.registers] == offered
            await conn.send(chat_run("r1", max_tokens=3))
            messages = await conn.receive_until_end("r1")
    assert messages[-1] == RunEnd("r1", "ok")
    events = chunks_of(messages[:-1])
    assert len(events) == 3 + 2  # role chunk, 3 tokens, finish chunk
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "tok " * 3
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert backend.backend.stats()["total"] == 1


async def test_non_stream_run(edge: FakeEdge, backend: Backend) -> None:
    """A non-stream run: the whole chat.completion's JSON body in data records."""
    with trio.fail_after(5):
        async with running_node(node_config(edge.url, openai_provider(backend.port))):
            conn = await edge.next_connection()
            await conn.send(chat_run("r1", stream=False, max_tokens=4))
            *output, end = await conn.receive_until_end("r1")
    assert end == RunEnd("r1", "ok")
    assert all(isinstance(m, RunData) for m in output)
    data = json.loads(b"".join(m.data for m in output))
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["content"] == "tok " * 4


async def test_completions_endpoint(edge: FakeEdge, backend: Backend) -> None:
    """The legacy completions endpoint goes to {base_url}/completions."""
    with trio.fail_after(5):
        async with running_node(node_config(edge.url, openai_provider(backend.port))):
            conn = await edge.next_connection()
            body = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": True}
            await conn.send(Run("r1", "gpu0", "completions", body, True))
            messages = await conn.receive_until_end("r1")
    assert messages[-1] == RunEnd("r1", "ok")
    assert [e["object"] for e in chunks_of(messages[:-1])] == ["text_completion"] * 3


async def test_cancel_closes_the_upstream_request(edge: FakeEdge, backend: Backend) -> None:
    """cancel -> run_end cancelled, the mock backend sees the request go away, permit returned."""
    backend.backend.tokens_per_second = 20
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, openai_provider(backend.port))) as node:
            conn = await edge.next_connection()
            await conn.send(chat_run("r1", max_tokens=1000))
            assert isinstance(await conn.receive_for("r1"), RunData)
            assert backend.backend.stats()["in_flight"] == 1
            await conn.send(Cancel("r1"))
            messages = await conn.receive_until_end("r1")
            assert messages[-1] == RunEnd("r1", "cancelled", "cancelled", "cancelled by the edge")
            assert node.runtime.gate.statistics().total_in_use == 0
            await backend.wait_idle()
            # A cancel for a run that already ended is ignored; the connection still works.
            await conn.send(Cancel("r1"))
            backend.backend.tokens_per_second = 0
            await conn.send(chat_run("r2"))
            assert (await conn.receive_until_end("r2"))[-1] == RunEnd("r2", "ok")


async def test_edge_close_cancels_every_run_of_the_connection(edge: FakeEdge, backend: Backend) -> None:
    """Closing the connection cancels all its runs (two providers), closes their upstream
    requests and returns their permits; the node then reconnects."""
    backend.backend.tokens_per_second = 20
    config = node_config(edge.url, openai_provider(backend.port, "gpu0"), openai_provider(backend.port, "gpu1"))
    with trio.fail_after(10):
        async with running_node(config) as node:
            conn = await edge.next_connection()
            await conn.send(chat_run("a", "gpu0", max_tokens=1000))
            await conn.send(chat_run("b", "gpu1", max_tokens=1000))
            await conn.receive_for("a")
            await conn.receive_for("b")
            assert node.runtime.gate.statistics().total_in_use == 2
            await conn.ws.aclose(1000, "edge says bye")
            await backend.wait_idle()
            second = await edge.next_connection()  # the connection ended once its runs' backends let go
            assert node.runtime.gate.statistics().total_in_use == 0
            assert second.register.node_id == "node-a"
            assert node.client.connections == 2


@pytest.mark.req("runtime-concurrency")
async def test_reading_goes_on_while_the_reading_task_serves_a_run(edge: FakeEdge, backend: Backend) -> None:
    """A run that arrives alone is served by the task that read it, which hands the reading on:
    runs and a cancel that come after it (alone or several together) are still read and served,
    and every permit comes back. [runtime-concurrency]"""
    backend.backend.tokens_per_second = 20
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, openai_provider(backend.port, capacity=4))) as node:
            conn = await edge.next_connection()
            await conn.send(chat_run("slow", max_tokens=1000))
            assert isinstance(await conn.receive_for("slow"), RunData)
            backend.backend.tokens_per_second = 0
            for run_id in ("a", "b", "c"):
                await conn.send(chat_run(run_id, stream=False))
            for run_id in ("a", "b", "c"):
                assert (await conn.receive_until_end(run_id))[-1] == RunEnd(run_id, "ok")
            await conn.send(Cancel("slow"))
            assert (await conn.receive_until_end("slow"))[-1].status == "cancelled"  # type: ignore[union-attr]
            assert node.runtime.gate.statistics().total_in_use == 0
            await conn.send(chat_run("last", stream=False))
            assert (await conn.receive_until_end("last"))[-1] == RunEnd("last", "ok")


async def test_unknown_provider_is_a_bad_request(edge: FakeEdge, backend: Backend) -> None:
    with trio.fail_after(5):
        async with running_node(node_config(edge.url, openai_provider(backend.port))):
            conn = await edge.next_connection()
            await conn.send(chat_run("r1", provider="nope"))
            (end,) = await conn.receive_until_end("r1")
            await conn.send(TunnelRequest("t1", "nope", "GET", "/v1/models"))
            (tunnel_end,) = await conn.receive_until_end("t1")
    assert isinstance(end, RunEnd) and (end.status, end.code) == ("error", "bad_request")
    assert isinstance(tunnel_end, TunnelEnd) and tunnel_end.code == "bad_request"


@pytest.mark.req("upstream-error-passthrough")
async def test_upstream_error_keeps_status_and_message(edge: FakeEdge, backend: Backend) -> None:
    """A non-2xx answer -> run_end error upstream_error with upstream_status and its message."""
    with trio.fail_after(5):
        async with running_node(node_config(edge.url, openai_provider(backend.port))):
            conn = await edge.next_connection()
            await conn.send(Run("r1", "gpu0", "chat/completions", {**CHAT, "max_tokens": "many"}, False))
            (end,) = await conn.receive_until_end("r1")
    assert isinstance(end, RunEnd)
    assert (end.status, end.code, end.upstream_status) == ("error", "upstream_error", 400)
    assert end.message and "many" in end.message
    # [upstream-error-passthrough] the backend's body travels too, and classifies as the client's error
    assert end.upstream_body is not None and json.loads(end.upstream_body)["error"]["message"] == end.message
    assert end.failure == "client_error"


async def test_unreachable_upstream(edge: FakeEdge) -> None:
    """Connection refused -> upstream_unreachable."""
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        with trio.fail_after(5):
            async with running_node(node_config(edge.url, openai_provider(port))):
                conn = await edge.next_connection()
                await conn.send(chat_run("r1"))
                (end,) = await conn.receive_until_end("r1")
    assert isinstance(end, RunEnd) and (end.status, end.code) == ("error", "upstream_unreachable")


async def test_tunnel_to_the_server_root(edge: FakeEdge, backend: Backend) -> None:
    """A tunnel request goes to base_url without /v1; the response is relayed raw."""
    with trio.fail_after(5):
        async with running_node(node_config(edge.url, openai_provider(backend.port))):
            conn = await edge.next_connection()
            await conn.send(TunnelRequest("t1", "gpu0", "GET", "/v1/models"))
            messages = await conn.receive_until_end("t1")
    start, *chunks, end = messages
    assert isinstance(start, TunnelStart) and start.status == 200
    assert end == TunnelEnd("t1", "ok")
    assert b'"mock"' in b"".join(c.payload() for c in chunks)


async def test_tunnel_streams_an_ollama_chat(edge: FakeEdge, backend: Backend) -> None:
    """POST /api/chat through the tunnel of an ollama provider: NDJSON relayed as sent."""
    provider = ProviderConfig(id="llm", adapter="ollama", base_url=f"http://127.0.0.1:{backend.port}")
    body = b'{"model": "m", "messages": [], "options": {"num_predict": 2}}'
    with trio.fail_after(5):
        async with running_node(node_config(edge.url, provider)):
            conn = await edge.next_connection()
            await conn.send(
                TunnelRequest.from_bytes(
                    "t1", "llm", "POST", "/api/chat", (("content-type", "application/json"),), body
                )
            )
            start, *chunks, end = await conn.receive_until_end("t1")
    assert isinstance(start, TunnelStart) and start.status == 200
    lines = b"".join(c.payload() for c in chunks).splitlines()
    assert len(lines) == 3 and b'"done":true' in lines[-1].replace(b" ", b"")
    assert end == TunnelEnd("t1", "ok")


async def test_an_unexpected_adapter_error_ends_only_that_run(edge: FakeEdge, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception the adapter did not map (a bug, an unexpected upstream shape) ends
    that run with upstream_error; the connection and the node go on."""
    original = MockAdapter.run

    async def run(
        self: MockAdapter, endpoint: str, body: dict[str, Any], *, stream: bool
    ) -> AsyncIterator[dict[str, Any]]:
        if body.get("explode"):
            raise KeyError("choices")
        async with aclosing(original(self, endpoint, body, stream=stream)) as chunks:
            async for chunk in chunks:
                yield chunk

    monkeypatch.setattr(MockAdapter, "run", run)
    with trio.fail_after(5):
        async with running_node(node_config(edge.url, ProviderConfig(id="m0", adapter="mock"))) as node:
            conn = await edge.next_connection()
            await conn.send(Run("r1", "m0", "chat/completions", {"explode": True}, True))
            (end,) = await conn.receive_until_end("r1")
            await conn.send(Run("r2", "m0", "chat/completions", {"max_tokens": 1}, False))
            assert (await conn.receive_until_end("r2"))[-1] == RunEnd("r2", "ok")
            assert node.client.connections == 1
    assert isinstance(end, RunEnd) and (end.status, end.code) == ("error", "upstream_error")
    assert end.message is not None and "KeyError" in end.message
