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
import itertools
import json
import pathlib
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import trio
import trio_websocket

from iop_node import ReconnectConfig, backoff_delay, first_delay
from iop_wire import (
    PROTOCOL_VERSION,
    Heartbeat,
    ProtocolError,
    ProviderInfo,
    Register,
    Registered,
    Run,
    RunEnd,
    RunEvent,
    decode,
    encode,
)

from .e2e import ROOT, BenchmarkFailed, Daemon, LoadGenerator
from .loadgen import HttpConnection

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
        # Every fake node dials from 127.0.0.1; a real fleet has one address per node.
        "node_max_pending_per_address: 256",
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


async def fake_node(fleet: Fleet, index: int, port: int, rng: random.Random) -> None:
    """One node: connect, register, heartbeat, answer runs; reconnect like iop-node does.

    The delays are iop-node's own (:func:`iop_node.first_delay`, :func:`iop_node.backoff_delay`,
    default :class:`iop_node.ReconnectConfig`).
    """
    policy = ReconnectConfig()
    delay = first_delay(policy, rng)
    attempt = 0
    while True:
        await trio.sleep(delay)
        fleet.attempts += 1
        registered = False
        try:
            async with trio_websocket.open_websocket(
                "127.0.0.1", port, "/", use_ssl=False, connect_timeout=10, disconnect_timeout=1
            ) as ws:
                provider = ProviderInfo("p0", "mock", CAPACITY)
                await ws.send_message(encode(Register(f"node-{index}", TOKEN, PROTOCOL_VERSION, (provider,))))
                reply = decode(await ws.get_message())
                if type(reply) is Registered:
                    registered = True
                    fleet.registered += 1
                    fleet.registrations += 1
                    try:
                        await _session(ws, reply.heartbeat_interval_ms / 1000)
                    finally:
                        fleet.registered -= 1
        except _GONE:
            pass
        except BaseExceptionGroup as group:
            _, rest = group.split(_GONE)
            if rest is not None:
                raise rest from None
        if registered:
            attempt, delay = 0, first_delay(policy, rng)
        else:
            delay = backoff_delay(attempt, policy, rng)
            attempt += 1


_GONE = (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed, ProtocolError)


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


# ------------------------------------------------------------- the measurement

SIZES = (1_000, 5_000, 10_000)
CONCURRENCY = 32
DURATION = 3.0
WARMUP = 0.5
STORM_TIMEOUT = 120.0
START_TIMEOUT = 120.0
RECOVERY_MARKS = (5.0, 15.0, 30.0)
CHAT_PATH = "/v1/chat/completions"


