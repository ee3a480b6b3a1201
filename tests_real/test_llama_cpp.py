"""A real backend behind real Edge and Node processes, driven by the official ``openai`` client.

llama.cpp's OpenAI-compatible server (llama-cpp-python) serves Gemma 3 270M with a 2,048-token
context. The Edge has two model keys, ``ornith:35b`` and ``ornith-fast``, on the one capacity-1
provider ``node-a/gpu0``; the Node's ``openai`` adapter points at the llama.cpp server.
Generation is kept short (a few tokens): the point is the plumbing, not the text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness import BIG, FAST, Stack, drained, edge_config, node_config, open_stack, provider

TIMEOUT = 120.0
"""Seconds per test: a loaded 2-core box generates a few tokens per second."""
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]


@asynccontextmanager
async def real_stack(tmp_path: Path, llama_port: int) -> AsyncIterator[Stack]:
    """Edge + Node processes in front of the session's llama.cpp server."""
    async with open_stack(tmp_path) as stack:
        await stack.start_edge(edge_config())
        stack.backend_port = llama_port  # the node's openai adapter -> http://127.0.0.1:PORT/v1
        await stack.start_node(node_config())
        yield stack


def client(base_url: str, *, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=max_retries, timeout=TIMEOUT)


def flat(vector: Any) -> list[float]:
    """An embedding as one list of floats (llama.cpp without pooling answers one vector per token)."""
    if vector and isinstance(vector[0], list):
        return [x for row in vector for x in row]
    return list(vector)


def admitted(metrics: str) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(metrics) for s in f.samples if s.name == "iop_admitted_total"
    )


async def test_chat_and_completions_stream_and_not(tmp_path: Path, llama_port: int) -> None:
    """Chat and completions, stream and non-stream, both model keys, parsed by the official client."""

    def calls(base_url: str) -> dict[str, Any]:
        with client(base_url) as c:
            chat = c.chat.completions.with_raw_response.create(model=BIG, messages=MESSAGES, max_tokens=6)
            text = c.completions.create(model=FAST, prompt="Once upon a time", max_tokens=6)
            chat_stream = list(c.chat.completions.create(model=FAST, messages=MESSAGES, max_tokens=6, stream=True))
            text_stream = list(c.completions.create(model=BIG, prompt="Once upon a time", max_tokens=6, stream=True))
        return {"chat": chat, "text": text, "chat_stream": chat_stream, "text_stream": text_stream}

    with trio.fail_after(TIMEOUT):
        async with real_stack(tmp_path, llama_port) as stack:
            got = await trio.to_thread.run_sync(calls, stack.base_url)
            status = await stack.wait_status(drained)
    assert got["chat"].headers["x-iop-provider"] == "node-a/gpu0"
    chat = got["chat"].parse()
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens <= 6
    assert got["text"].object == "text_completion" and got["text"].choices[0].text
    assert got["chat_stream"][-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in got["chat_stream"] if c.choices)
    assert "".join(c.choices[0].text for c in got["text_stream"] if c.choices)
    assert drained(status)


async def test_two_model_keys_share_one_capacity_1_provider(tmp_path: Path, llama_port: int) -> None:
    """Four calls at once on both keys: all served by node-a/gpu0, never more than one in flight there."""
    peaks = {"in_flight": 0, "queue_depth": 0}

    def one(base_url: str, model: str) -> str:
        with client(base_url) as c:
            raw = c.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=4)
        return raw.headers["x-iop-provider"]

    with trio.fail_after(TIMEOUT):
        async with real_stack(tmp_path, llama_port) as stack:
            served: list[str] = []

            async def call(model: str) -> None:
                served.append(await trio.to_thread.run_sync(one, stack.base_url, model))

            async with trio.open_nursery() as nursery:
                for model in (BIG, FAST, BIG, FAST):
                    nursery.start_soon(call, model)
                while len(served) < 4:
                    status = await stack.status()
                    peaks["in_flight"] = max(peaks["in_flight"], provider(status, "gpu0")["in_flight"])
                    peaks["queue_depth"] = max(peaks["queue_depth"], status["queue_depth"])
                    await trio.sleep(0.02)
            status = await stack.wait_status(drained)
    assert served == ["node-a/gpu0"] * 4
    assert peaks["in_flight"] == 1
    assert peaks["queue_depth"] >= 1
    assert drained(status)


