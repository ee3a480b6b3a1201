"""[relay-fidelity] The client gets exactly the backend's bytes, through real Edge and Node processes.

The backend here is written for the test (h11 on a trio socket, in the test process): it
answers with awkward but valid streams, written piece by piece with a short pause between
pieces so that they travel as separate reads: an SSE comment, ``\\r\\n`` line ends, a
``data:`` field split over two lines, events and ``[DONE]`` cut in the middle, a multi-byte
UTF-8 character cut in two; for the ``ollama`` adapter, NDJSON lines cut the same ways.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import h11
import httpx
import pytest
import trio

from e2e.harness import BIG, FAST, edge_config, open_stack

SSE_PIECES = (
    b": the backend says hello\r\n\r\n",
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant"}}]}\r\n\r\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"caf\xc3',
    b"\xa9 \xe2\x82",
    b'\xac"}}]}\r\n',
    b'\r\ndata: {"id":"c1",\ndata: "object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"!"},"finish_reason":"stop"}]}\n\n',
    b"data: [DO",
    b"NE]\n\n",
)
WHOLE_PIECES = (
    b'{ "id": "c2", "object": "chat.completion",\n  "choices": [{"index": 0, "message": ',
    b'{"role": "assistant", "content": "na\xc3',
    b'\xafve \\u00e9"}, "finish_reason": "stop"}] }\n',
)
NDJSON_PIECES = (
    b'{"model":"m","message":{"role":"assistant","content":"h\xc3',
    b'\xa9llo"},"done":false}\n{"model":"m","mess',
    b'age":{"role":"assistant","content":" w\xe2\x82\xacrld"},"done":false}\n',
    b'{"model":"m","message":{"role":"assistant","content":""},"done":true,"done_reason":"stop",'
    b'"prompt_eval_count":3,"eval_count":2}\n',
)
PAUSE = 0.02
"""Seconds between two pieces: pacing like a generating backend (nothing is asserted on time)."""


async def _serve_awkward(stream: trio.SocketStream) -> None:
    """Answer every request on one keep-alive connection with the pieces for its path."""
    connection = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            request, body = None, b""
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    connection.receive_data(data)
                    if not data and connection.their_state is not h11.SEND_BODY:
                        return
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return  # the node closed the connection
            assert request is not None
            if request.method == b"GET":  # the node's readiness probe ([health-probe]): a server up
                await _answer_probe(stream, connection, request.target)
            else:
                await _answer(stream, connection, request.target, json.loads(body))
            if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                return
            connection.start_next_cycle()


async def _answer(stream: trio.SocketStream, connection: h11.Connection, target: bytes, body: dict) -> None:
    if target == b"/api/chat":
        pieces, kind = NDJSON_PIECES, b"application/x-ndjson"
    elif body.get("stream"):
        pieces, kind = SSE_PIECES, b"text/event-stream"
    else:
        pieces, kind = WHOLE_PIECES, b"application/json"
    headers = [(b"content-type", kind), (b"transfer-encoding", b"chunked")]
    await stream.send_all(connection.send(h11.Response(status_code=200, headers=headers)))
    for piece in pieces:
        await stream.send_all(connection.send(h11.Data(data=piece)))
        await trio.sleep(PAUSE)
    await stream.send_all(connection.send(h11.EndOfMessage()))


async def _answer_probe(stream: trio.SocketStream, connection: h11.Connection, target: bytes) -> None:
    """``GET /v1/models`` (the ``openai`` adapter's probe) or ``GET /api/ps`` (``ollama``'s)."""
    body = b'{"models":[]}' if target == b"/api/ps" else b'{"object":"list","data":[]}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await stream.send_all(connection.send(h11.Response(status_code=200, headers=headers)))
    await stream.send_all(connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage()))


def _node_yaml(port: int) -> dict:
    return {
        "node_id": "node-a",
        "token": "e2e-node-token",
        "runtime": {"concurrency": 4},
        "reconnect": {"initial_ms": 50, "max_ms": 500},
        "providers": [
            {"id": "gpu0", "adapter": "openai", "capacity": 2, "base_url": f"http://127.0.0.1:{port}/v1"},
            {"id": "olla", "adapter": "ollama", "capacity": 2, "base_url": f"http://127.0.0.1:{port}"},
        ],
    }


async def _post(client: httpx.AsyncClient, url: str, model: str, stream: bool) -> httpx.Response:
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    return await client.post(f"{url}/v1/chat/completions", json=body)


def _contents(sse: bytes) -> tuple[list[str], Sequence[bytes]]:
    events = [e for e in sse.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    return [c["choices"][0]["delta"].get("content", "") for c in chunks], events


@pytest.mark.req("relay-fidelity")
async def test_client_receives_exactly_the_backend_bytes(tmp_path: Path) -> None:
    """[relay-fidelity] Stream and non-stream answers of an ``openai`` backend reach the client
    byte for byte, in order, however the backend cut them; the ``ollama`` adapter's NDJSON,
    cut across lines and inside a UTF-8 character, arrives as its OpenAI chunks with every
    character in order and the stream ends with ``[DONE]``."""
    with trio.fail_after(30):
        async with open_stack(tmp_path) as stack, trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, _serve_awkward, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            await stack.start_edge(
                edge_config(providers={"gpu0": 2, "olla": 2}, models={BIG: ["gpu0"], FAST: ["olla"]})
            )
            await stack.start_node(_node_yaml(port))
            async with httpx.AsyncClient(timeout=10) as client:
                streamed = await _post(client, stack.base_url, BIG, True)
                whole = await _post(client, stack.base_url, BIG, False)
                ollama = await _post(client, stack.base_url, FAST, True)
            nursery.cancel_scope.cancel()
    assert streamed.status_code == 200
    assert streamed.headers["content-type"] == "text/event-stream"
    assert streamed.content == b"".join(SSE_PIECES)
    assert whole.status_code == 200
    assert whole.headers["content-type"] == "application/json"
    assert whole.content == b"".join(WHOLE_PIECES)
    assert ollama.status_code == 200
    contents, _ = _contents(ollama.content)
    assert "".join(contents) == "héllo w€rld"
