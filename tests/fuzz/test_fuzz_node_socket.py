"""Fuzz the Edge's node socket: bad frames first and after a valid registration.

Oracle: :func:`iop_wire.decode` with the Edge's ``max_ws_message_bytes``. A
frame it rejects must make the Edge close the connection with the close code
it names (1002, or 1009 when oversized) without registering anything; a valid
``register`` that the config refuses gets ``rejected`` then 1008; after
registration, valid run messages for unknown runs and heartbeats are ignored
(the connection stays up), and any other valid message is a 1002. Whatever
happened, the same Edge then serves a healthy request and every admission
counter is back to 0. [disconnect-exclusion] [lease-lifecycle]
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from hypothesis import event, given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_client_stream

from fuzz.harness import (
    MAX_WS_MESSAGE_BYTES,
    NODE_B_MODEL,
    TOKEN_B,
    EdgeThread,
    assert_healthy,
    frames,
)
from iop_wire import (
    PROTOCOL_VERSION,
    Heartbeat,
    ProtocolError,
    ProviderHealth,
    ProviderInfo,
    Register,
    Registered,
    Rejected,
    Run,
    RunData,
    RunEnd,
    TunnelChunk,
    TunnelEnd,
    TunnelStart,
    decode,
    encode,
    encode_data,
)

pytestmark = pytest.mark.req("disconnect-exclusion", "lease-lifecycle")

EXAMPLE_TIMEOUT = 10.0
IGNORED_AFTER_REGISTER = (Heartbeat, RunEnd, TunnelStart, TunnelChunk, TunnelEnd, ProviderHealth)
"""What a registered node may send without a run asking it: read (a health report, engine view
included, is applied), the connection stays up."""


@asynccontextmanager
async def node_socket(edge: EdgeThread) -> AsyncIterator[WebSocketConnection]:
    """A raw WebSocket client on the Edge's node socket; its TCP stream is always closed."""
    async with trio.open_nursery() as nursery:
        stream = await trio.open_tcp_stream("127.0.0.1", edge.node_port)
        try:
            ws = await wrap_client_stream(nursery, stream, "127.0.0.1", "/", max_message_size=1 << 24)
            try:
                yield ws
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await ws.aclose()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()
        nursery.cancel_scope.cancel()


async def until_closed(ws: WebSocketConnection) -> tuple[list[Any], int | None]:
    """Every message the Edge sends until it closes, and its close code."""
    received = []
    while True:
        try:
            received.append(decode(await ws.get_message()))
        except ConnectionClosed as exc:
            return received, exc.reason.code if exc.reason else None


def expected_verdict(frame: str | bytes) -> int | type[Any]:
    """The close code a rejected frame must get, or the message class it decodes to."""
    try:
        kind = type(decode(frame, max_bytes=MAX_WS_MESSAGE_BYTES))
    except ProtocolError as exc:
        event(f"close {exc.close_code}")
        return exc.close_code
    event(f"valid {kind.__name__}")
    return kind


async def send_frame(ws: WebSocketConnection, frame: str | bytes) -> None:
    try:
        await ws.send_message(frame)
    except ConnectionClosed:
        pass  # the Edge may close while an oversized frame is still going out


async def register_b(ws: WebSocketConnection) -> Registered:
    await ws.send_message(encode(Register("node-b", TOKEN_B, PROTOCOL_VERSION, (ProviderInfo("gpu1", "mock", 1),))))
    answer = decode(await ws.get_message())
    assert isinstance(answer, Registered), answer
    return answer


@settings(max_examples=40)
@given(frame=frames(MAX_WS_MESSAGE_BYTES))
async def test_bad_first_frame_is_closed_and_edge_keeps_serving(edge_thread: EdgeThread, frame: str | bytes) -> None:
    """A bad first frame: close 1002/1009 (or ``rejected`` + 1008), never a registration."""
    with trio.fail_after(EXAMPLE_TIMEOUT):
        verdict = expected_verdict(frame)
        async with node_socket(edge_thread) as ws:
            await send_frame(ws, frame)
            if (
                verdict is Register
                and isinstance(answer := decode(frame), Register)
                and answer == Register("node-b", TOKEN_B, PROTOCOL_VERSION, answer.providers)
            ):
                assert isinstance(decode(await ws.get_message()), Registered)  # a valid registration
                await ws.aclose(1000, "done")
            else:
                received, code = await until_closed(ws)
                if isinstance(verdict, int):
                    assert (received, code) == ([], verdict)
                else:
                    assert code == 1008
                    assert len(received) == 1 and isinstance(received[0], Rejected), received
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge_thread.http_port}") as http:
            await assert_healthy(http)


@settings(max_examples=40)
@given(frame=frames(MAX_WS_MESSAGE_BYTES), run_in_flight=st.booleans(), stream=st.booleans())
async def test_bad_frame_after_register_drops_only_that_node(
    edge_thread: EdgeThread, frame: str | bytes, run_in_flight: bool, stream: bool
) -> None:
    """After ``registered``: a bad frame closes 1002/1009 and fences the node's run (502); ignorable ones are ignored."""
    with trio.fail_after(EXAMPLE_TIMEOUT):
        verdict = expected_verdict(frame)
        closes = not (isinstance(verdict, type) and issubclass(verdict, IGNORED_AFTER_REGISTER))
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge_thread.http_port}", timeout=EXAMPLE_TIMEOUT) as http,
            trio.open_nursery() as nursery,
        ):
            responses: list[httpx.Response] = []
            async with node_socket(edge_thread) as ws:
                await register_b(ws)
                run: Run | None = None
                if run_in_flight:
                    body = {"model": NODE_B_MODEL, "messages": [{"role": "user", "content": "x"}], "stream": stream}

                    async def call() -> None:
                        responses.append(await http.post("/v1/chat/completions", json=body))

                    nursery.start_soon(call)
                    run = decode(await ws.get_message())  # type: ignore[assignment]
                    assert isinstance(run, Run), run
                await send_frame(ws, frame)
                if closes:
                    received, code = await until_closed(ws)
                    assert code == (verdict if isinstance(verdict, int) else 1002)
                    assert received == []
                else:
                    await ws.send_message(encode(Heartbeat(1)))
                    if run is not None:
                        answer = b'{"object":"chat.completion","id":"x"}'
                        await ws.send_message(encode_data([RunData(run.run_id, 0, answer)]))
                        await ws.send_message(encode(RunEnd(run.run_id, "ok")))
                    # the connection is still up: wait for the request to finish over it
                    while run is not None and not responses:
                        await trio.sleep(0.005)
                    await ws.aclose(1000, "done")
            while run is not None and not responses:
                await trio.sleep(0.005)
            if run is not None:
                (response,) = responses
                if closes:
                    assert response.status_code == 502, response.text
                    assert response.json()["error"]["code"] == "node_disconnected"
                else:
                    assert response.status_code == 200, response.text
            await assert_healthy(http)
