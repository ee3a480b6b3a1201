"""[http-framing] Differential: the Edge's listener, on a real socket, agrees with :mod:`iop_http`'s reference
verdict on generated requests: the same refusal, or the same request with the same body, and the bytes it
consumed end exactly where the reference says (the pipelined follow-up runs iff the reference keeps the
connection)."""

from __future__ import annotations

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from framing.listener import MARKER, exchange, listening, statuses
from iop_http import CHUNKED, ChunkedBody, MalformedChunk, Refusal, RequestHead, accept_head, find_head_end

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


def reference(data: bytes) -> tuple[int, RequestHead | None, bytes, bool]:
    """iop_http's verdict on ``data`` followed by :data:`MARKER`: (status of the first answer, the head,
    the body, whether the marker runs). Status 0: the body is incomplete (the client ends mid-body)."""
    end = find_head_end(data)
    head = accept_head(data[:end])
    if isinstance(head, Refusal):
        return head.status, None, b"", False
    rest = data[end:] + MARKER
    if head.length == CHUNKED:
        chunks = ChunkedBody()
        try:
            body, used = chunks.feed(rest)
        except MalformedChunk:
            return 400, head, b"", False
        if not chunks.done:
            return 0, head, b"", False
    else:
        body, used = rest[: head.length], head.length
        if len(rest) < head.length:
            return 0, head, b"", False
    return 200, head, body, head.keep_alive and rest[used:] == MARKER


@pytest.mark.req("http-framing")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=requests())
def test_the_listener_frames_as_the_module_does(data: bytes) -> None:
    """[http-framing] Whatever the request, the listener's verdict and framing are the module's."""
    status, head, body, marker_runs = reference(data)

    async def check() -> None:
        with trio.fail_after(10):
            async with listening() as backend:
                answers = statuses(await exchange(backend.port, data + MARKER))
                ran = [(m, p) for m, p, _ in backend.ran]
                if status == 0:  # the client left mid-body: nothing ran but the request's own start
                    assert backend.count("/marker") == 0
                    return
                assert answers[0][0] == status, (answers, data)
                if status == 200:
                    assert head is not None
                    assert backend.ran[0] == (head.method.decode(), head.path.decode(), body)
                elif status == 400 and head is not None:  # malformed chunks: the app may have started
                    assert all(p != "/marker" for _, p in ran)
                else:
                    assert ran == []
                assert (backend.count("/marker") == 1) == marker_runs, (answers, data)
                assert len(answers) == 1 + marker_runs

    trio.run(check)
