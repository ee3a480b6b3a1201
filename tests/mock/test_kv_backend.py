"""[token-ledger] The HTTP mock with a KV budget (``--kv-tokens``): overcommitted directly, over real
sockets, it preempts and slows down (mode ``preempt``) or fails (modes ``fail``: every sequence in
progress, as llama.cpp's server; ``fail-newest``: the newest), refuses a request past
its ``n_ctx`` at once, and its ``/metrics``, ``/slots`` and ``/stats`` report the pool's real figures.

The overcommit: a pool of 600 tokens; A (prompt 10 tokens, 290 to generate: 300 at its end) runs
first, B (prompt 280, 290 to generate: 570) comes once A's first token has. Each fits alone, and B
starts beside A whenever it comes (A holds 10 + g, B needs 280); together they grow by two a step
and run out before A ends as long as B comes before A's 270th token (2.7 s at 100 tokens/s): the
newest, B, is evicted (``preempt``); in mode ``fail`` both fail.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import trio
import trio.testing
from tests.mock.test_backend import FakeASGIClient, http_scope

from iop_mock import MockBackend, serve_mock_backend
from iop_mock.cli import kv_of, parse_args
from iop_mock.kv_driver import KV_CACHE_FULL, KvDriver

pytestmark = pytest.mark.req("token-ledger")

TIMEOUT = 30.0
POOL = 600
A = {"messages": [{"role": "user", "content": "a" * 40}], "max_tokens": 290}
B = {"messages": [{"role": "user", "content": "b" * 1120}], "max_tokens": 290}


async def served(nursery: trio.Nursery, mode: str, *, n_ctx: int = POOL) -> AsyncIterator[httpx.AsyncClient]:
    backend = MockBackend(kv=KvDriver.build(POOL, n_ctx, mode, tokens_per_second=100, prefill_tokens_per_second=0))
    port = await nursery.start(serve_mock_backend, backend)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as client:
        yield client


@pytest.fixture
async def preempting(nursery: trio.Nursery) -> AsyncIterator[httpx.AsyncClient]:
    async for client in served(nursery, "preempt"):
        yield client


@pytest.fixture
async def failing(nursery: trio.Nursery) -> AsyncIterator[httpx.AsyncClient]:
    async for client in served(nursery, "fail", n_ctx=580):
        yield client


def tokens_in(text: str) -> int:
    return sum(json.loads(line[6:])["choices"][0]["delta"].get("content") == "tok " for line in _data(text))


def _data(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("data: {")]


async def until(client: httpx.AsyncClient, path: str, done: Callable[[str], bool]) -> str:
    """GET ``path`` until ``done(body)``; bounded by the caller's ``fail_after``."""
    while not done(text := (await client.get(path)).text):
        await trio.sleep(0.005)
    return text


