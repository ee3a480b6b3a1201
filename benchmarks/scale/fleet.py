"""The fake fleet of the scale benchmark: thousands of nodes in one trio process (``python -m benchmarks.scale fleet``).

Each fake node dials the Edge through iop-node's own connector
(:func:`iop_node.websocket_connector`) with iop-node's reconnect delays, from
its own loopback address (127.10.x.y: Linux routes all of 127.0.0.0/8 to the
loopback interface), as the nodes of a real fleet each have their own address.
One provider ``p0`` of capacity 4 each; heartbeats; runs answered at once (a
streamed run: :data:`STREAM_EVENTS` events :data:`STREAM_GAP` apart, their send
times written as ``bench-sent:`` lines); either wire version. The process prints one
JSON line of counts every 0.1 s, read by :class:`benchmarks.scale.FleetProcess`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio
import trio_websocket

from iop_node import ReconnectConfig, backoff_delay, first_delay, websocket_connector
from iop_wire import (
    PROTOCOL_VERSION,
    PROTOCOL_VERSIONS,
    Heartbeat,
    ProtocolError,
    ProviderInfo,
    Register,
    Registered,
    Run,
    RunData,
    RunEnd,
    decode,
    encode,
    encode_data,
)

from .edge import GcClock

Connector = Callable[[trio.Nursery], AbstractAsyncContextManager[trio_websocket.WebSocketConnection]]

HANDSHAKES = 64
"""Connections the fleet process opens and registers at once (see :func:`_connection`)."""
TOKEN = "scale-token"
CAPACITY = 4
STREAM_EVENTS = 2400
STREAM_GAP = 0.005
"""A streamed run sends this many events, this many seconds apart (about 12.5 s: long enough
to outlast a reload of the 10,000-node file, whose reader takes several seconds)."""
FLEET_NICENESS = 10
"""The ``nice`` value of the process of every node but node-0: it stands in for 9,999 other
machines, whose CPU a real Edge's machine does not share, so it yields the CPU to the Edge, node-0
and the client when they want it (see :class:`FleetProcess`)."""


def source_address(index: int) -> str:
    """Node ``index``'s own loopback source address: 127.10.x.y, y in 1..250 (65,000 nodes at most)."""
    return f"127.10.{index // 250}.{index % 250 + 1}"


# ------------------------------------------------------------------ the fleet

