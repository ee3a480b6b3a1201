"""[http-framing] :mod:`iop_http` without sockets: head acceptance, the chunked decoder, the encoders."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_http import (
    CHUNKED,
    LAST_CHUNK,
    ChunkedBody,
    MalformedChunk,
    Refusal,
    RequestHead,
    accept_head,
    encode_chunk,
    encode_head,
    encode_request,
    encode_response,
    error_response,
    find_head_end,
    head_too_large,
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
    chunked = accept_head(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: Chunked\r\n\r\n")
    assert isinstance(chunked, RequestHead) and chunked.length == CHUNKED and chunked.keep_alive


@pytest.mark.req("http-framing")
def test_a_head_not_yet_whole_is_refused_as_soon_as_it_cannot_be_accepted() -> None:
    assert head_too_large(b"GET / HTTP/1.1\r\nhost: x\r\n\r", 4096) is None  # a CR at the end: wait
    assert head_too_large(b"GET / HTTP/1.1\nhost", 4096) == Refusal(400, "bare CR or LF in the request head")
    assert head_too_large(b"x" * 4097, 4096) == Refusal(431, "request head too large")
    assert accept_head(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", 16) == Refusal(431, "request head too large")


_BODY = st.binary(max_size=40)


@pytest.mark.req("http-framing")
@given(pieces=st.lists(_BODY, max_size=4), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_a_chunked_body_decodes_the_same_whatever_the_reads(pieces: list[bytes], cuts: list[int]) -> None:
    """Chunks with an extension and a trailer, cut into arbitrary reads, decode to the body; the bytes
    after its end (the next request) are never consumed; h11 reads the same body."""
    wire = b"".join(b"%x;e=1\r\n%b\r\n" % (len(p), p) for p in pieces if p) + b"0\r\nx-t: v\r\n\r\n"
    data = wire + b"GET /"
    decoder = ChunkedBody()
    body = b""
    pending = b""
    at = 0
    for cut in sorted({*cuts, len(data)}):
        pending += data[at:cut]
        at = max(at, cut)
        out, used = decoder.feed(pending)
        body += out
        pending = pending[used:]
    assert decoder.done and body == b"".join(pieces) and pending == b"GET /"
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + wire)
    events = []
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        events.append(event)
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == body


@pytest.mark.req("http-framing")
@pytest.mark.parametrize(
    "wire", [b"fffffffffffffffff\r\n", b"0x1\r\n", b"-1\r\n", b"1 \r\n", b"1\r\nab\r\n", b"1\rx", b"0\r\nx y\r\n\r\n"]
)
def test_malformed_chunk_framing_raises(wire: bytes) -> None:
    with pytest.raises(MalformedChunk):
        ChunkedBody().feed(wire)


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
