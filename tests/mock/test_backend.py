"""The mock backend (`iop-mock-backend`) and its fake completions.

The backend is the measuring instrument of [capacity-smoke] (its `/stats` peak concurrency) and
the upstream of the Node's [tunnel-guard] and [runtime-concurrency] tests, so its in-flight
accounting must be exact and must never leak.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
import trio.testing

from iop_mock import MockBackend, main, serve_mock_backend
from iop_mock import completion as mock_completion

TIMEOUT = 10.0


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@attrs.frozen
class Served:
    backend: MockBackend
    client: httpx.AsyncClient
    base_url: str


@pytest.fixture
async def served(nursery: trio.Nursery) -> AsyncIterator[Served]:
    """A MockBackend served on 127.0.0.1 port 0, and an httpx client for it."""
    backend = MockBackend()
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(serve_mock_backend, backend)
    base_url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base_url) as client:
        yield Served(backend, client, base_url)


async def wait_for_stats(client: httpx.AsyncClient, done: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """Poll GET /stats until ``done(stats)``; the caller bounds it with ``trio.fail_after``."""
    while not done(stats := (await client.get("/stats")).json()):
        await trio.sleep(0.005)
    return stats


def idle(stats: dict[str, int]) -> bool:
    return stats["in_flight"] == 0


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, asserting the framing on the way."""
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(block.startswith("data: ") for block in blocks)
    return [block.removeprefix("data: ") for block in blocks]


# --- mock_completion: pure shapes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, 16),
        ({"max_tokens": 5}, 5),
        ({"max_completion_tokens": 7}, 7),
        ({"max_tokens": None, "max_completion_tokens": 3}, 3),
        ({"options": {"num_predict": 4}}, 4),
        ({"options": {"num_predict": -1}}, 0),
        ({"max_tokens": 2.0}, 2),
    ],
)
def test_token_count(body: dict[str, Any], expected: int) -> None:
    assert mock_completion.token_count(body) == expected


@pytest.mark.parametrize("bad", ["7", True, 1.5, [3]])
def test_token_count_rejects_non_integers(bad: object) -> None:
    with pytest.raises(ValueError, match="token limit must be an integer"):
        mock_completion.token_count({"max_tokens": bad})


@pytest.mark.parametrize(
    ("body", "chars_per_token", "expected"),
    [
        ({}, 4.0, 0),
        ({"messages": [{"role": "user", "content": "x" * 9}]}, 4.0, 2),
        (
            {"messages": [{"content": "abcd"}, {"content": [{"type": "text", "text": "efgh"}, {"type": "image"}]}]},
            4.0,
            2,
        ),
        ({"messages": ["not a message", {"content": None}]}, 4.0, 0),
        ({"prompt": "x" * 40}, 5.0, 8),
        ({"prompt": ["x" * 10, 3, "y" * 10]}, 4.0, 5),
    ],
)
def test_prompt_token_count(body: dict[str, Any], chars_per_token: float, expected: int) -> None:
    """Prompt characters / chars_per_token, rounded down (4: the Edge's estimate of a prompt)."""
    assert mock_completion.prompt_token_count(body, chars_per_token) == expected


def test_chat_chunks_shape() -> None:
    chunks = list(mock_completion.chat_chunks("m", 3, id="chatcmpl-1", created=5))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant"},
        {"content": "tok "},
        {"content": "tok "},
        {"content": "tok "},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert {(c["id"], c["object"], c["created"], c["model"]) for c in chunks} == {
        ("chatcmpl-1", "chat.completion.chunk", 5, "m")
    }
    with_usage = list(mock_completion.chat_chunks("m", 2, id="chatcmpl-1", created=5, include_usage=True))
    assert [c["usage"] for c in with_usage[:-1]] == [None] * 4
    assert with_usage[-1]["choices"] == []
    assert with_usage[-1]["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 2,
        "total_tokens": 2,
    }