_COMPLETION = {
    "id": "chatcmpl-scale",
    "object": "chat.completion",
    "created": 0,
    "model": "scale",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
_COMPLETION_BYTES = json.dumps(_COMPLETION).encode()


def _chunk(i: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-scale",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "scale",
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
    }


class Fleet:
    """Counts of the fake nodes, reported on stdout."""

    def __init__(self, wire: int) -> None:
        self.wire = wire
        self.registered = 0
        self.registrations = 0
        self.attempts = 0
        self.failures: dict[str, int] = {}
        self.lag = 0.0
        """The fleet loop's largest lateness since the last report, seconds."""
        self.handshakes = trio.Semaphore(HANDSHAKES)


async def _answer(ws: trio_websocket.WebSocketConnection, run: Run) -> None:
    """Answer ``run`` in data frames (the body's bytes), as a node of either wire version does."""
    if run.stream:
        sent: list[float] = []
        for i in range(STREAM_EVENTS):
            data = b"data: " + json.dumps(_chunk(i)).encode() + b"\n\n"
            await ws.send_message(encode_data([RunData(run.run_id, i, data)]))
            sent.append(time.monotonic())
            await trio.sleep(STREAM_GAP)
        await ws.send_message(encode_data([RunData(run.run_id, STREAM_EVENTS, b"data: [DONE]\n\n")]))
        sent.append(time.monotonic())
        print("bench-sent: " + " ".join(f"{t:.4f}" for t in sent), file=sys.stderr, flush=True)
    else:
        await ws.send_message(encode_data([RunData(run.run_id, 0, _COMPLETION_BYTES)]))
    await ws.send_message(encode(RunEnd(run.run_id, "ok")))


async def _session(ws: trio_websocket.WebSocketConnection, interval: float) -> None:
    async def heartbeat() -> None:
        seq = 0
        while True:
            await trio.sleep(interval)
            seq += 1
            await ws.send_message(encode(Heartbeat(seq)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        while True:
            message = decode(await ws.get_message())
            if type(message) is Run:
                nursery.start_soon(_answer, ws, message)


_GONE = (
    OSError,
    trio.TooSlowError,
    trio.BrokenResourceError,
    trio_websocket.HandshakeError,
    trio_websocket.ConnectionClosed,
    ProtocolError,
)


async def _connection(fleet: Fleet, index: int, connect: Connector, nursery: trio.Nursery) -> bool:
    """One connection of node ``index``: register and serve it. Whether it registered.

    At most :data:`HANDSHAKES` connections of the fleet are between dialling and
    ``registered`` at once. A real node handshakes on its own CPU in a round
    trip or two; this one process plays every node on a share of one core, and
    thousands of handshakes advancing together all became slower than the
    Edge's registration deadline (5 s), which then closed every one of them:
    the benchmark measured the fake fleet. Nodes waiting here have not dialled.
    """
    async with fleet.handshakes:
        stack = contextlib.AsyncExitStack()
        ws = await stack.enter_async_context(connect(nursery))
        try:
            provider = ProviderInfo("p0", "mock", CAPACITY)
            await ws.send_message(encode(Register(f"node-{index}", TOKEN, fleet.wire, (provider,))))
            reply = decode(await ws.get_message())
        except BaseException:
            await stack.aclose()
            raise
    async with stack:
        if type(reply) is not Registered:
            fleet.failures["rejected"] = fleet.failures.get("rejected", 0) + 1
            return False
        fleet.registered += 1
        fleet.registrations += 1
        try:
            await _session(ws, reply.heartbeat_interval_ms / 1000)
        finally:
            fleet.registered -= 1
    return True


async def fake_node(fleet: Fleet, index: int, port: int, rng: random.Random) -> None:
    """One node: connect, register, heartbeat, answer runs; reconnect like iop-node does.

    The delays are iop-node's own (:func:`iop_node.first_delay`, :func:`iop_node.backoff_delay`,
    default :class:`iop_node.ReconnectConfig`), so is the connector.
    """
    connect = websocket_connector(f"ws://127.0.0.1:{port}/", local_address=source_address(index))
    policy = ReconnectConfig()
    delay = first_delay(policy, rng)
    attempt = 0
    async with trio.open_nursery() as nursery:
        while True:
            await trio.sleep(delay)
            fleet.attempts += 1
            before = fleet.registrations
            try:
                await _connection(fleet, index, connect, nursery)
            except _GONE as exc:
                kind = type(exc).__name__
                fleet.failures[kind] = fleet.failures.get(kind, 0) + 1
            except BaseExceptionGroup as group:
                _, rest = group.split(_GONE)
                if rest is not None:
                    raise rest from None
            if fleet.registrations > before:
                attempt, delay = 0, first_delay(policy, rng)
            else:
                delay = backoff_delay(attempt, policy, rng)
                attempt += 1


async def _watch_lag(fleet: Fleet) -> None:
    """Record how late a 10 ms sleep wakes up: the fleet loop's own delay."""
    while True:
        start = trio.current_time()
        await trio.sleep(0.01)
        fleet.lag = max(fleet.lag, trio.current_time() - start - 0.01)


async def _freeze_survivors() -> None:
    """``gc.freeze()`` every second: full collections then scan only what is newer.

    Without it, each full collection of the fleet's growing heap (every node's
    connection, tasks, parsers: millions of objects at 10,000 nodes) held its
    loop for 1-2 s during the storm, long enough for the Edge to close
    connections whose handshake had not arrived. Freezing is O(1); cyclic
    garbage older than a young collection is kept (bounded by the run).
    """
    while True:
        await trio.sleep(1.0)
        gc.collect(1)
        gc.freeze()


async def run_fleet(port: int, first: int, nodes: int, wire: int, seed: int = 1) -> None:
    """Run ``nodes`` fake nodes from node-``first`` on; print one JSON line of counts every 0.1 s. Runs until killed."""
    fleet = Fleet(wire)
    gc_clock = GcClock()
    rng = random.Random(seed + first)

    async def report() -> None:
        while True:
            line = {
                "t": time.time(),
                "registered": fleet.registered,
                "registrations": fleet.registrations,
                "attempts": fleet.attempts,
                "failures": fleet.failures,
                "lag_ms": round(fleet.lag * 1000, 1),
                "gc2": [gc_clock.count, round(gc_clock.seconds, 3), round(gc_clock.longest, 3)],
            }
            fleet.lag = 0.0
            print(json.dumps(line), flush=True)
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(report)
        nursery.start_soon(_watch_lag, fleet)
        nursery.start_soon(_freeze_survivors)
        for i in range(first, first + nodes):
            nursery.start_soon(fake_node, fleet, i, port, random.Random(rng.random()))


WIRES = PROTOCOL_VERSIONS
STORM_TIMEOUT = 120.0
RECOVERY_MARKS = (5.0, 15.0, 30.0)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale fleet")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="the first node's number")
    parser.add_argument("--wire", type=int, choices=WIRES, default=PROTOCOL_VERSION)
    args = parser.parse_args(argv)
    trio.run(run_fleet, args.port, args.first, args.nodes, args.wire)