async def test_context_window_400_passes_through_and_is_not_retried(tmp_path: Path, llama_port: int) -> None:
    """[upstream-error-passthrough] llama.cpp's 400 for a prompt over 2,048 tokens is the client's 400,
    with llama.cpp's message, type, param and code; the client (retries on) sends it once."""
    long_prompt: list[Any] = [{"role": "user", "content": "hello " * 3000}]

    def refused(base_url: str) -> openai.BadRequestError:
        with client(base_url, max_retries=2) as c, pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model=BIG, messages=long_prompt, max_tokens=8)
        return caught.value

    with trio.fail_after(TIMEOUT):
        async with real_stack(tmp_path, llama_port) as stack:
            error = await trio.to_thread.run_sync(refused, stack.base_url)
            metrics = (await stack.http.get(f"{stack.base_url}/metrics")).text
            status = await stack.wait_status(drained)
    assert error.status_code == 400
    assert error.code == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in error.message
    assert isinstance(error.body, dict) and error.body["type"] == "invalid_request_error"
    assert error.body["param"] == "messages"
    assert error.response.headers["x-iop-provider"] == "node-a/gpu0"
    assert admitted(metrics) == 1  # one attempt
    assert drained(status)


async def test_embeddings_are_the_backends(tmp_path: Path, llama_port: int) -> None:
    """[embeddings] through the Edge, the same vectors as llama.cpp answers directly; the client's
    default (it asks for base64, llama.cpp answers floats) works too."""
    inputs = ["hello", "world"]

    def embed(base_url: str, model: str) -> tuple[Any, Any]:
        with client(base_url) as c:
            floats = c.embeddings.create(model=model, input=inputs, encoding_format="float")
            default = c.embeddings.create(model=model, input="hello")
        return floats, default

    with trio.fail_after(TIMEOUT):
        async with real_stack(tmp_path, llama_port) as stack:
            via_edge, default = await trio.to_thread.run_sync(embed, stack.base_url, FAST)
            direct, _ = await trio.to_thread.run_sync(embed, f"http://127.0.0.1:{llama_port}", "gemma")
            status = await stack.wait_status(drained)
    assert len(via_edge.data) == len(inputs)
    # llama.cpp's floats vary in the last digits from call to call: same shape, close values.
    for ours, theirs in zip(via_edge.data, direct.data, strict=True):
        assert flat(ours.embedding) == pytest.approx(flat(theirs.embedding), rel=1e-3, abs=1e-3)
    assert flat(default.data[0].embedding) == pytest.approx(flat(via_edge.data[0].embedding), rel=1e-3, abs=1e-3)
    assert via_edge.usage.prompt_tokens == direct.usage.prompt_tokens
    assert drained(status)


async def test_include_usage_behaves_as_the_backend(tmp_path: Path, llama_port: int) -> None:
    """``stream_options.include_usage`` reaches the backend: the stream through the Edge has a usage
    chunk exactly when llama.cpp's own stream has one."""

    def usage_chunks(base_url: str, model: str) -> list[bool]:
        with client(base_url) as c:
            stream = c.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True}
            )
            return [chunk.usage is not None for chunk in stream]

    with trio.fail_after(TIMEOUT):
        async with real_stack(tmp_path, llama_port) as stack:
            via_edge = await trio.to_thread.run_sync(usage_chunks, stack.base_url, BIG)
            direct = await trio.to_thread.run_sync(usage_chunks, f"http://127.0.0.1:{llama_port}", "gemma")
    assert any(via_edge) == any(direct)
    assert via_edge[-1] == direct[-1]


async def test_client_abort_releases_the_lease(tmp_path: Path, llama_port: int) -> None:
    """A client that drops a long stream after its first chunk: the lease is released (in_flight 0,
    queue empty) and the next request is served."""

    def abort(base_url: str) -> dict[str, Any]:
        body = {"model": BIG, "messages": MESSAGES, "max_tokens": 1000, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as http:
            with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        held: dict[str, Any] = http.get(f"{base_url}/status").json()
                        return held  # leaving the block closes the connection mid-stream

        raise AssertionError("the stream ended before its first chunk")

    with trio.fail_after(TIMEOUT):
        async with real_stack(tmp_path, llama_port) as stack:
            held = await trio.to_thread.run_sync(abort, stack.base_url)
            status = await stack.wait_status(drained)
            after = await stack.chat(FAST, max_tokens=2)
    assert provider(held, "gpu0")["in_flight"] == 1
    assert drained(status)
    assert after.status_code == 200 and after.headers["x-iop-provider"] == "node-a/gpu0"


async def test_models_lists_the_model_keys(tmp_path: Path, llama_port: int) -> None:
    """``/v1/models`` lists the Edge's model keys, not the backend's model file."""

    def models(base_url: str) -> list[str]:
        with client(base_url) as c:
            return [m.id for m in c.models.list().data]

    with trio.fail_after(TIMEOUT):
        async with real_stack(tmp_path, llama_port) as stack:
            ids = await trio.to_thread.run_sync(models, stack.base_url)
    assert ids == [BIG, FAST]
