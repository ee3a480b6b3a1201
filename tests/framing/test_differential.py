"""[http-framing] Differential: the Edge's listener, on a real socket, agrees with :mod:`iop_http`'s reference
verdict on generated requests: the same refusal, or the same request with the same body, and the bytes it
consumed end exactly where the reference says (the pipelined follow-up runs iff the reference keeps the
connection)."""

from __future__ import annotations

import itertools
import urllib.parse

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from framing.listener import MARKER, exchange, listening, statuses
from iop_http import CLOSED, END_OF_MESSAGE, NEED_DATA, Refusal, RequestHead, RequestReader

_TARGETS = [b"/a", b"/a?b=1", b"a", b"*", b"http://h/p", b"https://h", b"http://h?x", b"//x", b"/%41", b"ftp://h/"]
_LENGTHS = [b"3", b"03", b"+3", b"3 ", b"3,3", b"0x3", b"-1", b"", b"3 3", b"99999999999999999999"]
_CODINGS = [b"chunked", b"Chunked", b"gzip, chunked", b"chunked, gzip", b"identity", b"chunked,", b" chunked"]
_FRAMING = st.one_of(
    st.sampled_from(_LENGTHS).map(lambda v: b"Content-Length: " + v),
    st.sampled_from(_CODINGS).map(lambda v: b"Transfer-Encoding: " + v),
    st.sampled_from([b"X-A: b\r\n Transfer-Encoding: chunked", b"X-A: b\r\n\tContent-Length: 3"]),
    st.sampled_from([b"Transfer-Encoding : chunked", b"Content-Length : 3", b"Expect: 100-continue"]),
)
_BODIES = st.sampled_from(
    [
        b"",
        b"abc",
        b"3\r\nabc\r\n0\r\n\r\n",
        b"0x3\r\nabc\r\n0\r\n\r\n",
        b"3\r\nabcd\r\n0\r\n\r\n",
        b"0\r\n\r\n",
        b"3;x=y\r\nabc\r\n0\r\nt: v\r\n\r\n",
        b"10000000000000000\r\n",
        b"3\nabc\r\n0\r\n\r\n",
    ]
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"GET", b"POST", b"OPTIONS"]))
    target = draw(st.sampled_from(_TARGETS))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0"]))
    lines = [b"%b %b %b" % (method, target, version)]
    lines += draw(st.lists(st.sampled_from([b"Host: x", b"Host: x", b"Host: y", b"Connection: close"]), max_size=2))
    lines += draw(st.lists(_FRAMING, max_size=3))
    return b"\r\n".join(lines) + b"\r\n\r\n" + draw(_BODIES)


def reference(stream: bytes) -> tuple[list[int], list[tuple[str, str, bytes]]]:
    """iop_http's reading of ``stream`` (the client then ends its side), all of it in one read: the
    statuses answered and the requests run (method, path, body). A request cut short by the client's
    end is neither answered nor run."""
    statuses: list[int] = []
    ran: list[tuple[str, str, bytes]] = []
    reader = RequestReader()
    reader.feed(stream)
    reader.feed(b"")
    head: RequestHead | None = None
    body = b""
    while True:
        event = reader.next_event()
        if event is CLOSED or event is NEED_DATA:
            return statuses, ran
        if isinstance(event, Refusal):
            return [*statuses, event.status], ran  # a malformed body: the app was reading it, it never ran
        if isinstance(event, RequestHead):
            head, body = event, b""
        elif isinstance(event, bytes):
            body += event
        else:
            assert event is END_OF_MESSAGE and head is not None
            statuses.append(200)
            ran.append((head.method.decode(), urllib.parse.unquote(head.path.partition(b"?")[0].decode()), body))


@pytest.mark.req("http-framing")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=requests(), cuts=st.lists(st.integers(1, 200), max_size=3))
def test_the_listener_frames_as_the_module_does(data: bytes, cuts: list[int]) -> None:
    """[http-framing] Whatever the request and however its bytes are sent (cut into several sends), the
    listener's verdicts and framing are the module's, which reads it all in one read."""
    statuses_expected, ran_expected = reference(data + MARKER)
    stream = data + MARKER
    bounds = sorted({0, *(c for c in cuts if c < len(stream)), len(stream)})
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]

    async def check() -> None:
        with trio.fail_after(10):
            async with listening() as backend:
                answers = statuses(await exchange(backend.port, *pieces))
                assert [s for s, _ in answers] == statuses_expected, (answers, data)
                assert backend.ran == ran_expected, (backend.ran, data)

    trio.run(check)
