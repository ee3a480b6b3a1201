"""Fuzz the Node's Edge connection: a fake Edge sends bad frames after ``registered``.

Oracle: :func:`iop_wire.decode`. A frame it rejects makes the node close the
connection with the code it names (1002; 1009 for an oversized frame, checked
once with a real 8 MiB frame); a ``cancel`` for an unknown run is ignored; a
``run`` / ``tunnel_request`` for an unknown provider is answered with its end
(``bad_request``); any other valid message is a 1002. A run in flight on the
closed connection is cancelled and its gate permit returned; the node
reconnects and serves a healthy run. [runtime-concurrency] [tunnel-guard]
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from fuzz.harness import frames
from iop_node import EdgeClient, NodeConfig, NodeRuntime, ProviderConfig, ReconnectConfig, RuntimeConfig
from iop_wire import (
    MAX_MESSAGE_BYTES,
    Cancel,
    ProtocolError,
    Register,
    Registered,
    Run,
    RunEnd,
    TunnelEnd,
    TunnelRequest,
    decode,
    decode_data,
    encode,
)

pytestmark = pytest.mark.req("runtime-concurrency", "tunnel-guard")

EXAMPLE_TIMEOUT = 10.0
TOKEN = "fuzz-node-token"


@attrs.define(eq=False)
class FakeEdge:
    """Accepted node connections, each once the node sent ``register`` and got ``registered``."""

    port: int
    connections: trio.MemoryReceiveChannel[WebSocketConnection]

    async def next_registered(self) -> WebSocketConnection:
        ws = await self.connections.receive()
        register = decode(await ws.get_message())
        assert isinstance(register, Register) and register.token == TOKEN, register
        await ws.send_message(encode(Registered(register.node_id, 1, 60_000)))
        return ws


@asynccontextmanager
async def node_and_fake_edge() -> AsyncIterator[tuple[FakeEdge, NodeRuntime]]:
    """A fake Edge on port 0 and a real in-process node (mock providers ``gpu0``, ``slow``)."""
    send, receive = trio.open_memory_channel[WebSocketConnection](8)

    async def accept(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await send.send(ws)
        await trio.sleep_forever()  # the connection lives as long as this handler

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_websocket, accept, "127.0.0.1", 0, None)
        config = NodeConfig(
            node_id="node-a",
            edge_url=f"ws://127.0.0.1:{server.port}",
            providers=(
                ProviderConfig(id="gpu0", adapter="mock", capacity=1),
                ProviderConfig(id="slow", adapter="mock", capacity=1, latency_ms=60_000),
            ),
            token=TOKEN,
            runtime=RuntimeConfig(concurrency=4),
            reconnect=ReconnectConfig(initial_ms=1, max_ms=5, jitter=0.0),
        )
        async with NodeRuntime.from_config(config) as runtime:
            client = EdgeClient(config, runtime, rng=random.Random(3))
            stopped = trio.Event()

            async def run_node() -> None:
                await client.run()
                stopped.set()

            nursery.start_soon(run_node)
            yield FakeEdge(server.port, receive), runtime
            # The node closes first, while the fake Edge's connections still answer the
            # closing handshake (both closing at once would wait out the close timeout).
            client.shutdown()
            await stopped.wait()
        nursery.cancel_scope.cancel()


def expected_verdict(frame: str | bytes) -> int | type:
    try:
        kind = type(decode(frame))
    except ProtocolError as exc:
        event(f"close {exc.close_code}")
        return exc.close_code
    event(f"valid {kind.__name__}")
    return kind


async def close_code(ws: WebSocketConnection) -> int | None:
    """Read until the node closes; every message before the close must be a heartbeat."""
    while True:
        try:
            message = decode(await ws.get_message())
        except ConnectionClosed as exc:
            return exc.reason.code if exc.reason else None
        assert type(message).__name__ == "Heartbeat", message


async def assert_serves_a_run(ws: WebSocketConnection, run_id: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    await ws.send_message(encode(Run(run_id, "gpu0", "chat/completions", body, False)))
    body_bytes = b""
    while True:
        frame = await ws.get_message()
        if isinstance(frame, bytes):  # the answer's bytes in data records
            body_bytes += b"".join(r.data for r in decode_data(frame) if r.run_id == run_id)
            continue
        message = decode(frame)
        if isinstance(message, RunEnd):
            assert not body_bytes or json.loads(body_bytes)["object"] == "chat.completion"
            assert (message.run_id, message.status) == (run_id, "ok"), message
            return


async def until_idle(runtime: NodeRuntime) -> None:
    while runtime.gate.statistics().total_in_use:
        await trio.sleep(0.001)


@settings(max_examples=100)
@given(frame=frames(None), run_in_flight=st.booleans())
@example(frame=encode(Cancel("r-unknown")), run_in_flight=True)
@example(frame=encode(Run("r-odd", "gpu9", "completions", {"model": "m"}, False)), run_in_flight=True)
@example(frame=encode(TunnelRequest("r-odd", "gpu9", "GET", "/v1/models")), run_in_flight=False)
@example(frame=encode(Registered("node-a", 2, 1000)), run_in_flight=True)
async def test_bad_frame_from_edge(frame: str | bytes, run_in_flight: bool) -> None:
    """A bad frame after ``registered``: close 1002 and a cancelled run, then a clean reconnect."""
    verdict = expected_verdict(frame)
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with node_and_fake_edge() as (edge, runtime):
            ws = await edge.next_registered()
            if run_in_flight:
                await ws.send_message(encode(Run("r-slow", "slow", "chat/completions", {"model": "m"}, True)))
                while not runtime.gate.statistics().total_in_use:
                    await trio.sleep(0.001)
            await ws.send_message(frame)
            if verdict in (Cancel, Run, TunnelRequest):
                if verdict is not Cancel:
                    answer = decode(await ws.get_message())
                    assert isinstance(answer, RunEnd | TunnelEnd) and answer.code == "bad_request", answer
                await assert_serves_a_run(ws, "r-after")
                if run_in_flight:  # still running on the open connection: cancel it
                    await ws.send_message(encode(Cancel("r-slow")))
                    end = decode(await ws.get_message())
                    assert isinstance(end, RunEnd) and (end.run_id, end.status) == ("r-slow", "cancelled"), end
            else:
                assert await close_code(ws) == (verdict if isinstance(verdict, int) else 1002)
                await until_idle(runtime)  # the run of the closed connection was cancelled
                await assert_serves_a_run(await edge.next_registered(), "r-after")
            await until_idle(runtime)


async def test_oversized_frame_from_edge_is_1009() -> None:
    """A frame over MAX_MESSAGE_BYTES (8 MiB): close 1009, then a clean reconnect."""
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with node_and_fake_edge() as (edge, runtime):
            ws = await edge.next_registered()
            try:
                await ws.send_message("z" * (MAX_MESSAGE_BYTES + 1))
            except ConnectionClosed:
                pass
            assert await close_code(ws) == 1009
            await assert_serves_a_run(await edge.next_registered(), "r-after")
            await until_idle(runtime)
