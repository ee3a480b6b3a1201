"""Adapters in isolation: httpx.MockTransport for exact upstream answers, the mock backend
for the Ollama shape, and the in-process mock adapter under a MockClock."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from iop_mock import embedding as mock_embedding
from iop_node import (
    BadRunRequest,
    MockAdapter,
    OllamaAdapter,
    OpenAIAdapter,
    ProviderConfig,
    TunnelHead,
    UpstreamFailed,
    UpstreamUnreachable,
)
from node.harness import Backend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def openai_adapter(handler: Callable[[httpx.Request], httpx.Response]) -> OpenAIAdapter:
    provider = ProviderConfig(id="p", adapter="openai", base_url="http://upstream.test/v1/", capacity=2)
    return OpenAIAdapter.from_config(provider, transport=httpx.MockTransport(handler))


def ollama_adapter(handler: Callable[[httpx.Request], httpx.Response]) -> OllamaAdapter:
    provider = ProviderConfig(id="p", adapter="ollama", base_url="http://ollama.test")
    return OllamaAdapter.from_config(provider, transport=httpx.MockTransport(handler))


async def collect(items: AsyncIterator[Any]) -> list[Any]:
    async with aclosing(items) as iterator:  # type: ignore[type-var]
        return [item async for item in iterator]


class StreamedBody(httpx.AsyncByteStream):
    """A response body that is really streamed (``content=`` bytes would be pre-read)."""

    def __init__(self, *chunks: bytes) -> None:
        self._chunks = list(chunks)

    def __aiter__(self) -> StreamedBody:
        return self

    async def __anext__(self) -> bytes:
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)


def sse(body: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())


async def test_sse_events_are_parsed_until_done() -> None:
    body = (
        ": keep-alive comment\n\n"
        'event: message\ndata: {"choices": [], "n": 1}\n\n'
        'data: {"choices": [],\ndata:  "n": 2}\r\n\r\n'
        "data: [DONE]\n\n"
        'data: {"choices": [], "n": 3}\n\n'
    )
    adapter = openai_adapter(sse(body))
    chunks = await collect(adapter.run("chat/completions", CHAT, stream=True))
    await adapter.aclose()
    assert [c["n"] for c in chunks] == [1, 2]


async def test_sse_error_event_fails_the_run() -> None:
    adapter = openai_adapter(sse('data: {"choices": []}\n\ndata: {"error": {"message": "oom"}}\n\n'))
    with pytest.raises(UpstreamFailed, match="oom"):
        await collect(adapter.run("chat/completions", CHAT, stream=True))
    await adapter.aclose()


async def test_request_goes_to_base_url_with_stream_flag() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"object": "text_completion", "choices": []})

    adapter = openai_adapter(handler)
    (response,) = await collect(adapter.run("completions", {"prompt": "x", "stream": True}, stream=False))
    await adapter.aclose()
    assert response["object"] == "text_completion"
    assert str(seen[0].url) == "http://upstream.test/v1/completions"
    assert json.loads(seen[0].content) == {"prompt": "x", "stream": False}


async def test_non_2xx_is_upstream_error_with_status_and_message() -> None:
    adapter = openai_adapter(lambda request: httpx.Response(503, json={"error": {"message": "overloaded"}}))
    with pytest.raises(UpstreamFailed) as caught:
        await collect(adapter.run("chat/completions", CHAT, stream=True))
    await adapter.aclose()
    assert (caught.value.code, caught.value.status, caught.value.message) == ("upstream_error", 503, "overloaded")


@pytest.mark.req("upstream-error-passthrough")
@pytest.mark.parametrize(
    ("status", "content", "message"),
    [
        (
            400,
            b'{"error": {"message": "too long", "type": "invalid_request_error", "param": null, "code": 7}}',
            "too long",
        ),
        (413, b"<html>payload too large</html>", "<html>payload too large</html>"),
        (422, b"", "Unprocessable Entity"),
    ],
)
async def test_backend_client_error_carries_status_and_body(status: int, content: bytes, message: str) -> None:
    """[upstream-error-passthrough] a backend 4xx: UpstreamFailed with the status, message and raw body text."""
    adapter = openai_adapter(lambda request: httpx.Response(status, content=content))
    with pytest.raises(UpstreamFailed) as caught:
        await collect(adapter.run("chat/completions", CHAT, stream=False))
    await adapter.aclose()
    assert (caught.value.status, caught.value.message, caught.value.body) == (status, message, content.decode())


@pytest.mark.req("upstream-error-passthrough")
async def test_mock_adapter_refuses_like_the_mock_backend() -> None:
    """[upstream-error-passthrough] max_tokens over the mock's limit: a 400 with an OpenAI error body."""
    with pytest.raises(UpstreamFailed) as caught:
        await collect(MockAdapter().run("chat/completions", {"max_tokens": 100_000}, stream=False))
    assert caught.value.status == 400
    assert caught.value.body is not None
    error = json.loads(caught.value.body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value")
    assert "maximum" in error["message"]


@pytest.mark.parametrize("error", [httpx.ConnectError("refused"), httpx.ReadTimeout("slow")])
async def test_transport_errors_are_upstream_unreachable(error: httpx.TransportError) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    adapter = openai_adapter(handler)
    with pytest.raises(UpstreamUnreachable) as caught:
        await collect(adapter.run("chat/completions", CHAT, stream=False))
    await adapter.aclose()
    assert caught.value.code == "upstream_unreachable"


async def test_unknown_endpoint_is_a_bad_request() -> None:
    adapter = openai_adapter(lambda request: httpx.Response(200, json={}))
    with pytest.raises(BadRunRequest):
        await collect(adapter.run("rerank", CHAT, stream=False))
    await adapter.aclose()


async def test_tunnel_forwards_to_the_server_root_and_drops_hop_by_hop_headers() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, headers={"x-up": "1", "connection": "close"}, stream=StreamedBody(b"raw ", b"body"))

    adapter = openai_adapter(handler)
    headers = [("Authorization", "Bearer k"), ("Connection", "Upgrade"), ("Upgrade", "h2c"), ("Host", "evil")]
    head, *chunks = await collect(adapter.tunnel("post", "/api/x?y=1", headers, b"payload"))
    await adapter.aclose()
    assert str(seen[0].url) == "http://upstream.test/api/x?y=1"
    assert seen[0].method == "POST" and seen[0].content == b"payload"
    assert seen[0].headers["authorization"] == "Bearer k"
    assert seen[0].headers["host"] == "upstream.test"
    assert "upgrade" not in seen[0].headers and seen[0].headers.get("connection") != "Upgrade"
    assert isinstance(head, TunnelHead) and head.status == 201
    assert ("x-up", "1") in head.headers and all(k != "connection" for k, _ in head.headers)
    assert b"".join(chunks) == b"raw body"


