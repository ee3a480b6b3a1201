"""[http-framing] Differential against an independent oracle: for every generated request that both
:mod:`iop_http`'s reader (llhttp and the project's rules) and h11 accept, both read the same method,
target, header fields and body -- so where the two would frame bytes, they frame them alike.

h11 is stricter than RFC 9112 in places and llhttp in others; requests one of them refuses are not
compared (the reader's refusals are checked against the RFC in ``test_smuggling``), only counted as
Hypothesis events.
"""

from __future__ import annotations

import itertools

import h11
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from framing.test_differential import requests
from iop_http import CLOSED, END_OF_MESSAGE, NEED_DATA, Refusal, RequestHead, RequestReader

Reading = tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]
"""(method, target, headers, body) of the first request of a stream (None: refused or incomplete)."""


def read_with_iop_http(data: bytes) -> Reading | None:
    reader = RequestReader()
    reader.feed(data)
    head = reader.next_event()
    if not isinstance(head, RequestHead):
        return None
    body = b""
    while (item := reader.next_event()) is not END_OF_MESSAGE:
        if item is NEED_DATA or item is CLOSED or isinstance(item, Refusal):
            return None
        assert isinstance(item, bytes)
        body += item
    return head.method, head.target, head.headers, body


def read_with_h11(data: bytes) -> Reading | None:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    try:
        request = conn.next_event()
        if not isinstance(request, h11.Request):
            return None
        body = b""
        while not isinstance(item := conn.next_event(), h11.EndOfMessage):
            if not isinstance(item, h11.Data):
                return None
            body += item.data
    except h11.RemoteProtocolError:
        return None
    headers = [(bytes(name), bytes(value)) for name, value in request.headers]
    return request.method, request.target, headers, body


def _folded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Header fields as both read them (h11 folds repeated framing headers it checked into one)."""
    return [(n, v) for n, v in headers if n not in (b"content-length", b"transfer-encoding")]


@pytest.mark.req("http-framing")
@settings(max_examples=400, deadline=None)
@given(data=requests())
def test_the_reader_and_h11_read_alike_where_both_accept(data: bytes) -> None:
    ours = read_with_iop_http(data)
    theirs = read_with_h11(data)
    event(f"iop_http {'reads' if ours else 'refuses'}, h11 {'reads' if theirs else 'refuses'}")
    if ours is None or theirs is None:
        return
    method, target, headers, body = ours
    assert (method, target, body) == (theirs[0], theirs[1], theirs[3]), data
    assert _folded(headers) == _folded(theirs[2]), data


_TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-!#$%&'*+.^_`|~", min_size=1, max_size=8)
_VALUE = st.text(alphabet='abcdefghijklmnopqrstuvwxyz0123456789 -_.,;:/=\t"', max_size=12)


@st.composite
def well_formed(draw: st.DrawFn) -> bytes:
    """Requests every reading of RFC 9112 accepts: varied fields, targets and body framings."""
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"]))
    target = draw(st.sampled_from([b"/", b"/v1/chat/completions", b"/a?b=c&d", b"http://h:8/p?q", b"/%7Ex"]))
    fields = [(b"Host", b"edge.example")]
    fields += [
        (n.encode(), v.strip(" \t").encode())
        for n, v in draw(st.lists(st.tuples(_TOKEN, _VALUE), max_size=4))
        if n.lower() not in ("host", "content-length", "transfer-encoding", "connection", "upgrade", "expect")
    ]
    body = draw(st.binary(max_size=40))
    if draw(st.booleans()):
        cuts = sorted(set(draw(st.lists(st.integers(0, len(body)), max_size=3))) | {0, len(body)})
        chunks = [body[a:b] for a, b in itertools.pairwise(cuts) if b > a]
        fields.append((b"Transfer-Encoding", b"chunked"))
        payload = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    else:
        fields.append((b"Content-Length", b"%d" % len(body)))
        payload = body
    head = b"%b %b HTTP/1.1\r\n" % (method, target) + b"".join(b"%b: %b\r\n" % f for f in fields)
    return head + b"\r\n" + payload


@pytest.mark.req("http-framing")
@settings(max_examples=300, deadline=None)
@given(data=well_formed())
def test_well_formed_requests_are_read_alike(data: bytes) -> None:
    """Every well-formed request: both accept it and read the same method, target, fields and body."""
    ours = read_with_iop_http(data)
    theirs = read_with_h11(data)
    assert ours is not None and theirs is not None, data
    assert (ours[0], ours[1], ours[3]) == (theirs[0], theirs[1], theirs[3]), data
    assert _folded(ours[2]) == _folded(theirs[2]), data


@pytest.mark.req("http-framing")
@pytest.mark.parametrize(
    "data",
    [
        b"POST /a?b=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
        b"POST http://h/p HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nt: v\r\n\r\n",
        b"GET / HTTP/1.0\r\nX-A:  b c \r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_plain_requests_are_read_alike(data: bytes) -> None:
    """The usual shapes: both accept them and read them the same way."""
    ours = read_with_iop_http(data)
    theirs = read_with_h11(data)
    assert ours is not None and theirs is not None
    assert (ours[0], ours[1], ours[3]) == (theirs[0], theirs[1], theirs[3])
    assert _folded(ours[2]) == _folded(theirs[2])