def _chat(model: str, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": stream}


class FleetProcess:
    """The fake fleet as its own process; ``registered`` follows its reports."""

    def __init__(self, port: int, nodes: int, workdir: pathlib.Path) -> None:
        self.registered = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale", "fleet", "--port", str(port), "--nodes", str(nodes)],
            stdout=subprocess.PIPE,
            stderr=(workdir / "fleet.log").open("wb"),
            cwd=ROOT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.registered = json.loads(line)["registered"]

    async def wait_for(self, count: int, within: float) -> float | None:
        """Seconds until ``registered >= count`` (None: not ``within`` seconds). Checkpoints."""
        start = time.perf_counter()
        with trio.move_on_after(within):
            while self.registered < count:
                if self.proc.poll() is not None:
                    raise BenchmarkFailed(f"the fleet exited with {self.proc.returncode}")
                await trio.sleep(0.05)
            return time.perf_counter() - start
        return None

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def _start_edge(workdir: pathlib.Path, name: str) -> tuple[Daemon, float, int, int]:
    """Spawn ``iop-edge``; return it, the seconds until it listens, and its HTTP and node ports."""
    start = time.perf_counter()
    edge = Daemon(name, [sys.executable, "-m", "iop_edge", "--config", str(workdir / "edge.yaml")], workdir)
    pattern = re.compile(r"listening: http://[^:]+:(\d+) \(API\), ws://[^:]+:(\d+)")
    with trio.move_on_after(START_TIMEOUT):
        while True:
            match = pattern.search(edge.log.read_text(errors="replace"))
            if match:
                return edge, time.perf_counter() - start, int(match[1]), int(match[2])
            edge.check_alive()
            await trio.sleep(0.02)
    raise BenchmarkFailed(f"{name} did not listen within {START_TIMEOUT:.0f} s:\n{edge.tail()}")


def _rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _timed_get(port: int, path: str, runs: int = 3) -> tuple[float, bytes]:
    """Median milliseconds of ``GET path`` (one connection) and the last body."""
    connection = HttpConnection("127.0.0.1", port)
    times, last = [], b""
    try:
        for _ in range(runs):
            t0 = time.perf_counter()
            status, body = await connection.request(HttpConnection.build("GET", path))
            times.append((time.perf_counter() - t0) * 1000)
            if status != 200:
                raise BenchmarkFailed(f"GET {path}: {status}")
            last = body
    finally:
        await connection.aclose()
    return statistics.median(times), last


async def _reload_stall(edge: Daemon, port: int) -> dict[str, float]:
    """The largest gap between two events of a running stream while the Edge reloads (SIGHUP)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    arrivals: list[float] = []
    body = json.dumps(_chat("one", stream=True)).encode()
    async with stream:
        await stream.send_all(HttpConnection.build("POST", CHAT_PATH, body))
        reloads = edge.log.read_text(errors="replace").count("config reloaded")
        signalled = 0.0
        while True:
            data = await stream.receive_some(65536)
            if not data:
                break
            arrivals.extend([time.perf_counter()] * data.count(b"data: "))
            if not signalled and len(arrivals) > 50:
                edge.signal(signal.SIGHUP)
                signalled = time.perf_counter()
            if b"[DONE]" in data or b"0\r\n\r\n" in data:
                break
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    during = [b - a for a, b in itertools.pairwise(arrivals) if b >= signalled]
    applied = edge.log.read_text(errors="replace").count("config reloaded") > reloads
    return {
        "max_gap_ms": max(during, default=0.0) * 1000,
        "max_gap_before_ms": max(gaps[:40], default=0.0) * 1000,
        "events": len(arrivals),
        "reload_applied": float(applied),
    }


async def _measure_size(nodes: int, workdir: pathlib.Path, loadgen: LoadGenerator) -> dict[str, Any]:
    (workdir / "edge.yaml").write_text(edge_yaml(nodes))
    edge, start_s, http_port, node_port = await _start_edge(workdir, f"edge-{nodes}")
    fleet = FleetProcess(node_port, nodes, workdir)
    try:
        storm = await fleet.wait_for(nodes, STORM_TIMEOUT)
        row: dict[str, Any] = {"nodes": nodes, "edge_start_s": start_s, "storm_s": storm}
        row["rss_mb"] = _rss_mb(edge.proc.pid)
        row["status_ms"], body = await _timed_get(http_port, "/status")
        row["status_bytes"] = len(body)
        row["status_node_ms"], _ = await _timed_get(http_port, "/status?node=node-0")
        row["metrics_ms"], body = await _timed_get(http_port, "/metrics")
        row["metrics_bytes"] = len(body)
        row["metrics_series"] = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        for model in ("one", "all"):
            result = await loadgen.measure(
                port=http_port, path=CHAT_PATH, body=_chat(model), concurrency=CONCURRENCY, duration=DURATION
            )
            row[f"rps_{model}"] = result["rps"]
            row[f"errors_{model}"] = result["errors"]
        row["reload"] = await _reload_stall(edge, http_port)
        row["recovery"] = await _restart(edge, fleet, workdir, nodes, node_port)
    finally:
        fleet.stop()
        edge.stop()
    return row


async def _restart(
    edge: Daemon, fleet: FleetProcess, workdir: pathlib.Path, nodes: int, node_port: int
) -> dict[str, Any]:
    """SIGTERM the Edge, start it again; share of nodes registered 5 / 15 / 30 s after it listens.

    The nodes keep dialling the port they know, so the new Edge binds the node port
    the kernel gave the first one (free again once it exited).
    """
    edge.stop(timeout=30)
    (workdir / "edge.yaml").write_text(
        edge_yaml(nodes).replace("node_listen: 127.0.0.1:0", f"node_listen: 127.0.0.1:{node_port}")
    )
    new, start_s, _, _ = await _start_edge(workdir, f"edge-{nodes}-restarted")
    out: dict[str, Any] = {"edge_start_s": start_s}
    t0 = time.perf_counter()
    for mark in RECOVERY_MARKS:
        await trio.sleep(max(0.0, t0 + mark - time.perf_counter()))
        out[f"share_{mark:g}s"] = fleet.registered / nodes
    new.stop()
    return out


async def _main(sizes: tuple[int, ...], workdir: pathlib.Path) -> dict[str, Any]:
    loadgen = LoadGenerator()
    try:
        rows = []
        for nodes in sizes:
            print(f"   {nodes} nodes ...", file=sys.stderr, flush=True)
            rows.append(await _measure_size(nodes, workdir, loadgen))
    finally:
        loadgen.stop()
    return {"rows": rows, "concurrency": CONCURRENCY, "duration_s": DURATION}


def run(runs: int = 1, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Measure every fleet size once (``runs`` is ignored: one pass takes minutes)."""
    del runs
    with tempfile.TemporaryDirectory(prefix="iop-scale-") as tmp:
        return trio.run(_main, sizes, pathlib.Path(tmp))


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}{unit}"


def table(result: dict[str, Any]) -> str:
    """Format :func:`run`'s result as a Markdown table."""
    lines = [
        "| nodes | registration storm | Edge start | RSS | `/status` | `/metrics` | requests/s, 1 / all candidates "
        "| reload: largest stream gap | after a restart: registered at 5 / 15 / 30 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        rec = r["recovery"]
        shares = " / ".join(f"{rec[f'share_{m:g}s']:.1%}" for m in RECOVERY_MARKS)
        lines.append(
            f"| {r['nodes']:,} | {_fmt(r['storm_s'], ' s')} | {_fmt(r['edge_start_s'], ' s')} "
            f"| {r['rss_mb']:.0f} MB | {r['status_ms']:.0f} ms, {r['status_bytes'] / 1e6:.2f} MB "
            f"| {r['metrics_ms']:.0f} ms, {r['metrics_bytes'] / 1e6:.2f} MB "
            f"| {r['rps_one']:,.0f} / {r['rps_all']:,.0f} | {r['reload']['max_gap_ms']:.0f} ms "
            f"| {shares} (Edge start {rec['edge_start_s']:.1f} s) |"
        )
    return "\n".join(lines)


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
        sizes = tuple(int(n) for n in sys.argv[1:]) or SIZES
        print(table(run(sizes=sizes)))
