"""The listener's plain lane (``iop_edge._plain_http``): iop_http reads what h11 reads, the answers are the
bytes h11 writes, and any other answer goes through h11 with the bytes that followed the request."""

from __future__ import annotations

from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from edge.harness import h11_answer
from iop_edge._http_cycle import CONNECTION
from iop_edge._http_server import HttpLimits, serve_http
from iop_edge._plain_http import parse_plain, plain_response

PLAIN_POST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"


def _h11_answer(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes | None:
    """The bytes h11 writes for this whole answer to a plain request; None when it refuses to."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    conn.next_event()
    conn.next_event()
    try:
        return b"".join(
            conn.send(e) or b""
            for e in (h11.Response(status_code=status, headers=headers, reason=b""), h11.Data(data=body))
        ) + (conn.send(h11.EndOfMessage()) or b"")
    except h11.LocalProtocolError:
        return None


def _h11_request(data: bytes) -> tuple[h11.Request, bytes]:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    request = conn.next_event()
    assert isinstance(request, h11.Request)
    body = b""
    while isinstance(event := conn.next_event(), h11.Data):
        body += event.data
    assert isinstance(event, h11.EndOfMessage)
    return request, body


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (200, [(b"content-type", b"application/json"), (b"content-length", b"11")], b'{"ok":true}'),
        (200, [(b"Content-Length", b"0"), (b"x-request-id", b"r-1"), (b"x-empty", b"")], b""),
        (429, [(b"retry-after", b"1"), (b"content-length", b"4")], b"full"),
        (503, [(b"content-length", b"2"), (b"x-obs", b"caf\xc3\xa9 ok")], b"no"),
    ],
)
def test_a_plain_answer_is_the_bytes_h11_writes(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    assert plain_response(status, headers, body) == _h11_answer(status, headers, body) is not None


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (200, [], b"no length"),  # h11 would frame it as chunks
        (200, [(b"content-length", b"3")], b"four"),  # h11 refuses it
        (200, [(b"content-length", b"2"), (b"content-length", b"2")], b"hi"),  # h11 merges them
        (200, [(b"content-length", b"2"), (b"connection", b"close")], b"hi"),  # h11 rewrites it
        (200, [(b"content-length", b"2"), (b"transfer-encoding", b"chunked")], b"hi"),
        (200, [(b"host", b"x"), (b"content-length", b"2")], b"hi"),  # h11 writes host first
        (200, [(b"content-length", b"2"), (b"bad name", b"x")], b"hi"),
        (200, [(b"content-length", b"2"), (b"x-split", b"a\r\nset-cookie: b")], b"hi"),
        (200, [(b"content-length", b"2"), (b"x-padded", b" a")], b"hi"),
        (204, [(b"content-length", b"0")], b""),  # no body allowed: h11's framing rules
        (101, [(b"content-length", b"0")], b""),
    ],
)
def test_an_answer_h11_would_write_otherwise_is_not_plain(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    assert plain_response(status, headers, body) is None


_NAMES = st.sampled_from([b"content-length", b"Content-Length", b"x-a", b"host", b"connection", b"bad name", b"x:y"])
_VALUES = st.sampled_from(
    [b"", b"0", b"2", b"02", b"a b", b" a", b"a\t", b"a\r\nb", b"\x00", b"\xff", b"close", b"2, 2"]
)


@given(
    status=st.sampled_from([100, 200, 204, 304, 404, 999]),
    headers=st.lists(st.tuples(_NAMES, _VALUES), max_size=4),
    body=st.sampled_from([b"", b"hi", b"x" * 10]),
)
def test_a_plain_answer_is_h11s_or_none(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """Whatever the answer, the plain lane writes h11's bytes or leaves the answer to h11."""
    plain = plain_response(status, headers, body)
    assert plain is None or plain == _h11_answer(status, headers, body)


@pytest.mark.parametrize(
    "data",
    [
        PLAIN_POST + b"content-length: 2\r\n\r\nhi",
        b"GET /status?x=%20y HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer k\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost:   x  \r\nauthorization:\t Bearer k \t\r\nx-empty:  \r\n\r\n",  # whitespace around
        b"POST /v1/embeddings HTTP/1.1\r\nhost: e\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n",
    ],
)
def test_a_plain_request_reads_as_h11_reads_it(data: bytes) -> None:
    plain = parse_plain(data, 65536)
    request, body = _h11_request(data)
    assert plain is not None and plain.raw == data and plain.body == body
    assert (plain.method, plain.target, plain.http_version) == (request.method, request.target, request.http_version)
    assert plain.headers == list(request.headers)


_PIECES = st.sampled_from(
    [b"a", b"/", b" ", b"\t", b":", b"\r\n", b"\n", b"\x00", b"\x7f", b"\xe9", b"0", b",", b"?", b"%"]
)
_TEXT = st.lists(_PIECES, max_size=3).map(b"".join)


@given(
    method=st.sampled_from([b"GET", b"POST", b"get", b"HEAD"]),
    target=_TEXT,
    version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]),
    host=st.one_of(st.just(b"x"), _TEXT),
    headers=st.lists(
        st.tuples(st.sampled_from([b"x-a", b"Host", b"content-length", b"connection", b"x a", b"x-b "]), _TEXT),
        max_size=2,
    ),
    body=st.sampled_from([b"", b"hi"]),
)
def test_a_request_read_in_the_plain_lane_reads_as_h11_reads_it(
    method: bytes, target: bytes, version: bytes, host: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """Whatever the bytes, the plain lane reads h11's request or leaves the bytes to h11."""
    lines = [b"%b /%b %b" % (method, target, version), b"host: " + host]
    lines += [b"%b:%b" % h for h in headers]
    if body:
        lines.append(b"content-length: 2")
    data = b"\r\n".join(lines) + b"\r\n\r\n" + body
    plain = parse_plain(data, 65536)
    if plain is not None:
        request, h11_body = _h11_request(data)
        assert (plain.method, plain.target, plain.headers, plain.body) == (
            request.method,
            request.target,
            list(request.headers),
            h11_body,
        )


@pytest.mark.parametrize(
    ("data", "max_head_bytes"),
    [
        (PLAIN_POST + b"content-length: 5\r\n\r\nhi", 65536),  # the body is still on its way
        (PLAIN_POST + b"content-length: 2\r\n", 65536),  # so is the head
        (PLAIN_POST + b"content-length: 2\r\n\r\nhiGET / HTTP/1.1\r\nhost: x\r\n\r\n", 65536),  # pipelined
        (PLAIN_POST + b"transfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n", 65536),
        (PLAIN_POST + b"expect: 100-continue\r\ncontent-length: 2\r\n\r\nhi", 65536),
        (PLAIN_POST + b"connection: close\r\ncontent-length: 2\r\n\r\nhi", 65536),
        (PLAIN_POST + b"content-length: 2\r\n\r\nhi", 64),  # a head over the limit: h11 answers 431
        (b"GET / HTTP/1.0\r\nhost: x\r\n\r\n", 65536),
        (b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n", 65536),
        (b"GET / HTTP/1.1\r\n\r\n", 65536),  # no host: h11 answers 400
        (b"GET / HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 65536),
        (b"GET / HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n", 65536),
        (b"\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n", 65536),
        (b"GET / HTTP/1.1\r\nhost x\r\n\r\n", 65536),  # malformed
    ],
)
def test_any_other_request_is_left_to_h11(data: bytes, max_head_bytes: int) -> None:
    assert parse_plain(data, max_head_bytes) is None


async def test_a_plain_request_answered_as_a_stream_goes_through_h11_with_the_request_behind_it() -> None:
    """A plain request whose answer is not plain (a stream of chunks) is handed to h11 together with the
    next request the client sent meanwhile (read by the disconnect watch); both are answered in order."""
    release = trio.Event()
    watching = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        if scope["path"] == "/stream":
            with trio.CancelScope() as cancel_scope:
                scope["extensions"][CONNECTION].cancel_on_disconnect(cancel_scope)
                watching.set()
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": message["body"], "more_body": True})
            await send({"type": "http.response.body", "body": b";end", "more_body": False})
        else:
            body = scope["path"].encode()
            headers = [(b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port: int = await nursery.start(
                lambda task_status: serve_http(
                    app, "127.0.0.1", 0, limits=HttpLimits(header_timeout=5), task_status=task_status
                )
            )
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            client = h11.Connection(h11.CLIENT)
            await stream.send_all(b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nfirst")
            await watching.wait()
            await stream.send_all(b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()  # the watch has read /next by now
            release.set()
            answers = []
            for target in ("/stream", "/next"):
                client.send(h11.Request(method="GET", target=target, headers=[("host", "x")]))
                client.send(h11.EndOfMessage())
                response, body = await h11_answer(client, stream)
                answers.append((body, (b"transfer-encoding", b"chunked") in list(response.headers)))
                client.start_next_cycle()
            assert answers == [(b"first;end", True), (b"/next", False)]
            await stream.aclose()
            nursery.cancel_scope.cancel()