def test_completion_and_ollama_shapes() -> None:
    response = mock_completion.completion_response("m", 2, id="cmpl-1", created=5)
    assert response["object"] == "text_completion"
    assert response["choices"][0]["text"] == "tok tok "
    chunks = list(mock_completion.completion_chunks("m", 2, id="cmpl-1", created=5))
    assert [c["choices"][0]["text"] for c in chunks] == ["tok ", "tok ", ""]
    lines = list(mock_completion.ollama_chat_lines("m", 2, created_at="2024-01-01T00:00:00Z"))
    assert [(line["message"]["content"], line["done"]) for line in lines] == [
        ("tok ", False),
        ("tok ", False),
        ("", True),
    ]
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 2
    whole = mock_completion.ollama_chat_response("m", 2, created_at="2024-01-01T00:00:00Z")
    assert whole["message"] == {"role": "assistant", "content": "tok tok "}
    assert whole["done"] is True


# --- the ASGI app in-process, on virtual time ---------------------------------------------


@attrs.define
class FakeASGIClient:
    """Drives ``backend.app`` directly: one request body, records when each message was sent."""

    body: bytes
    sent: list[tuple[float, dict[str, Any]]] = attrs.Factory(list)
    disconnect: trio.Event = attrs.Factory(trio.Event)
    _body_given: bool = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_given:
            self._body_given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append((trio.current_time(), message))


def http_scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "headers": []}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/api/chat"])
async def test_stream_pacing_on_virtual_time(autojump_clock: trio.testing.MockClock, path: str) -> None:
    """Headers (with the role chunk, if any) after the latency, token k at latency + k/tps, the end with the last token."""
    backend = MockBackend(latency=0.2, tokens_per_second=10)
    fake = FakeASGIClient(json.dumps({"model": "m", "max_tokens": 3, "stream": True}).encode())
    start = trio.current_time()
    await backend.app(http_scope("POST", path), fake.receive, fake.send)
    bodies = [(round(t - start, 6), message) for t, message in fake.sent if message["type"] == "http.response.body"]
    # The first body message goes with the headers: the role chunk, or nothing (the head alone).
    assert [t for t, _ in bodies] == [0.2, 0.3, 0.4, 0.5, 0.5]
    assert bool(bodies[0][1]["body"]) is (path == "/v1/chat/completions")
    assert backend.stats() == {"in_flight": 0, "peak_in_flight": 1, "total": 1, "aborted": 0}


async def test_non_stream_waits_whole_generation(autojump_clock: trio.testing.MockClock) -> None:
    backend = MockBackend(latency=0.2, tokens_per_second=10)
    fake = FakeASGIClient(json.dumps({"model": "m", "max_tokens": 3}).encode())
    start = trio.current_time()
    await backend.app(http_scope("POST", "/v1/chat/completions"), fake.receive, fake.send)
    (sent_at, start_message), (_, body) = fake.sent
    assert round(sent_at - start, 6) == 0.5
    assert start_message["status"] == 200
    assert json.loads(body["body"])["choices"][0]["message"]["content"] == "tok tok tok "


async def test_disconnect_ends_the_count_in_process(autojump_clock: trio.testing.MockClock) -> None:
    """http.disconnect mid-stream cancels the response and releases in_flight at once."""
    backend = MockBackend(latency=0.0, tokens_per_second=1)
    fake = FakeASGIClient(json.dumps({"max_tokens": 1000, "stream": True}).encode())
    async with trio.open_nursery() as nursery:
        scope = http_scope("POST", "/v1/chat/completions")
        nursery.start_soon(backend.app, scope, fake.receive, fake.send)
        await trio.sleep(2.5)
        assert backend.stats()["in_flight"] == 1
        fake.disconnect.set()
        await trio.testing.wait_all_tasks_blocked()
        assert backend.stats() == {"in_flight": 0, "peak_in_flight": 1, "total": 1, "aborted": 1}
    assert trio.current_time() == pytest.approx(2.5)