@pytest.mark.parametrize(("method", "path"), [("GET", "//evil.test/x"), ("GET", "v1/models"), ("GE T", "/x")])
async def test_tunnel_rejects_bad_method_or_path(method: str, path: str) -> None:
    adapter = openai_adapter(lambda request: httpx.Response(200))
    with pytest.raises(BadRunRequest):
        await collect(adapter.tunnel(method, path, [], b""))
    await adapter.aclose()


async def test_ollama_request_mapping_and_errors() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(404, json={"error": "model 'm' not found"})

    adapter = ollama_adapter(handler)
    body = {**CHAT, "max_tokens": 5, "temperature": 0.5, "response_format": {"type": "json_object"}}
    with pytest.raises(UpstreamFailed) as caught:
        await collect(adapter.run("chat/completions", body, stream=True))
    assert (caught.value.status, caught.value.message) == (404, "model 'm' not found")
    assert caught.value.body == '{"error":"model \'m\' not found"}'  # [upstream-error-passthrough]
    assert seen[0] == {
        "model": "m",
        "messages": CHAT["messages"],
        "stream": True,
        "options": {"num_predict": 5, "temperature": 0.5},
        "format": "json",
    }
    with pytest.raises(BadRunRequest):
        await collect(adapter.run("completions", {"prompt": "x"}, stream=False))
    await adapter.aclose()


async def test_ollama_error_line_mid_stream() -> None:
    body = b'{"model":"m","message":{"role":"assistant","content":"a"},"done":false}\n{"error":"gpu lost"}\n'
    adapter = ollama_adapter(lambda request: httpx.Response(200, content=body))
    with pytest.raises(UpstreamFailed, match="gpu lost"):
        await collect(adapter.run("chat/completions", CHAT, stream=True))
    await adapter.aclose()


async def test_ollama_against_the_mock_backend(backend: Backend) -> None:
    """Native /api/chat NDJSON mapped to chat.completion.chunk objects and a chat.completion."""
    provider = ProviderConfig(id="o", adapter="ollama", base_url=f"http://127.0.0.1:{backend.port}")
    adapter = OllamaAdapter.from_config(provider)
    body = {**CHAT, "max_tokens": 3}
    with trio.fail_after(5):
        chunks = await collect(adapter.run("chat/completions", body, stream=True))
        (completion,) = await collect(adapter.run("chat/completions", body, stream=False))
    await adapter.aclose()
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "tok " * 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"] == {"role": "assistant", "content": "tok " * 3}


