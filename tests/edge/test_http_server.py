"""The Edge's HTTP listener: a response head announcing a body goes out with the body.

Real sockets on 127.0.0.1 port 0, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

from pathlib import Path

import trio
from edge_harness import running_edge

from iop_edge._http_server import _holds_body


def test_only_a_complete_final_head_with_a_body_is_held() -> None:
    assert _holds_body(b"HTTP/1.1 200 \r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n")
    assert _holds_body(b"HTTP/1.1 404 \r\nContent-Length: 3\r\n\r\n")
    assert not _holds_body(b"HTTP/1.1 200 \r\ncontent-length: 0\r\n\r\n")
    assert not _holds_body(b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\n\r\n")  # streamed
    assert not _holds_body(b"HTTP/1.1 100 \r\ncontent-length: 5\r\n\r\n")  # interim
    assert not _holds_body(b"HTTP/1.1 200 \r\ncontent-length: 5\r\n\r\nhello")  # head + body already
    assert not _holds_body(b'{"id": 1}')


async def _exchange(port: int, request: bytes) -> list[bytes]:
    """Send one request; return every chunk received until the response is complete."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        chunks: list[bytes] = []
        data = b""
        while True:
            chunk = await stream.receive_some()
            assert chunk, f"connection closed early after {data!r}"
            chunks.append(chunk)
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and b"head" in request[:5].lower():
                return chunks
            if sep:
                length = [
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ]
                if length and len(body) >= length[0]:
                    return chunks


async def test_head_and_body_arrive_together(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            chunks = await _exchange(edge.http_port, b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
    assert len(chunks) == 1, chunks
    assert chunks[0].endswith(b'{"status":"ok"}')


async def test_head_request_is_answered_without_waiting_for_a_body(tmp_path: Path) -> None:
    """HEAD suppresses the body: the held head is flushed by the end of the message."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            chunks = await _exchange(edge.http_port, b"HEAD /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
            # The Edge keeps serving.
            after = await _exchange(edge.http_port, b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
    assert b"".join(chunks).startswith(b"HTTP/1.1 405")
    assert b"".join(after).endswith(b'{"status":"ok"}')
