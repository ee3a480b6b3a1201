"""The benchmarks' HTTP client (``benchmarks.harness.HttpConnection``) against the mock backend, on loopback.

The load generator measures every server with it, so a misread answer would be
a wrong figure: each answer is parsed once (httptools), whole or streamed, and
the connection is reused while the server keeps it open.
"""

from __future__ import annotations

import json

import trio
from benchmarks import fairness
from benchmarks.harness import HttpConnection, percentile

from iop_mock import MockBackend, serve_mock_backend

TIMEOUT = 10.0


async def test_client_reads_whole_and_streamed_answers_on_one_connection(nursery: trio.Nursery) -> None:
    backend = MockBackend(latency=0.0, tokens_per_second=0)
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(serve_mock_backend, backend)
        connection = HttpConnection("127.0.0.1", port)
        try:
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            status, body = await connection.request(
                HttpConnection.build("POST", "/v1/chat/completions", json.dumps(chat).encode())
            )
            assert status == 200 and json.loads(body)["object"] == "chat.completion"
            assert connection.headers[b"content-type"] == b"application/json"
            pieces: list[bytes] = []
            raw = HttpConnection.build("POST", "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode())
            status, body = await connection.request(raw, pieces.append)
            assert status == 200 and body == b""
            events = b"".join(pieces)
            assert events.endswith(b"data: [DONE]\n\n") and b"\r\n" not in events  # the chunk framing is gone
            assert connection.headers[b"transfer-encoding"] == b"chunked"
            status, body = await connection.request(HttpConnection.build("GET", "/stats"))
            assert status == 200 and json.loads(body)["total"] == 2
            assert connection.opened == 1  # kept alive across all three
        finally:
            await connection.aclose()


async def test_client_reports_a_refusal_and_reconnects(nursery: trio.Nursery) -> None:
    backend = MockBackend()
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(serve_mock_backend, backend)
        connection = HttpConnection("127.0.0.1", port)
        try:
            status, body = await connection.request(b"GET /stats HTTP/1.1\r\n\r\n")  # no host: iop_http refuses
            assert (status, body) == (400, b"missing, repeated or malformed host\n")
            status, _ = await connection.request(HttpConnection.build("GET", "/stats"))  # closed: a new connection
            assert status == 200 and connection.opened == 2
        finally:
            await connection.aclose()


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (50.0, 99.0, 100.0)
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN


async def test_token_mode_requests_report_the_tokens_the_fairness_benchmark_counts(nursery: trio.Nursery) -> None:
    """benchmarks.fairness's token-mode requests: the mock (a prompt token per 5 characters) reports
    8,000 and 500 tokens for them, whole or streamed with include_usage, and the client reads it back."""
    backend = MockBackend(latency=0.0, tokens_per_second=0, prompt_chars_per_token=fairness.PROMPT_CHARS_PER_TOKEN)
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(serve_mock_backend, backend)
        connection = HttpConnection("127.0.0.1", port)
        try:
            for used, stream in ((8_000, False), (500, True), (500, False)):
                raw = HttpConnection.build("POST", "/v1/chat/completions", fairness.token_body(used, stream=stream))
                status, answer = await connection.request(raw)
                assert status == 200
                assert fairness.reported_tokens(answer) == used
        finally:
            await connection.aclose()
