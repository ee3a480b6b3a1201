"""[upstream-bounds] A client's chunk extensions are bounded (RFC 9112 §7.1.1; Node.js since CVE-2024-22019).

The reader refuses a chunked body once its extensions and trailer fields pass
``max_chunk_extension_bytes`` (16 KiB) in all, whatever the reads; short
extensions on many chunks are accepted. On a real listener the client gets 400
(with the listener's one text for every refused chunked body) and the request
never reaches the app.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from edge.harness import EdgeLayout, running_edge
from framing.listener import exchange, listening, statuses
from iop_http import CLOSED, END_OF_MESSAGE, NEED_DATA, Event, Refusal, RequestHead, RequestReader
from iop_http.chunks import MAX_CHUNK_EXTENSION_BYTES
from iop_http.refusals import CHUNK_EXTENSIONS_TOO_LONG

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
HELLO = b"5\r\nhello\r\n"
LONG_EXTENSION = b"5;x=" + b"a" * 200_000 + b"\r\nhello\r\n"


def read(*reads: bytes, max_extension: int = MAX_CHUNK_EXTENSION_BYTES) -> list[Event]:
    reader = RequestReader(max_chunk_extension_bytes=max_extension)
    events: list[Event] = []
    for data in reads:
        reader.feed(data)
        while (event := reader.next_event()) is not NEED_DATA:
            events.append(event)
            if event is CLOSED:
                return events
    return events


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.req("upstream-bounds")
@pytest.mark.parametrize("size", [1000, 65536])
def test_chunk_extensions_past_the_bound_are_refused(size: int) -> None:
    spread = b"".join(b"1;" + b"e" * 200 + b"\r\na\r\n" for _ in range(100))  # 20 KB over 100 chunks
    trailer = HELLO + b"0\r\nx-t: " + b"t" * 20_000 + b"\r\n"  # a trailer section not finished yet
    for body in (LONG_EXTENSION, spread, trailer):
        events = read(HEAD, *split(body, size))
        assert isinstance(events[0], RequestHead)
        assert CHUNK_EXTENSIONS_TOO_LONG in events and events[-1] is CLOSED
        assert END_OF_MESSAGE not in events


@pytest.mark.req("upstream-bounds")
def test_a_whole_body_read_at_once_is_held_to_the_bound_too() -> None:
    """A short body whose end comes in the same read as its long extension: refused, not ended
    (the bound used to be checked only while the body was unfinished)."""
    body = b"5;x=" + b"a" * 2048 + b"\r\nhello\r\n0\r\n\r\n"
    events = read(HEAD + body, max_extension=1024)
    assert CHUNK_EXTENSIONS_TOO_LONG in events and events[-1] is CLOSED
    assert END_OF_MESSAGE not in events
    assert END_OF_MESSAGE in read(HEAD + body, max_extension=4096)


@pytest.mark.req("upstream-bounds")
def test_short_extensions_on_many_chunks_are_accepted() -> None:
    body = b"".join(b"1;e=x\r\na\r\n" for _ in range(10_000)) + b"0\r\n\r\n"
    events = read(HEAD, *split(body, 4096))
    assert END_OF_MESSAGE in events
    assert not any(isinstance(event, Refusal) for event in events)
    assert b"".join(e for e in events if isinstance(e, bytes)) == b"a" * 10_000


@pytest.mark.req("upstream-bounds")
async def test_the_listener_answers_400_and_never_runs_the_request() -> None:
    async with listening() as backend:
        received = await exchange(backend.port, HEAD, *split(LONG_EXTENSION + b"0\r\n\r\n", 65536))
        assert [status for status, _ in statuses(received)] == [400]  # the listener's text for any bad chunked body
        assert backend.ran == []


@pytest.mark.req("upstream-bounds")
async def test_the_edge_takes_its_bound_from_max_chunk_extension_bytes(tmp_path: Path) -> None:
    """``max_chunk_extension_bytes: 1024`` in ``edge.yaml``: a 2 KiB extension is 400 and the request
    never runs, a 512-byte one reaches the API (which answers the body itself: 400, no
    ``messages``); the default 16 KiB would take both."""
    layout = EdgeLayout(extra=("max_chunk_extension_bytes: 1024",))
    body = b'{"model": "x"}'
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge:
            for size, refused in ((2048, True), (512, False)):
                chunk = b"%x;x=%b\r\n%b\r\n" % (len(body), b"a" * size, body)
                received = await exchange(edge.http_port, HEAD + chunk + b"0\r\n\r\n")
                [(status, answer)] = statuses(received)
                assert status == 400, received[:300]
                assert (b"'messages' is required" in answer) is not refused, answer  # the API read the body
            assert (await edge.http.get("/healthz")).status_code == 200
