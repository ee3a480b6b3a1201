"""[token-ledger] The mock's end of sequence: a request's ``mock_output_tokens`` hint ends its answer
before its token limit (``finish_reason`` "stop"), paced or run in the KV engine (``--kv-tokens``),
where the cache a sequence holds grows only to the tokens it really generates while its fit is
still checked against ``max_tokens``. A bad hint is a 400 ``invalid_value``, as a bad limit is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from iop_mock import MockBackend, serve_mock_backend
from iop_mock import completion as mock_completion
from iop_mock.kv_driver import KvDriver

pytestmark = pytest.mark.req("token-ledger")

TIMEOUT = 30.0
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10}


@pytest.mark.parametrize(
    ("body", "limit", "expected"),
    [
        ({}, 10, 10),
        ({"mock_output_tokens": None}, 10, 10),
        ({"mock_output_tokens": 3}, 10, 3),
        ({"mock_output_tokens": 0}, 10, 0),
        ({"mock_output_tokens": 4.0}, 10, 4),
        ({"mock_output_tokens": 99}, 10, 10),
    ],
)
def test_output_token_count(body: dict[str, Any], limit: int, expected: int) -> None:
    """The hint, at most the limit (an end of sequence past it is never reached); absent, the limit."""
    assert mock_completion.output_token_count(body, limit) == expected


@pytest.mark.parametrize(("n_tokens", "limit", "reason"), [(3, 10, "stop"), (0, 10, "stop"), (10, 10, "length")])
def test_finish_reason_of(n_tokens: int, limit: int, reason: str) -> None:
    assert mock_completion.finish_reason_of(n_tokens, limit) == reason


async def serve(nursery: trio.Nursery, backend: MockBackend) -> AsyncIterator[httpx.AsyncClient]:
    port = await nursery.start(serve_mock_backend, backend)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as client:
        yield client


@pytest.fixture
async def paced(nursery: trio.Nursery) -> AsyncIterator[httpx.AsyncClient]:
    async for client in serve(nursery, MockBackend(tokens_per_second=1000)):
        yield client


@pytest.fixture
async def kv(nursery: trio.Nursery) -> AsyncIterator[httpx.AsyncClient]:
    driver = KvDriver.build(200, 100, "fail", tokens_per_second=1000, prefill_tokens_per_second=0)
    async for client in serve(nursery, MockBackend(kv=driver)):
        yield client


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def answers(client: httpx.AsyncClient, hint: int | None) -> dict[str, Any]:
    """Every path's answer to ``CHAT`` with ``hint``: its content tokens, finish reason and usage."""
    body = CHAT if hint is None else CHAT | {"mock_output_tokens": hint}
    streamed = await client.post(
        "/v1/chat/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = events(streamed.text)
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    legacy_body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "y" * 8}
    legacy = (await client.post("/v1/completions", json=legacy_body | {"stream": True})).text
    legacy_chunks = events(legacy)
    ollama = [json.loads(line) for line in (await client.post("/api/chat", json=body)).text.splitlines()]
    ollama_whole = (await client.post("/api/chat", json=body | {"stream": False})).json()
    return {
        "stream": (
            sum(c["choices"][0]["delta"].get("content") == "tok " for c in chunks if c["choices"]),
            [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1],
            chunks[-1]["usage"]["completion_tokens"],
        ),
        "whole": (
            whole["choices"][0]["message"]["content"].count("tok "),
            whole["choices"][0]["finish_reason"],
            whole["usage"]["completion_tokens"],
        ),
        "legacy": (
            sum(c["choices"][0]["text"] == "tok " for c in legacy_chunks),
            legacy_chunks[-1]["choices"][0]["finish_reason"],
        ),
        "ollama": (len(ollama) - 1, ollama[-1]["done_reason"], ollama[-1]["eval_count"]),
        "ollama_whole": (ollama_whole["message"]["content"].count("tok "), ollama_whole["done_reason"]),
    }


def expected(n: int, reason: str) -> dict[str, Any]:
    return {
        "stream": (n, reason, n),
        "whole": (n, reason, n),
        "legacy": (n, reason),
        "ollama": (n, reason, n),
        "ollama_whole": (n, reason),
    }


@pytest.mark.parametrize(
    ("hint", "n", "reason"),
    [(3, 3, "stop"), (0, 0, "stop"), (10, 10, "length"), (50, 10, "length"), (None, 10, "length")],
)
async def test_the_paced_mock_ends_at_the_hint(paced: httpx.AsyncClient, hint: int | None, n: int, reason: str) -> None:
    with trio.fail_after(TIMEOUT):
        assert await answers(paced, hint) == expected(n, reason)


@pytest.mark.parametrize(
    ("hint", "n", "reason", "peak"), [(3, 3, "stop", 12), (0, 0, "stop", 0), (50, 10, "length", 19)]
)
async def test_the_kv_mock_ends_at_the_hint_and_holds_only_what_it_generated(
    kv: httpx.AsyncClient, hint: int, n: int, reason: str, peak: int
) -> None:
    """Each answer runs alone: its sequence's cache, read at each step's end, peaks at its prompt (10)
    and the tokens it generated before its last (the last step frees it; an answer of none, or of one,
    is prefilled and ends in one step)."""
    with trio.fail_after(TIMEOUT):
        got = await answers(kv, hint)
        stats = (await kv.get("/stats")).json()
    assert got == expected(n, reason)
    assert (stats["kv_used"], stats["context_errors"], stats["kv_peak"]) == (0, 0, peak)


async def test_the_kv_mock_checks_the_fit_with_max_tokens_not_the_hint(kv: httpx.AsyncClient) -> None:
    """n_ctx 100: a prompt of 10 with max_tokens 95 cannot fit, whatever the hint says."""
    with trio.fail_after(TIMEOUT):
        response = await kv.post("/v1/chat/completions", json=CHAT | {"max_tokens": 95, "mock_output_tokens": 2})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("bad", ["3", True, 1.5, -1, 65_537, [3]])
async def test_a_bad_hint_is_400_invalid_value(paced: httpx.AsyncClient, bad: object) -> None:
    with trio.fail_after(TIMEOUT):
        response = await paced.post("/v1/chat/completions", json=CHAT | {"mock_output_tokens": bad})
        stats = (await paced.get("/stats")).json()
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("invalid_value", "invalid_request_error")
    assert "mock_output_tokens" in error["message"] and stats["total"] == 0