async def test_mock_adapter_streams_at_its_rate(autojump_clock: trio.testing.MockClock) -> None:
    adapter = MockAdapter(latency=0.5, tokens_per_second=10)
    start = trio.current_time()
    chunks = await collect(adapter.run("chat/completions", {"max_tokens": 4}, stream=True))
    assert len(chunks) == 4 + 2
    assert trio.current_time() - start == pytest.approx(0.5 + 5 * 0.1)
    (response,) = await collect(adapter.run("completions", {}, stream=False))
    assert response["choices"][0]["text"] == "tok " * 16  # max_tokens defaults to 16


async def test_mock_adapter_fault_knob() -> None:
    adapter = MockAdapter(fail_after_chunks=2)
    received: list[dict[str, Any]] = []
    with pytest.raises(UpstreamFailed):
        async with aclosing(adapter.run("chat/completions", {"max_tokens": 5}, stream=True)) as chunks:
            async for chunk in chunks:
                received.append(chunk)
    assert len(received) == 2


async def test_mock_adapter_tunnel() -> None:
    adapter = MockAdapter()
    head, *body = await collect(adapter.tunnel("GET", "/v1/models", [], b""))
    assert head.status == 200 and json.loads(b"".join(body))["data"][0]["id"] == "mock"
    request = json.dumps({"max_tokens": 2, "stream": True}).encode()
    head, *body = await collect(adapter.tunnel("POST", "/v1/chat/completions", [], request))
    text = b"".join(body).decode()
    assert head.status == 200 and text.count("data: ") == 2 + 2 + 1 and text.endswith("data: [DONE]\n\n")
    head, *_ = await collect(adapter.tunnel("GET", "/nope", [], b""))
    assert head.status == 404


@pytest.mark.req("embeddings")
async def test_openai_adapter_embeddings_go_as_sent() -> None:
    """[embeddings] POST {base_url}/embeddings with the body unchanged (no stream key); one answer."""
    seen: list[httpx.Request] = []
    answer = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}], "model": "e"}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer)

    adapter = openai_adapter(handler)
    body = {"model": "e", "input": ["a"], "encoding_format": "base64"}
    assert await collect(adapter.run("embeddings", body, stream=False)) == [answer]
    await adapter.aclose()
    assert str(seen[0].url) == "http://upstream.test/v1/embeddings"
    assert json.loads(seen[0].content) == body


@pytest.mark.req("embeddings")
async def test_ollama_adapter_embeddings_via_api_embed() -> None:
    """[embeddings] /api/embed with input and dimensions; the answer in OpenAI's shape, float or base64."""
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(
            200, json={"model": "nomic", "embeddings": [[0.5, -1.0], [0.25, 2.0]], "prompt_eval_count": 6}
        )

    adapter = ollama_adapter(handler)
    (plain,) = await collect(
        adapter.run("embeddings", {"model": "nomic", "input": ["a", "b"], "dimensions": 2}, stream=False)
    )
    (packed,) = await collect(
        adapter.run("embeddings", {"model": "nomic", "input": "a", "encoding_format": "base64"}, stream=False)
    )
    with pytest.raises(UpstreamFailed) as tokens:
        await collect(adapter.run("embeddings", {"model": "nomic", "input": [1, 2]}, stream=False))
    await adapter.aclose()
    assert seen == [{"model": "nomic", "input": ["a", "b"], "dimensions": 2}, {"model": "nomic", "input": "a"}]
    assert plain == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.5, -1.0]},
            {"object": "embedding", "index": 1, "embedding": [0.25, 2.0]},
        ],
        "model": "nomic",
        "usage": {"prompt_tokens": 6, "total_tokens": 6},
    }
    assert struct.unpack("<2f", base64.b64decode(packed["data"][1]["embedding"])) == (0.25, 2.0)
    assert tokens.value.status == 400  # Ollama embeds text only: the client's request cannot be served here
    assert tokens.value.body is not None and json.loads(tokens.value.body)["error"]["param"] == "input"


@pytest.mark.req("embeddings")
async def test_mock_adapter_embeddings_are_the_mock_backends() -> None:
    """[embeddings] the in-process mock answers the same deterministic vectors as the mock backend."""
    (answer,) = await collect(MockAdapter().run("embeddings", {"model": "e", "input": ["x", "y"]}, stream=False))
    assert [d["embedding"] for d in answer["data"]] == [mock_embedding.vector("x"), mock_embedding.vector("y")]
    with pytest.raises(UpstreamFailed) as refused:
        await collect(MockAdapter().run("embeddings", {"model": "e", "input": 7}, stream=False))
    assert refused.value.status == 400
