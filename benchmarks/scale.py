"""One Edge at fleet size: 1,000 / 5,000 / 10,000 fake nodes (``python -m benchmarks scale``).

Three processes, so the Edge's loop carries only the Edge: the Edge (``iop-edge``
on a generated ``edge.yaml``), the fake fleet (``python -m benchmarks.scale fleet``:
every node in one trio process, wire v1, one provider ``p0`` of capacity 4 each,
heartbeats, answers runs at once) and the load generator
(:mod:`benchmarks.loadgen`). Model key ``one`` lists node-0's provider only,
``all`` lists every node's.

Measured per fleet size: the registration storm (fleet start to every node
registered), Edge start (spawn to listening), the Edge's RSS, ``/status`` and
``/metrics`` time and size, requests/s on ``one`` and on ``all`` (32 clients,
closed loop), the reload stall (the largest gap between two events of a running
stream while the Edge reloads its config), and restart recovery (share of nodes
registered again 5 / 15 / 30 s after a restarted Edge listens).

Every port is chosen by the kernel; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from typing import Any

import trio
import trio_websocket

from iop_wire import (
    PROTOCOL_VERSION,
    Heartbeat,
    ProviderInfo,
    Register,
    Registered,
    Run,
    RunEnd,
    RunEvent,
    decode,
    encode,
)

TOKEN = "scale-token"
CAPACITY = 4
STREAM_EVENTS = 400
STREAM_GAP = 0.005
"""A streamed run sends this many events, this many seconds apart."""


def edge_yaml(nodes: int, heartbeat_timeout_ms: int = 15000) -> str:
    """An ``edge.yaml`` for ``nodes`` fake nodes; ports are left to the kernel (``:0``)."""
    lines = [
        "listen: 127.0.0.1:0",
        "node_listen: 127.0.0.1:0",
        f"heartbeat_timeout_ms: {heartbeat_timeout_ms}",
        "provider_pool: {max_queue: 4096, queue_timeout_ms: 30000}",
        "nodes:",
    ]
    for i in range(nodes):
        lines += [
            f"  - id: node-{i}",
            f"    token: {TOKEN}",
            "    providers:",
            f"      - {{id: p0, capacity: {CAPACITY}, long_context_capacity: 1, context_window_tokens: 8192,",
            "         total_context_tokens: 8192, priority: 0, enabled: true}",
        ]
    lines += ["models:", "  - id: one", "    candidates:", "      - {node: node-0, provider: p0}"]
    lines += ["  - id: all", "    candidates:"]
    lines += [f"      - {{node: node-{i}, provider: p0}}" for i in range(nodes)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the fleet

_COMPLETION = {
    "id": "chatcmpl-scale",
    "object": "chat.completion",
    "created": 0,
    "model": "scale",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


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

    def __init__(self) -> None:
        self.registered = 0
        self.registrations = 0
        self.attempts = 0


async def _answer(ws: trio_websocket.WebSocketConnection, run: Run) -> None:
    if run.stream:
        for i in range(STREAM_EVENTS):
            await ws.send_message(encode(RunEvent(run.run_id, _chunk(i))))
            await trio.sleep(STREAM_GAP)
    else:
        await ws.send_message(encode(RunEvent(run.run_id, _COMPLETION)))
    await ws.send_message(encode(RunEnd(run.run_id, "ok")))


async def _session(fleet: Fleet, ws: trio_websocket.WebSocketConnection, interval: float) -> None:
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


async def fake_node(fleet: Fleet, index: int, port: int, rng: random.Random) -> None:
    """One node: connect, register, heartbeat, answer runs; reconnect after a jittered delay."""
    delay = 1.0
    while True:
        await trio.sleep(rng.uniform(0, delay))  # jitter, the first attempt too
        fleet.attempts += 1
        try:
            async with trio_websocket.open_websocket("127.0.0.1", port, "/", use_ssl=False) as ws:
                provider = ProviderInfo("p0", "mock", CAPACITY)
                await ws.send_message(encode(Register(f"node-{index}", TOKEN, PROTOCOL_VERSION, (provider,))))
                reply = decode(await ws.get_message())
                if type(reply) is not Registered:
                    raise trio_websocket.ConnectionClosed(None)
                fleet.registered += 1
                fleet.registrations += 1
                delay = 1.0
                try:
                    await _session(fleet, ws, reply.heartbeat_interval_ms / 1000)
                finally:
                    fleet.registered -= 1
        except (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed):
            pass
        delay = min(delay * 2, 10.0)


async def run_fleet(port: int, nodes: int, spread: float, seed: int = 1) -> None:
    """Run ``nodes`` fake nodes; print ``{"t", "registered", ...}`` every 0.1 s. Runs until killed."""
    fleet = Fleet()
    rng = random.Random(seed)

    async def report() -> None:
        while True:
            print(
                json.dumps(
                    {
                        "t": time.time(),
                        "registered": fleet.registered,
                        "registrations": fleet.registrations,
                        "attempts": fleet.attempts,
                    }
                ),
                flush=True,
            )
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(report)
        for i in range(nodes):
            nursery.start_soon(fake_node, fleet, i, port, random.Random(rng.random()))
            if spread and i % 100 == 99:
                await trio.sleep(spread * 100 / nodes)


def _main_fleet(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale fleet")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--spread", type=float, default=0.0, help="seconds over which nodes start")
    args = parser.parse_args(argv)
    trio.run(run_fleet, args.port, args.nodes, args.spread)


if __name__ == "__main__":
    if sys.argv[1:2] == ["fleet"]:
        _main_fleet(sys.argv[2:])
    elif sys.argv[1:2] == ["config"]:
        sys.stdout.write(edge_yaml(int(sys.argv[2])))
    else:
        print("usage: python -m benchmarks.scale fleet|config ...", file=sys.stderr)
        raise SystemExit(2)
    _ = math
