"""[http-framing] The Edge's listener on real sockets: every framing refusal closes the connection, the
request pipelined behind it never runs, and a new connection is served."""

from __future__ import annotations

import pytest
import trio

from framing.listener import MARKER, exchange, listening, statuses
from iop_http import Refusal, accept_head, find_head_end

POST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
SMUGGLED = b"POST /admin/reload HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"

REFUSED = [
    # RFC 9112 6.1, 6.3: Content-Length beside Transfer-Encoding; the smuggled request rides in the chunks.
    (POST + b"content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED, 400),
    (POST + b"transfer-encoding: chunked\r\ncontent-length: 4\r\n\r\n0\r\n\r\n" + SMUGGLED, 400),
    # RFC 9112 5.2: obs-fold, here carrying a Transfer-Encoding beside a Content-Length.
    (POST + b"content-length: 4\r\nx-a: b\r\n transfer-encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED, 400),
    (POST + b"x-a: b\r\n\tc\r\ncontent-length: 0\r\n\r\n", 400),
    # RFC 9112 6.1: a transfer coding other than a final chunked.
    (POST + b"transfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
    (POST + b"transfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n", 501),
    (POST + b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", 501),
    (POST + b"transfer-encoding : chunked\r\n\r\n0\r\n\r\n", 400),  # RFC 9112 5.1: space before the colon
    # RFC 9110 8.6: Content-Length not 1*DIGIT, or several not byte for byte the same.
    (POST + b"content-length: +4\r\n\r\nabcd", 400),
    (POST + b"content-length: 0x4\r\n\r\nabcd", 400),
    (POST + b"content-length: 4, 4\r\n\r\nabcd", 400),
    (POST + b"content-length: 4\r\ncontent-length: 5\r\n\r\nabcd", 400),
    (POST + b"content-length: 4\r\ncontent-length: 04\r\n\r\nabcd", 400),  # the same number, spelt otherwise
    (POST + b"content-length: 1_0\r\n\r\nabcdefghij", 400),
    # RFC 9112 2.2: a bare LF or CR as a line end.
    (b"POST /v1/chat/completions HTTP/1.1\nhost: x\ncontent-length: 0\n\n", 400),
    (POST + b"x-a: b\rcontent-length: 0\r\n\r\n", 400),
    # RFC 9112 3.2: the request target and Host.
    (b"GET marker HTTP/1.1\r\nhost: x\r\n\r\n", 400),
    (b"GET * HTTP/1.1\r\nhost: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\nhost: x\r\n\r\n", 505),
]


@pytest.mark.req("http-framing")
@pytest.mark.parametrize(("request_bytes", "status"), REFUSED)
async def test_a_refused_request_closes_and_the_request_behind_it_never_runs(request_bytes: bytes, status: int) -> None:
    """[http-framing] The refusal is the module's, its body fixed text; nothing after it runs; a new
    connection is served."""
    with trio.fail_after(10):
        async with listening() as backend:
            received = await exchange(backend.port, request_bytes + MARKER)
            verdict = accept_head(request_bytes[: find_head_end(request_bytes)])
            if find_head_end(request_bytes) > 0:
                assert isinstance(verdict, Refusal) and verdict.status == status
            answers = statuses(received)
            assert [s for s, _ in answers] == [status], received
            assert b"connection: close" in received.lower()
            assert b"marker" not in answers[0][1] and b"x-a" not in answers[0][1]  # never the request's bytes
            assert backend.ran == []
            assert statuses(await exchange(backend.port, MARKER)) == [(200, b"ran /marker")]
            assert backend.count("/marker") == 1


MALFORMED_CHUNKS = [
    b"10000000000000000\r\n",  # 17 hex digits: a size past 2**64
    b"0x4\r\nabcd\r\n0\r\n\r\n",
    b"+4\r\nabcd\r\n0\r\n\r\n",
    b"-4\r\nabcd\r\n0\r\n\r\n",
    b" 4\r\nabcd\r\n0\r\n\r\n",
    b"4\r\nabcdef\r\n0\r\n\r\n",  # data longer than its size
    b"4\nabcd\r\n0\r\n\r\n",
    b"4\r\nabcd\r\n0\r\nx-a b\r\n\r\n",  # a malformed trailer
]


@pytest.mark.req("http-framing")
@pytest.mark.parametrize("body", MALFORMED_CHUNKS)
async def test_malformed_chunk_framing_is_400_and_close(body: bytes) -> None:
    """[http-framing] RFC 9112 7.1: malformed chunk framing is answered 400 and the connection closed."""
    with trio.fail_after(10):
        async with listening() as backend:
            received = await exchange(backend.port, POST + b"transfer-encoding: chunked\r\n\r\n" + body + MARKER)
            assert [s for s, _ in statuses(received)] == [400], received
            assert backend.count("/marker") == 0 and all(p != "/v1/chat/completions" for _, p, _ in backend.ran)
            assert statuses(await exchange(backend.port, MARKER)) == [(200, b"ran /marker")]


@pytest.mark.req("http-framing")
async def test_a_head_over_the_limit_is_431_however_many_reads_bring_it() -> None:
    """[http-framing] RFC 6585 5: a head past the limit is 431, even when no read alone holds the limit."""
    with trio.fail_after(10):
        async with listening(max_head_bytes=4096) as backend:
            half = b"x-pad: " + b"a" * 3000 + b"\r\n"
            received = await exchange(backend.port, POST, half, half, b"content-length: 0\r\n\r\n" + MARKER)
            assert [s for s, _ in statuses(received)] == [431]
            assert backend.ran == []


@pytest.mark.req("http-framing")
async def test_a_refusal_before_a_100_continue_body_closes_the_connection() -> None:
    """[http-framing] RFC 9110 10.1.1: a 401 to ``expect: 100-continue`` closes the connection, so the
    next request is never read as the body the client held back."""
    with trio.fail_after(10):
        async with listening() as backend:
            deny = b"POST /deny HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 34\r\n\r\n"
            received = await exchange(backend.port, deny + MARKER)
            assert statuses(received) == [(401, b"denied")]
            assert backend.count("/marker") == 0


@pytest.mark.req("http-framing")
@pytest.mark.parametrize(
    ("target", "path"),
    [(b"http://edge.example/v1/models?x=1", "/v1/models"), (b"https://edge.example", "/"), (b"/plain", "/plain")],
)
async def test_an_absolute_form_target_is_routed_by_its_path(target: bytes, path: str) -> None:
    """[http-framing] RFC 9112 3.2.2: a server accepts an absolute-form target; it is routed by its path."""
    with trio.fail_after(10):
        async with listening() as backend:
            received = await exchange(backend.port, b"GET %b HTTP/1.1\r\nhost: x\r\n\r\n" % target + MARKER)
            assert statuses(received) == [(200, b"ran " + path.encode()), (200, b"ran /marker")]
            assert [p for _, p, _ in backend.ran] == [path, "/marker"]


@pytest.mark.req("http-framing")
async def test_an_upgrade_request_is_answered_then_the_connection_closes() -> None:
    """[http-framing] RFC 9110 7.8: a request asking for a protocol upgrade is answered as a plain one
    (no switch) and the connection closes after it: llhttp reads nothing after an upgrade, so the
    request pipelined behind it never runs."""
    with trio.fail_after(10):
        async with listening() as backend:
            upgrade = b"GET /up HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n"
            received = await exchange(backend.port, upgrade + MARKER)
            assert statuses(received) == [(200, b"ran /up")]
            assert b"connection: close" in received.lower()
            assert backend.count("/marker") == 0
