"""[http-framing] :mod:`iop_http` without sockets: the request reader (heads, bodies, pipelining), the encoders."""

from __future__ import annotations

import itertools

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_http import (
    CHUNKED,
    CLOSED,
    END_OF_MESSAGE,
    LAST_CHUNK,
    MALFORMED_CHUNKS,
    NEED_DATA,
    Event,
    Refusal,
    RequestHead,
    RequestReader,
    ResponseFraming,
    accept_head,
    encode_chunk,
    encode_head,
    encode_request,
    encode_response,
    error_response,
    find_head_end,
)


@pytest.mark.req("http-framing")
def test_an_accepted_head_carries_its_framing_and_route() -> None:
    head = accept_head(
        b"POST http://edge:8080/v1/chat/completions?x=1 HTTP/1.1\r\nHost: edge\r\nContent-Length: 007\r\n"
        b"Connection: close\r\nExpect: 100-Continue\r\n\r\n"
    )
    assert isinstance(head, RequestHead)
    assert (head.path, head.length, head.keep_alive, head.expect_continue) == (
        b"/v1/chat/completions?x=1",
        7,
        False,
        True,
    )
    assert head.headers[0] == (b"host", b"edge")
    assert head.size == 132  # every byte through the empty line
    chunked = accept_head(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: Chunked\r\n\r\n")
    assert isinstance(chunked, RequestHead) and chunked.length == CHUNKED and chunked.keep_alive


def _read(reader: RequestReader, *reads: bytes) -> list[Event]:
    """Feed ``reads`` one by one (``b""``: the client's end) and collect the events, body bytes joined."""
    events: list[Event] = []
    for data in reads:
        reader.feed(data)
        while (event := reader.next_event()) is not NEED_DATA:
            if type(event) is bytes and events and type(events[-1]) is bytes:
                events[-1] += event
            else:
                events.append(event)
            if event is CLOSED:
                return events
    return events


@pytest.mark.req("http-framing")
def test_a_head_not_yet_whole_is_refused_as_soon_as_it_cannot_be_accepted() -> None:
    """A bare LF is refused before the head ends; past the limit it is 431 however many reads brought it."""
    assert _read(RequestReader(4096), b"GET / HTTP/1.1\r\nhost: x\r\n\r") == []  # a CR at the end: wait
    assert _read(RequestReader(4096), b"GET / HTTP/1.1\nhost") == [
        Refusal(400, "bare CR or LF in the request head"),
        CLOSED,
    ]
    pad = b"x-pad: " + b"a" * 3000 + b"\r\n"
    assert _read(RequestReader(4096), b"GET / HTTP/1.1\r\n", pad, pad) == [
        Refusal(431, "request head too large"),
        CLOSED,
    ]
    assert accept_head(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", 16) == Refusal(431, "request head too large")


_BODY = st.binary(max_size=40)


@pytest.mark.req("http-framing")
@given(pieces=st.lists(_BODY, max_size=4), cuts=st.lists(st.integers(0, 300), max_size=6))
def test_a_chunked_body_reads_the_same_whatever_the_reads(pieces: list[bytes], cuts: list[int]) -> None:
    """Chunks with an extension and a trailer, cut into arbitrary reads, read as the body and end exactly
    where they end: the pipelined request behind them is read whole; h11 reads the same body."""
    wire = b"".join(b"%x;e=1\r\n%b\r\n" % (len(p), p) for p in pieces if p) + b"0\r\nx-t: v\r\n\r\n"
    head = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    data = head + wire + b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n"
    bounds = sorted({0, *(min(c, len(data)) for c in cuts), len(data)})
    events = _read(RequestReader(), *(data[a:b] for a, b in itertools.pairwise(bounds) if b > a))
    body = b"".join(pieces)
    assert [type(e) for e in events[:1]] == [RequestHead]
    assert events[1:-2] == ([body] if body else []) + [END_OF_MESSAGE]
    assert isinstance(events[-2], RequestHead) and events[-2].path == b"/next" and events[-1] is END_OF_MESSAGE
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head + wire)
    h11_events = []
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        h11_events.append(event)
    assert b"".join(e.data for e in h11_events if isinstance(e, h11.Data)) == body


@pytest.mark.req("http-framing")
@pytest.mark.parametrize(
    "wire",
    [b"fffffffffffffffff\r\n", b"0x1\r\n", b"-1\r\n", b"1 \r\n", b"1\r\nab\r\n", b"1\rx", b"0\r\nx y\r\n\r\n"],
)
def test_malformed_chunk_framing_is_refused(wire: bytes) -> None:
    head = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    events = _read(RequestReader(), head + wire)
    assert events[-2:] == [MALFORMED_CHUNKS, CLOSED]


@pytest.mark.req("http-framing")
def test_the_reader_reads_pipelined_requests_only_as_far_as_asked() -> None:
    """Bytes after a request wait in the reader until the next event is asked for; a request that does
    not keep the connection (HTTP/1.0, ``connection: close``, an upgrade) is the last one read."""
    reader = RequestReader()
    reader.feed(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabcGET /b HTTP/1.1\r\nhost: x\r\n\r\n")
    assert isinstance(reader.next_event(), RequestHead) and reader.next_event() == b"abc"
    assert reader.buffered == len(b"GET /b HTTP/1.1\r\nhost: x\r\n\r\n")
    assert reader.next_event() is END_OF_MESSAGE
    assert isinstance(reader.next_event(), RequestHead) and reader.next_event() is END_OF_MESSAGE and reader.at_rest
    for last in (
        b"GET / HTTP/1.0\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
    ):
        events = _read(RequestReader(), last + b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n")
        assert [type(e) for e in events] == [RequestHead, type(END_OF_MESSAGE), type(CLOSED)]
        assert events[1] is END_OF_MESSAGE and events[2] is CLOSED


@pytest.mark.req("http-framing")
@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n", 501),  # llhttp takes it
        (b"GET / HTTP/2.0\r\nhost: x\r\n\r\n", 505),  # llhttp takes it
        (b"PRI * HTTP/2.0\r\n\r\n", 505),  # HTTP/2's preface: llhttp pauses on it
        (b"GET / RTSP/1.0\r\nhost: x\r\n\r\n", 400),  # llhttp reads RTSP too
        (b"GET  / HTTP/1.1\r\nhost: x\r\n\r\n", 400),  # llhttp takes several spaces
        (b"GET * HTTP/1.1\r\nhost: x\r\n\r\n", 400),  # llhttp takes it
        (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1234567890123456789\r\n\r\n", 400),
        (b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: upgrade\r\ncontent-length: 1\r\n\r\n", 400),
        (b"\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n", 400),  # llhttp skips the empty line
        (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\n", 400),
    ],
)
def test_our_rules_where_llhttp_is_more_permissive(head: bytes, status: int) -> None:
    verdict = accept_head(head)
    assert isinstance(verdict, Refusal) and verdict.status == status
    assert b"GET" not in verdict.reason.encode() and b"host" not in verdict.reason.encode()


@pytest.mark.req("http-framing")
def test_a_zero_padded_content_length_is_its_number() -> None:
    """RFC 9110 8.6 allows leading zeros: ``03`` is 3, read the same by every lane."""
    verdict = accept_head(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 03\r\n\r\n")
    assert isinstance(verdict, RequestHead) and verdict.length == 3


@pytest.mark.req("http-framing")
def test_the_encoders_write_what_h11_writes() -> None:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    conn.next_event()
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"5")]
    assert encode_head(200, headers) == conn.send(h11.Response(status_code=200, headers=headers, reason=b""))
    conn = h11.Connection(h11.SERVER)  # a body without a content-length: h11 frames it as chunks
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    conn.next_event()
    conn.send(h11.Response(status_code=200, headers=[], reason=b""))
    assert encode_chunk(b"hello") == conn.send(h11.Data(data=b"hello"))
    assert encode_chunk(b"") == b""
    assert conn.send(h11.EndOfMessage()) == LAST_CHUNK
    assert encode_response(204, [], b"", close=True) == b"HTTP/1.1 204 \r\nconnection: close\r\n\r\n"
    with pytest.raises(ValueError, match="invalid header"):
        encode_head(200, [(b"x-a", b"b\r\nset-cookie: c")])
    refused = error_response(Refusal(400, "malformed request line"))
    assert refused.startswith(b"HTTP/1.1 400 \r\n") and refused.endswith(b"\r\n\r\nmalformed request line\n")


@pytest.mark.req("http-framing")
def test_an_encoded_request_is_accepted_as_it_was_meant() -> None:
    data = encode_request(b"POST", b"/v1/chat/completions", [(b"host", b"edge"), (b"x-a", b"b")], b"{}")
    end = find_head_end(data)
    head = accept_head(data[:end])
    assert isinstance(head, RequestHead) and (head.path, head.length, data[end:]) == (
        b"/v1/chat/completions",
        2,
        b"{}",
    )
    assert encode_request(b"GET", b"/", [(b"host", b"x")]) == b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    with pytest.raises(ValueError, match="invalid header"):
        encode_request(b"GET", b"/", [(b"host", b"x\r\nx-smuggled: 1")])


_STATUSES = st.sampled_from([200, 201, 204, 304, 400, 429, 500])
_HEADER_SETS = st.sampled_from(
    [
        [],
        [(b"content-type", b"text/plain")],
        [(b"content-length", b"LEN")],
        [(b"connection", b"close"), (b"content-length", b"LEN")],
        [(b"x-a", b"b"), (b"connection", b"close")],
    ]
)


@pytest.mark.req("http-framing")
@given(
    request=st.sampled_from(
        [
            b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
            b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n",
            b"GET / HTTP/1.0\r\n\r\n",
            b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        ]
    ),
    status=_STATUSES,
    headers=_HEADER_SETS,
    pieces=st.lists(st.binary(min_size=1, max_size=8), max_size=3),
)
def test_a_response_is_framed_as_h11_frames_it(
    request: bytes, status: int, headers: list[tuple[bytes, bytes]], pieces: list[bytes]
) -> None:
    """:class:`ResponseFraming` frames an answer as h11 frames it for the same request: the same
    fields (in any order and case), the same body bytes on the wire, and the connection kept exactly
    when h11 keeps it."""
    if status in (204, 304) or request.startswith(b"HEAD"):
        pieces = []  # no body (h11 refuses one; the framing drops it)
    body = b"".join(pieces)
    if status in (204, 304):
        headers = [(n, v) for n, v in headers if n != b"content-length"]
    headers = [(n, b"%d" % len(body) if v == b"LEN" else v) for n, v in headers]
    head = accept_head(request)
    assert isinstance(head, RequestHead)
    ours = ResponseFraming(head)
    wire = ours.head(status, headers) + b"".join(ours.body(p) for p in pieces) + ours.end()
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request)
    conn.next_event()
    conn.next_event()
    theirs = conn.send(h11.Response(status_code=status, headers=headers, reason=b"")) or b""
    for piece in pieces:
        theirs += conn.send(h11.Data(data=piece)) or b""
    theirs += conn.send(h11.EndOfMessage()) or b""
    assert _fields(wire) == _fields(theirs)
    assert wire[wire.index(b"\r\n\r\n") :] == theirs[theirs.index(b"\r\n\r\n") :]
    assert ours.complete and ours.keep_alive == (conn.our_state is h11.DONE)


def _fields(wire: bytes) -> tuple[bytes, list[bytes]]:
    """The status line and the header lines (lower-cased, sorted) of an encoded response."""
    lines = wire[: wire.index(b"\r\n\r\n")].split(b"\r\n")
    return lines[0], sorted(line.lower() for line in lines[1:])