async def overcommit(client: httpx.AsyncClient, b_stream: bool) -> tuple[str, httpx.Response]:
    """Stream A; once its first token came (and the pool is seen holding it), send B; both answers."""
    answers: list[httpx.Response] = []
    async with client.stream("POST", "/v1/chat/completions", json=A | {"stream": True}) as a:
        lines = a.aiter_lines()
        head = [line async for line in _until_token(lines)]
        slots = json.loads(await until(client, "/slots", lambda t: '"is_processing":true' in t))
        assert [(s["n_prompt_tokens"], s["n_ctx"]) for s in slots if s["is_processing"]] == [(10, POOL // 4)]
        metrics = await client.get("/metrics")
        assert 'vllm:num_requests_running{model_name="mock"} 1' in metrics.text
        async with trio.open_nursery() as nursery:

            async def ask_b() -> None:
                answers.append(await client.post("/v1/chat/completions", json=B | {"stream": b_stream}))

            nursery.start_soon(ask_b)
            rest = [line async for line in lines]
    return "\n".join(head + rest), answers[0]


async def _until_token(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    async for line in lines:
        yield line
        if '"content"' in line:
            return


async def test_an_overcommitted_pool_preempts_the_newest_and_it_recomputes_and_finishes(
    preempting: httpx.AsyncClient,
) -> None:
    client = preempting
    with trio.fail_after(TIMEOUT):
        a_text, b = await overcommit(client, b_stream=True)
        stats = (await client.get("/stats")).json()
    assert b.status_code == 200
    assert (tokens_in(a_text), tokens_in(b.text)) == (290, 290)  # B paused, recomputed, then went on
    assert b.text.endswith("data: [DONE]\n\n")
    assert stats["preemptions"] >= 1 and stats["context_errors"] == 0
    assert (stats["kv_used"], stats["kv_total"]) == (0, POOL) and 570 < stats["kv_peak"] <= POOL
    metrics = (await client.get("/metrics")).text
    assert f'vllm:num_preemptions_total{{model_name="mock"}} {stats["preemptions"]}' in metrics
    assert 'vllm:kv_cache_usage_perc{model_name="mock"} 0\n' in metrics


async def test_past_n_ctx_is_refused_at_once_and_a_full_pool_fails_every_sequence(
    failing: httpx.AsyncClient,
) -> None:
    """Mode ``fail``, ``n_ctx`` 580: B asking 400 tokens (680) is a context error at once (400, not
    counted in flight); B (570) starts beside A and the pool runs out: both fail, as in llama.cpp's
    server: B with a 500 (its answer whole, not begun), A's stream with an error frame after the
    tokens it had."""
    client = failing
    with trio.fail_after(TIMEOUT):
        refused = await client.post("/v1/chat/completions", json=B | {"max_tokens": 400})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("context_length_exceeded", "invalid_request_error")
        assert "maximum context length is 580 tokens" in error["message"] and "680 tokens" in error["message"]
        a_text, b = await overcommit(client, b_stream=False)
        stats = (await client.get("/stats")).json()
    assert b.status_code == 500 and b.json()["error"]["code"] == "kv_cache_full"
    assert b.json()["error"]["message"] == KV_CACHE_FULL
    *tokens, last = _data(a_text)
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "kv_cache_full" and "[DONE]" not in a_text
    assert 0 < tokens_in("\n".join(tokens)) < 290
    assert (stats["context_errors"], stats["preemptions"], stats["kv_used"], stats["total"]) == (3, 0, 0, 2)


def test_the_command_line_turns_the_budget_on_and_off() -> None:
    assert kv_of(parse_args([])) is None
    driver = kv_of(parse_args(["--kv-tokens", "4096", "--kv-mode", "fail", "--tokens-per-second", "50"]))
    assert driver is not None
    engine = driver.engine
    assert (engine.total, engine.n_ctx, engine.mode, engine.step_seconds) == (4096, 4096, "fail", 0.02)
    driver = kv_of(parse_args(["--kv-tokens", "8192", "--n-ctx", "2048", "--prefill-tokens-per-second", "1000"]))
    assert driver is not None
    assert (driver.engine.n_ctx, driver.engine.mode, driver.engine.prefill_seconds) == (2048, "preempt", 0.001)
    assert (driver.engine.prefill_per_step, driver.engine.read_seconds) == (8192, 0.0)
    driver = kv_of(parse_args(["--kv-tokens", "8192", "--prefill-chunk-tokens", "2048", "--kv-read-ns", "80"]))
    assert driver is not None
    assert (driver.engine.prefill_per_step, driver.engine.read_seconds) == (2048, pytest.approx(8e-8))
    assert (parse_args([]).parallel, parse_args(["--parallel", "256"]).parallel) == (4, 256)
    for bad in (
        ["--n-ctx", "10"],
        ["--kv-tokens", "-1"],
        ["--kv-tokens", "10", "--kv-mode", "swap"],
        ["--kv-tokens", "10", "--prefill-chunk-tokens", "0"],
        ["--kv-tokens", "10", "--kv-read-ns", "-1"],
        ["--parallel", "0"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


async def test_every_route_runs_in_the_pool_and_a_client_leaving_frees_its_cache(
    preempting: httpx.AsyncClient,
) -> None:
    client = preempting
    prompt = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 3}
    with trio.fail_after(TIMEOUT):
        ollama = await client.post("/api/chat", json=prompt)
        lines = [json.loads(line) for line in ollama.text.splitlines()]
        assert [line["message"]["content"] for line in lines] == ["tok "] * 3 + [""]
        assert (lines[-1]["done"], lines[-1]["prompt_eval_count"]) == (True, 10)
        whole = await client.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 3})
        assert whole.json()["choices"][0]["text"] == "tok " * 3
        nothing = await client.post("/api/chat", json={"messages": prompt["messages"], "options": {"num_predict": -1}})
        assert [json.loads(line)["done"] for line in nothing.text.splitlines()] == [True]  # no token, one step
        payload = json.dumps(A | {"stream": True}).encode()
        async with await trio.open_tcp_stream("127.0.0.1", client.base_url.port or 0) as left:
            await left.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            received = b""
            while b'"content":"tok "' not in received:  # the first token: its sequence holds the pool
                received += await left.receive_some()
            assert (await client.get("/stats")).json()["kv_used"] >= 11
        stats = json.loads(await until(client, "/stats", lambda t: json.loads(t)["in_flight"] == 0))
    assert (stats["kv_used"], stats["aborted"], stats["preemptions"], stats["total"]) == (0, 1, 0, 4)


async def test_a_preempted_stream_pauses_and_pays_its_prefill_again_on_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A pool of 12; a step 0.1 s plus 0.1 s a prompt token prefilled; two streams of prompt 4 and 6
    tokens. Both start (8) and prefill: the first step lasts 0.9 s; their second tokens fill the pool;
    the third step evicts the newer, which waits until the older ends (1.4 s), then prefills its prompt
    and its 2 tokens again (0.7 s) and goes on: its tokens at 0.9, 1.0, then 2.1 to 2.4, where the
    older's come every 0.1 s from 0.9 to 1.4."""
    backend = MockBackend(kv=KvDriver.build(12, 12, "preempt", tokens_per_second=10, prefill_tokens_per_second=10))
    body = json.dumps({"messages": [{"content": "x" * 16}], "max_tokens": 6, "stream": True}).encode()
    fakes = FakeASGIClient(body), FakeASGIClient(body)
    async with trio.open_nursery() as nursery:  # which enters first is the scheduler's choice
        for fake in fakes:
            nursery.start_soon(backend.app, http_scope("POST", "/v1/chat/completions"), fake.receive, fake.send)
    older, newer = sorted(_token_times(fake) for fake in fakes)
    assert older == [0.9, 1.0, 1.1, 1.2, 1.3, 1.4]
    assert newer == [0.9, 1.0, 2.1, 2.2, 2.3, 2.4]
    stats = backend.stats()
    assert (stats["in_flight"], stats["aborted"], stats["total"]) == (0, 0, 2)
    assert (stats["preemptions"], stats["context_errors"], stats["kv_used"], stats["kv_peak"]) == (1, 0, 0, 12)


def _token_times(fake: FakeASGIClient) -> list[float]:
    """When each token left, one entry per token (a message may carry several)."""
    return [round(t, 6) for t, message in fake.sent for _ in range(message.get("body", b"").count(b'"content":"tok "'))]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
@pytest.mark.parametrize("mode", ["fail", "fail-newest"])
async def test_a_stream_failed_past_the_pool_ends_with_an_error_frame(
    autojump_clock: trio.testing.MockClock, path: str, mode: str
) -> None:
    """The pool of the test above: the third step does not fit. Mode ``fail-newest``: the newer
    stream fails, the older finishes; mode ``fail`` (llama.cpp): both fail. A failed stream's two
    tokens went out, then an error ends it (an OpenAI error object as SSE data, Ollama's
    ``{"error": ...}`` line), with no ``[DONE]`` or ``done`` line."""
    backend = MockBackend(kv=KvDriver.build(12, 12, mode, tokens_per_second=10, prefill_tokens_per_second=10))
    body = json.dumps({"messages": [{"content": "x" * 16}], "max_tokens": 6, "stream": True}).encode()
    fakes = FakeASGIClient(body), FakeASGIClient(body)
    async with trio.open_nursery() as nursery:
        for fake in fakes:
            nursery.start_soon(backend.app, http_scope("POST", path), fake.receive, fake.send)
    texts = sorted((b"".join(m.get("body", b"") for _, m in fake.sent).decode() for fake in fakes), key=len)
    cut = texts if mode == "fail" else texts[:1]
    if mode == "fail-newest":
        assert texts[1].count("tok ") == 6
    for text in cut:
        assert text.count("tok ") == 2
        last = text.strip().splitlines()[-1]
        if path == "/api/chat":
            assert json.loads(last) == {"error": KV_CACHE_FULL} and '"done":true' not in text
        else:
            assert json.loads(last.removeprefix("data: "))["error"]["code"] == "kv_cache_full" and "[DONE]" not in text
    stats = backend.stats()
    assert (stats["context_errors"], stats["preemptions"], stats["kv_used"], stats["in_flight"]) == (len(cut), 0, 0, 0)