async def test_cancellation_ends_the_count_in_process(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MockBackend(latency=60.0)
    fake = FakeASGIClient(json.dumps({"max_tokens": 1}).encode())
    with trio.move_on_after(1.0):
        await backend.app(http_scope("POST", "/v1/completions"), fake.receive, fake.send)
    assert fake.sent == []
    assert backend.stats() == {"in_flight": 0, "peak_in_flight": 1, "total": 1, "aborted": 1}


# --- over real sockets ----------------------------------------------------------------------


async def test_models_list(served: Served) -> None:
    with trio.fail_after(TIMEOUT):
        response = await served.client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [("mock", "model")]


async def test_chat_non_stream_shape(served: Served) -> None:
    with trio.fail_after(TIMEOUT):
        response = await served.client.post(
            "/v1/chat/completions",
            json={
                "model": "ornith:35b",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
        stats = await wait_for_stats(served.client, idle)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "ornith:35b"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "tok " * 3,
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert stats == {"in_flight": 0, "peak_in_flight": 1, "total": 1, "aborted": 0}


async def test_completion_non_stream_shape(served: Served) -> None:
    with trio.fail_after(TIMEOUT):
        response = await served.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "tok " * 16  # the default max_tokens
    assert body["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("tokens_per_second", [0, 2000])
async def test_chat_stream_ends_with_done(served: Served, tokens_per_second: float) -> None:
    served.backend.tokens_per_second = tokens_per_second
    with trio.fail_after(TIMEOUT):
        response = await served.client.post(
            "/v1/chat/completions", json={"model": "m", "max_tokens": 5, "stream": True}
        )
    assert response.headers["content-type"] == "text/event-stream"
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    contents = [delta["content"] for delta in deltas if "content" in delta]
    assert contents == ["tok "] * 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_completion_stream_ends_with_done(served: Served) -> None:
    served.backend.tokens_per_second = 2000
    with trio.fail_after(TIMEOUT):
        response = await served.client.post("/v1/completions", json={"model": "m", "max_tokens": 4, "stream": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    texts = [json.loads(event)["choices"][0]["text"] for event in events[:-1]]
    assert texts == ["tok "] * 4 + [""]


async def test_openai_client_parses_everything(served: Served) -> None:
    """The official openai client parses all shapes, stream and non-stream.

    Non-stream calls use AsyncOpenAI (anyio, running on trio). Streams use the sync client in a
    worker thread: AsyncOpenAI parses them too, but breaks out of its async generators at
    ``[DONE]`` without closing them, and trio's async-generator finalizer turns that into a
    ResourceWarning, which this suite treats as an error.
    """
    served.backend.tokens_per_second = 2000
    base_url = f"{served.base_url}/v1"
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        with trio.fail_after(TIMEOUT):
            models = await client.models.list()
            chat = await client.chat.completions.create(model="m", messages=messages, max_tokens=2)
            completion = await client.completions.create(model="m", prompt="x", max_tokens=2)

    def read_streams() -> tuple[list[Any], list[Any]]:
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as sync_client:
            chunks = list(
                sync_client.chat.completions.create(
                    model="m",
                    messages=messages,
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text_chunks = list(sync_client.completions.create(model="m", prompt="x", max_tokens=2, stream=True))
        return chunks, text_chunks

    with trio.fail_after(TIMEOUT):
        chunks, text_chunks = await trio.to_thread.run_sync(read_streams, abandon_on_cancel=True)
    assert [m.id for m in models.data] == ["mock"]
    assert chat.choices[0].message.content == "tok tok "
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 2
    assert completion.choices[0].text == "tok tok "
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok " * 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert "".join(c.choices[0].text for c in text_chunks) == "tok tok "


@pytest.mark.req("capacity-smoke")
async def test_peak_in_flight_counts_concurrency_and_reset(served: Served) -> None:
    """[capacity-smoke] 3 concurrent slow requests → peak 3; abandoning them releases all."""
    served.backend.latency = 60.0
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(_post_chat, served.client)
            stats = await wait_for_stats(served.client, lambda s: s["in_flight"] == 3)
            assert stats == {"in_flight": 3, "peak_in_flight": 3, "total": 3, "aborted": 0}
            nursery.cancel_scope.cancel()  # the clients give up and close their connections
        assert await wait_for_stats(served.client, idle) == {
            "in_flight": 0,
            "peak_in_flight": 3,
            "total": 3,
            "aborted": 3,
        }
        reset = await served.client.post("/stats/reset")
    assert reset.json() == {"in_flight": 0, "peak_in_flight": 0, "total": 0, "aborted": 0}
    assert served.backend.stats() == reset.json()


async def _post_chat(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json={"max_tokens": 1})


async def test_reset_keeps_in_flight(served: Served) -> None:
    served.backend.latency = 60.0
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_post_chat, served.client)
            await wait_for_stats(served.client, lambda s: s["in_flight"] == 1)
            reset = (await served.client.post("/stats/reset")).json()
            nursery.cancel_scope.cancel()
        await wait_for_stats(served.client, idle)
    assert reset == {"in_flight": 1, "peak_in_flight": 1, "total": 0, "aborted": 0}


async def test_abandoned_stream_releases_in_flight(served: Served) -> None:
    """A client that closes its socket mid-stream: the server notices, in_flight returns to 0.

    A raw socket client, because httpx's nested response iterators cannot all be closed early
    (trio would report them as unclosed async generators).
    """
    served.backend.tokens_per_second = 100  # 1,000 tokens would take 10 s
    body = b'{"max_tokens": 1000, "stream": true}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    port = int(served.base_url.rsplit(":", 1)[1])
    with trio.fail_after(TIMEOUT):
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(request)
            received = b""
            while b"data: " not in received:
                chunk = await stream.receive_some()
                assert chunk, received
                received += chunk
            assert received.startswith(b"HTTP/1.1 200")
            assert (await served.client.get("/stats")).json()["in_flight"] == 1
        stats = await wait_for_stats(served.client, idle)
    assert stats == {"in_flight": 0, "peak_in_flight": 1, "total": 1, "aborted": 1}


async def test_usage_counts_the_prompt_and_the_generated_tokens(served: Served) -> None:
    """Every generation path reports prompt_tokens = prompt characters / prompt_chars_per_token
    and total_tokens = prompt + max_tokens (what tenant_cost: tokens settles with)."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 16}
    with trio.fail_after(TIMEOUT):
        whole = (await served.client.post("/v1/chat/completions", json=chat)).json()
        streamed = await served.client.post(
            "/v1/chat/completions", json=chat | {"stream": True, "stream_options": {"include_usage": True}}
        )
        legacy = (await served.client.post("/v1/completions", json={"prompt": "y" * 40, "max_tokens": 2})).json()
        ollama = (await served.client.post("/api/chat", json=chat | {"stream": False})).json()
        served.backend.prompt_chars_per_token = 5.0
        fewer = (await served.client.post("/v1/chat/completions", json=chat)).json()
    assert whole["usage"] == {"prompt_tokens": 100, "completion_tokens": 16, "total_tokens": 116}
    assert json.loads(sse_events(streamed.text)[-2])["usage"] == whole["usage"]
    assert legacy["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    assert (ollama["prompt_eval_count"], ollama["eval_count"]) == (100, 16)
    assert fewer["usage"] == {"prompt_tokens": 80, "completion_tokens": 16, "total_tokens": 96}


async def test_ollama_chat_stream_and_non_stream(served: Served) -> None:
    served.backend.tokens_per_second = 2000
    request = {"model": "qwen3:35b", "messages": [{"role": "user", "content": "hi"}]}
    with trio.fail_after(TIMEOUT):
        default = await served.client.post("/api/chat", json=request | {"options": {"num_predict": 3}})
        whole = await served.client.post("/api/chat", json=request | {"stream": False})
    assert default.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in default.text.splitlines()]
    assert [(line["message"]["content"], line["done"]) for line in lines] == [
        *[("tok ", False)] * 3,
        ("", True),
    ]
    assert lines[-1]["model"] == "qwen3:35b"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", lines[-1]["created_at"])
    body = whole.json()
    assert body["done"] is True and body["message"]["content"] == "tok " * 16


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/v1/chat/completions", b"{not json", "invalid_json"),
        ("/v1/completions", b"[1, 2]", "invalid_json"),
        ("/api/chat", b"\xff", "invalid_json"),
        ("/v1/chat/completions", b'{"max_tokens": "lots"}', "invalid_value"),
    ],
)
async def test_bad_request_is_400_with_openai_error(served: Served, path: str, body: bytes, code: str) -> None:
    with trio.fail_after(TIMEOUT):
        response = await served.client.post(path, content=body)
        stats = (await served.client.get("/stats")).json()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]
    assert stats["total"] == 0


async def test_unknown_path_404_and_wrong_method_405(served: Served) -> None:
    with trio.fail_after(TIMEOUT):
        missing = await served.client.get("/v1/rerank")
        wrong = await served.client.get("/v1/chat/completions")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


# --- the CLI --------------------------------------------------------------------------------


async def test_cli_prints_bound_url_and_exits_on_sigterm() -> None:
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "iop_mock",
            "--port",
            "0",
            "--latency-ms",
            "1",
            "--tokens-per-second",
            "0",
            "--model",
            "a",
            "--model",
            "b",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        with trio.fail_after(TIMEOUT):
            assert process.stderr is not None
            received = b""
            while b"\n" not in received:
                chunk = await process.stderr.receive_some()
                assert chunk, f"iop-mock-backend exited early: {received!r}"
                received += chunk
            ready = rb"iop-mock-backend listening on (http://127\.0\.0\.1:\d+)\n"
            match = re.search(ready, received)
            assert match, received
            async with httpx.AsyncClient(base_url=match[1].decode()) as client:
                models = (await client.get("/v1/models")).json()
                chat = await client.post("/v1/chat/completions", json={"max_tokens": 1})
            assert [m["id"] for m in models["data"]] == ["a", "b"]
            assert chat.json()["choices"][0]["message"]["content"] == "tok "
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await process.wait()
        if process.stderr is not None:
            await process.stderr.aclose()


def test_cli_rejects_negative_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--latency-ms", "-1"])
    assert exit_info.value.code == 2
    assert "must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--prompt-chars-per-token", "0"])
    assert exit_info.value.code == 2
    assert "must be > 0" in capsys.readouterr().err


async def test_fault_makes_generation_fail_until_healed(served: Served) -> None:
    """POST /fault {"status": 500}: every generation request answers 500 (OpenAI error body, not
    counted); {"status": null} heals it; a bad status is refused."""
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with trio.fail_after(10):
        assert (await served.client.post("/fault", json={"status": 500})).json() == {"status": 500}
        failed = await served.client.post("/v1/chat/completions", json=body)
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "mock_fault"
        assert failed.json()["error"]["type"] == "server_error"
        assert (await served.client.get("/stats")).json()["total"] == 0
        refused = await served.client.post("/fault", json={"status": 200})
        assert refused.status_code == 400
        assert served.backend.fail_status == 500
        assert (await served.client.post("/fault", json={"status": None})).json() == {"status": None}
        healed = await served.client.post("/v1/chat/completions", json=body)
        assert healed.status_code == 200


async def test_track_repeats_counts_bodies_served_before(served: Served) -> None:
    """``track_repeats``: a request whose body repeats one served since the last reset counts in
    ``repeated`` (a test whose requests are all unique checks that nothing ran twice)."""
    assert "repeated" not in served.backend.stats()  # off by default
    served.backend.track_repeats = True
    with trio.fail_after(TIMEOUT):
        for content in ("a", "b", "a", "a"):
            answer = await served.client.post(
                "/v1/chat/completions", json={"max_tokens": 1, "messages": [{"role": "user", "content": content}]}
            )
            assert answer.status_code == 200
        assert (await served.client.get("/stats")).json()["repeated"] == 2
        reset = (await served.client.post("/stats/reset")).json()
        assert reset["repeated"] == 0
        await served.client.post(
            "/v1/chat/completions", json={"max_tokens": 1, "messages": [{"role": "user", "content": "a"}]}
        )
        assert (await served.client.get("/stats")).json() == {
            "in_flight": 0,
            "peak_in_flight": 1,
            "total": 1,
            "aborted": 0,
            "repeated": 0,
        }
