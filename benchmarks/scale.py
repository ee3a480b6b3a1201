"""One Edge at fleet size: 1,000 / 5,000 / 10,000 fake nodes (``python -m benchmarks.scale``).

Three processes, so the Edge's loop carries only the Edge: the Edge (``iop-edge``
on a generated ``edge.yaml``), the fake fleet (``python -m benchmarks.scale fleet``:
every node in one trio process, one provider ``p0`` of capacity 4 each,
heartbeats, answers runs at once, wire v1 or v2) and the load generator
(:mod:`benchmarks.loadgen`). Model key ``one`` lists node-0's provider only,
``all`` lists every node's.

Each fake node dials the Edge through iop-node's own connector
(:func:`iop_node.websocket_connector`) with iop-node's reconnect delays, from
its own loopback address (127.10.x.y: Linux routes all of 127.0.0.0/8 to the
loopback interface), as the nodes of a real fleet each have their own address.
The Edge runs with its default node socket limits (256 pending connections,
8 per address).

Measured per fleet size and wire version: the registration storm (fleet start
to every node registered), Edge start (spawn to listening), the Edge's RSS,
``/status`` and ``/metrics`` time and size, requests/s on ``one`` and on ``all``
(32 clients, closed loop) with the Edge's and the fleet's CPU per request, the
reload stall (the largest gap between two events of a running stream while
the Edge reloads its config), and restart recovery (share of nodes registered
again 5 / 15 / 30 s after a restarted Edge listens).

Every port is chosen by the kernel; every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import pathlib
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import trio
import trio_websocket

from iop_edge._config_reader import lower_priority
from iop_node import ReconnectConfig, backoff_delay, first_delay, websocket_connector
from iop_wire import (
    Heartbeat,
    ProtocolError,
    ProviderInfo,
    Register,
    Registered,
    Run,
    RunData,
    RunEnd,
    RunEvent,
    decode,
    encode,
    encode_data,
)

from .awake import cpus_awake
from .e2e import ROOT, BenchmarkFailed, Daemon, LoadGenerator, _cpu_seconds
from .loadgen import HttpConnection

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
SPINNER = (sys.executable, "-c", "import os, sys\nwhile os.getppid() == int(sys.argv[1]): pass")
"""The control of the reload stall: a process that only uses the CPU, run as the reload's reader
runs (idle priority, a session of its own); it ends by itself if the benchmark dies."""
AFTER_RELOAD = 0.5
"""Seconds after the reload ended that its window of the stream still counts (its new objects'
first collections, the reload's log line)."""


def edge_yaml(
    nodes: int, heartbeat_timeout_ms: int = 15000, node_listen: str = "127.0.0.1:0", extra: tuple[str, ...] = ()
) -> str:
    """An ``edge.yaml`` for ``nodes`` fake nodes; ports are left to the kernel (``:0``).

    ``extra``: more top-level lines (e.g. ``node_max_pending: 1024``).
    """
    lines = [
        "listen: 127.0.0.1:0",
        f"node_listen: {node_listen}",
        f"heartbeat_timeout_ms: {heartbeat_timeout_ms}",
        "provider_pool: {max_queue: 4096, queue_timeout_ms: 30000}",
        *extra,
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


async def _answer(ws: trio_websocket.WebSocketConnection, run: Run, wire: int) -> None:
    """Answer ``run``: v1 as ``run_event`` messages, v2 as data frames (the body's bytes)."""
    if wire >= 2:
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
    elif run.stream:
        for i in range(STREAM_EVENTS):
            await ws.send_message(encode(RunEvent(run.run_id, _chunk(i))))
            await trio.sleep(STREAM_GAP)
    else:
        await ws.send_message(encode(RunEvent(run.run_id, _COMPLETION)))
    await ws.send_message(encode(RunEnd(run.run_id, "ok")))


async def _session(ws: trio_websocket.WebSocketConnection, interval: float, wire: int) -> None:
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
                nursery.start_soon(_answer, ws, message, wire)


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
            await _session(ws, reply.heartbeat_interval_ms / 1000, fleet.wire)
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


class GcClock:
    """Seconds spent in full (generation 2) garbage collections, through ``gc.callbacks``."""

    def __init__(self, write_over: float | None = None) -> None:
        self.write_over = write_over
        """Write each collection (any generation) longer than this many seconds to stderr:
        ``bench-gc: END MS GENERATION`` (END as :class:`LoopTracer`'s)."""
        self.seconds = 0.0
        self.longest = 0.0
        self.count = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        if self.write_over is not None and took > self.write_over:
            print(f"bench-gc: {time.monotonic():.4f} {took * 1000:.2f} {info['generation']}", file=sys.stderr)
        if info["generation"] == 2:
            self.seconds += took
            self.longest = max(self.longest, took)
            self.count += 1


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


# ------------------------------------------------------------- the measurement

SIZES = (1_000, 5_000, 10_000)
WIRES = (1, 2)
CONCURRENCY = 32
DURATION = 3.0
STORM_TIMEOUT = 120.0
START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0
RECOVERY_MARKS = (5.0, 15.0, 30.0)
CHAT_PATH = "/v1/chat/completions"


def _chat(model: str, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": stream}


class FleetProcess:
    """The fake fleet: node-0 (the one-candidate key's provider) alone in one process, every other node in another.

    The 1-candidate load then measures the Edge at fleet size, not the fleet
    process's loop: that loop carries every other node's heartbeats and, on a
    shared box, wakes up hundreds of milliseconds late, which alone capped the
    1-candidate key (4 runs in flight) at 4 / that delay requests/s. The
    large process runs at ``nice`` :data:`FLEET_NICENESS`: it plays machines
    of their own, so on this shared box it should not take the CPU from the
    Edge, node-0 or the client at equal terms (node-0 and the client keep the
    Edge's priority). :attr:`registered` sums both; :attr:`history` holds ``(time, registered,
    lag_ms)`` per report of the large process (with node-0's state then).
    """

    def __init__(self, port: int, nodes: int, wire: int, workdir: pathlib.Path) -> None:
        self.counts = [0, 0]
        self.last: dict[str, Any] = {"registered": 0, "lag_ms": 0.0}
        self.history: list[tuple[float, int, float]] = []
        self.node0_log = workdir / "fleet-node-0.log"
        """node-0's process's stderr (its streams' send times, ``bench-sent:`` lines)."""
        self.procs = [
            self._spawn(port, 0, 1, wire, self.node0_log),
            self._spawn(port, 1, nodes - 1, wire, workdir / "fleet.log"),
        ]
        os.setpriority(os.PRIO_PROCESS, self.procs[1].pid, FLEET_NICENESS)
        for index in (0, 1):
            threading.Thread(target=self._read, args=(index,), daemon=True).start()

    @staticmethod
    def _spawn(port: int, first: int, count: int, wire: int, log: pathlib.Path) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "benchmarks.scale", "fleet", "--port", str(port), "--wire", str(wire)]
        return subprocess.Popen(
            [*argv, "--first", str(first), "--nodes", str(count)],
            stdout=subprocess.PIPE,
            stderr=log.open("wb"),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
            text=True,
        )

    @property
    def proc(self) -> subprocess.Popen[str]:
        """The process of every node but node-0."""
        return self.procs[1]

    @property
    def registered(self) -> int:
        return sum(self.counts)

    def _read(self, index: int) -> None:
        stdout = self.procs[index].stdout
        assert stdout is not None
        for line in stdout:
            report = json.loads(line)
            self.counts[index] = report["registered"]
            if index == 1:
                self.last = report
                self.history.append((time.perf_counter(), self.registered, report["lag_ms"]))

    def max_lag_ms(self, since: float) -> float:
        """The large fleet process's largest loop lateness reported since ``since`` (``time.perf_counter``)."""
        return max((lag for t, _, lag in self.history if t >= since), default=0.0)

    def cpu_seconds(self) -> float:
        return sum(_cpu_seconds(proc.pid) for proc in self.procs)

    async def wait_for(self, count: int, within: float) -> float | None:
        """Seconds until ``registered >= count`` (None: not ``within`` seconds). Checkpoints."""
        start = time.perf_counter()
        with trio.move_on_after(within):
            while self.registered < count:
                for proc in self.procs:
                    if proc.poll() is not None:
                        raise BenchmarkFailed(f"a fleet process exited with {proc.returncode}")
                await trio.sleep(0.05)
            return time.perf_counter() - start
        return None

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


async def _start_edge(workdir: pathlib.Path, name: str) -> tuple[Daemon, float, int, int]:
    """Spawn ``iop-edge``; return it, the seconds until it listens, and its HTTP and node ports."""
    start = time.perf_counter()
    argv = [sys.executable, "-m", "benchmarks.scale", "edge", "--config", str(workdir / "edge.yaml")]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    edge = Daemon(name, argv, workdir, env=env)
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


def _pending_closed(metrics: bytes) -> dict[str, float]:
    """``iop_node_pending_closed_total`` by reason, from a ``/metrics`` body."""
    out = {}
    for match in re.finditer(rb'^iop_node_pending_closed_total\{reason="([a-z_]+)"\} ([0-9.e+]+)$', metrics, re.M):
        out[match[1].decode()] = float(match[2])
    return out


async def _stream_gaps(port: int, at_mark: Callable[[], object] | None = None) -> tuple[float, list[float]]:
    """Run one streamed request; call ``at_mark`` at its 51st event (SIGHUP the Edge, start the control).

    Returns the time of the 51st event (``time.monotonic()``, as the Edge's
    :class:`LoopTracer` lines) and every event's arrival time.
    """
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    arrivals: list[float] = []
    body = json.dumps(_chat("one", stream=True)).encode()
    mark = 0.0
    with trio.move_on_after(60):
        async with stream:
            await stream.send_all(HttpConnection.build("POST", CHAT_PATH, body))
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    break
                arrivals.extend([time.monotonic()] * data.count(b"data: "))
                if not mark and len(arrivals) > 50:
                    if at_mark is not None:
                        at_mark()
                    mark = time.monotonic()
                if b"[DONE]" in data or b"0\r\n\r\n" in data:
                    break
    return mark, arrivals


class _Spinner:
    """:data:`SPINNER` started at idle priority in a session of its own, as the reload's reader is
    (:func:`iop_edge._config_reader.lower_priority`); :meth:`stop` kills it (it ends by itself
    once this process is gone)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([*SPINNER, str(os.getpid())], start_new_session=True)
        lower_priority(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


_LOOP_LINE = re.compile(r"^bench-loop: ([0-9.]+) ([0-9.]+) (\d+) ([0-9.]+) (\S+) ([0-9.]+)", re.M)
_LOOPSUM_LINE = re.compile(r"^bench-loopsum: ([0-9.]+) ([0-9.]+) ([0-9.]+) ([0-9.]+) (\d+) ([0-9.]+) ([0-9.]+)", re.M)
_RELOAD_LINE = re.compile(r"config reloaded from \S+ \((.*)\)$", re.M)
_SENT_LINE = re.compile(r"^bench-sent: (.*)$", re.M)


def _loop_holds(log: str, since: float, until: float) -> tuple[float, str, int, float]:
    """The Edge loop's longest batch between ``since`` and ``until`` (ms, its longest step's task,
    its steps, the loop thread's CPU ms in it), from :class:`LoopTracer`'s lines."""
    holds = [
        (float(m[2]), m[5], int(m[3]), float(m[6])) for m in _LOOP_LINE.finditer(log) if since <= float(m[1]) <= until
    ]
    return max(holds, default=(0.0, "", 0, 0.0))


def _loop_time(log: str, since: float, until: float) -> dict[str, float]:
    """The Edge loop's time between ``since`` and ``until`` (:class:`LoopTracer`'s 0.1 s sums), ms: in
    batches, the loop thread's CPU time, the batches' time it did not run (``waited``: for the GIL or
    for a CPU) and its time runnable but waiting for a CPU (in batches or not)."""
    sums = [m for m in _LOOPSUM_LINE.finditer(log) if since <= float(m[1]) <= until]
    busy, cpu, runq = (sum(float(m[k]) for m in sums) for k in (3, 6, 7))
    return {"busy_ms": busy, "cpu_ms": cpu, "waited_ms": max(0.0, busy - cpu), "runq_ms": runq}


def _sent_times(node0_log: pathlib.Path | None) -> list[list[float]]:
    """node-0's send times of each stream it answered so far (its ``bench-sent:`` lines)."""
    text = node0_log.read_text(errors="replace") if node0_log else ""
    return [[float(t) for t in line.split()] for line in _SENT_LINE.findall(text)]


def _largest_gap(mark: float, until: float, arrivals: list[float], sent: list[float], log: str) -> dict[str, Any]:
    """The stream's largest gap between ``mark`` and ``until``, taken apart: where the time went.

    ``sent``: node-0's send time of each event (``time.monotonic()``, the same
    clock in every process). ``at_ms`` is when the gap ended, from ``mark``;
    ``sent_ms`` is node-0's own gap between the two events, ``transit_ms`` the
    later event's time from node-0's send to the client's read (the earlier
    one's in brackets: their difference is what the path after node-0 added to
    the gap), ``loop_ms`` the Edge loop's longest batch or late I/O wait that
    ended inside the gap. ``sent_max_ms`` is node-0's own largest gap between
    two events in the window, wherever it fell: how long the fake fleet's
    process itself was held up.
    """
    pairs = [
        (b - a, i) for i, (a, b) in enumerate(itertools.pairwise(arrivals), start=1) if mark and mark <= b <= until
    ]
    gap, i = max(pairs, default=(0.0, 0))
    out: dict[str, Any] = {
        "max_gap_ms": gap * 1000,
        "at_ms": (arrivals[i] - mark) * 1000 if i else None,
        "sent_ms": None,
        "transit_ms": None,
        "transit_before_ms": None,
        "sent_max_ms": None,
    }
    if i and len(sent) == len(arrivals):
        out["sent_max_ms"] = max((sent[j] - sent[j - 1]) * 1000 for _, j in pairs)
        out["sent_ms"] = (sent[i] - sent[i - 1]) * 1000
        out["transit_ms"] = (arrivals[i] - sent[i]) * 1000
        out["transit_before_ms"] = (arrivals[i - 1] - sent[i - 1]) * 1000
    start, end = (arrivals[i - 1], arrivals[i]) if i else (mark, mark)
    out["loop_ms"], out["loop_task"], out["loop_steps"], out["loop_cpu_ms"] = _loop_holds(log, start, end + 0.001)
    return out


def _reload_seconds(steps: str) -> float:
    """A reload's length from its log line's steps (``read 5425.6 ms, rebuild ...``; the CPU
    figures at the end are not steps)."""
    return sum(float(m[2]) for m in re.finditer(r"(^|, )(?!reader|worker)[a-z +]+ ([0-9.]+) ms", steps)) / 1000


async def _reload_stall(edge: Daemon, port: int, node0_log: pathlib.Path | None = None) -> dict[str, Any]:
    """The largest gap between two events of a running stream while the Edge reloads (SIGHUP),
    against the same stream with no reload and with the control (:data:`SPINNER`) just after;
    where the Edge's time went.

    The reload's window runs from the stream's 51st event, when the Edge gets
    the SIGHUP, to :data:`AFTER_RELOAD` after the reload ended (its steps'
    total); the stream with no reload, and the one with the spinner started at
    its 51st event, are measured over windows of the same length, so the three
    maxima compare. The spinner takes the CPU the reload's reader takes, at
    the same priority, and nothing else: what the box itself adds to a stream
    while some process uses its idle CPU. ``covered`` says whether the stream
    lasted the whole window. The Edge's log gives the reload's steps and its
    loop's longest batch in each window; node-0's log (``node0_log``) its send
    times, to tell the Edge's part of the largest gap from node-0's
    (:func:`_largest_gap`).
    """
    reloads = edge.log.read_text(errors="replace").count("config reloaded")
    out: dict[str, Any] = {}
    window = 0.0
    spinner = _Spinner()
    for key, at_mark in (
        ("reload", lambda: edge.signal(signal.SIGHUP)),
        ("baseline", None),
        ("spinner", spinner.start),
    ):
        sent_before = len(_sent_times(node0_log))
        try:
            mark, arrivals = await _stream_gaps(port, at_mark)
        finally:
            spinner.stop()
        if key == "reload":
            with trio.move_on_after(60):
                while edge.log.read_text(errors="replace").count("config reloaded") <= reloads:
                    await trio.sleep(0.05)
            steps = _RELOAD_LINE.findall(edge.log.read_text(errors="replace"))
            out["reload_applied"] = float(len(steps) > reloads)
            out["steps"] = steps[-1] if len(steps) > reloads else ""
            window = _reload_seconds(out["steps"]) + AFTER_RELOAD
        await trio.sleep(0.2)  # the Edge's last loop lines, node-0's send times
        log = edge.log.read_text(errors="replace")
        streams = _sent_times(node0_log)
        sent = streams[-1] if len(streams) > sent_before else []
        until = mark + window
        end = min(arrivals[-1], until) if arrivals else mark
        out[f"{key}_covered"] = bool(arrivals) and arrivals[-1] >= until
        out[f"{key}_largest"] = _largest_gap(mark, until, arrivals, sent, log)
        out[f"{key}_max_gap_ms"] = out[f"{key}_largest"]["max_gap_ms"]
        hold = _loop_holds(log, mark, end)
        out[f"{key}_loop_max_ms"], out[f"{key}_loop_max_task"], out[f"{key}_loop_max_steps"], _ = hold
        out[f"{key}_loop_time"] = _loop_time(log, mark, end)
        out[f"{key}_events"] = len(arrivals)
    out["window_s"] = window
    out["max_gap_ms"] = out["reload_max_gap_ms"]
    return out


class Profiler:
    """``py-spy record`` on a process for a while, when a py-spy binary was given (else nothing)."""

    def __init__(self, py_spy: str | None, out: pathlib.Path) -> None:
        self.py_spy = py_spy
        self.out = out
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, pid: int, name: str, seconds: float) -> None:
        if self.py_spy is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        argv = [self.py_spy, "record", "--pid", str(pid), "--duration", str(round(seconds)), "--rate", "200"]
        argv += ["--format", "raw", "--output", str(self.out / f"{name}.txt"), "--nonblocking"]
        self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def wait(self) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


async def _load(
    edge: Daemon, fleet: FleetProcess, loadgen: LoadGenerator, port: int, model: str, profiler: Profiler, tag: str
) -> dict[str, Any]:
    """Requests/s on ``model``, the Edge's and the fleet's CPU per request, the fleet's loop lag."""
    profiler.start(edge.proc.pid, f"{tag}-{model}-edge", DURATION + 0.5)
    profiler.start(fleet.proc.pid, f"{tag}-{model}-fleet", DURATION + 0.5)
    edge_cpu, fleet_cpu, t0 = edge.cpu_seconds(), fleet.cpu_seconds(), time.perf_counter()
    gc_before = edge_gc(edge)
    result = await loadgen.measure(
        port=port, path=CHAT_PATH, body=_chat(model), concurrency=CONCURRENCY, duration=DURATION
    )
    wall = time.perf_counter() - t0
    requests = max(1, result["requests"])
    profiler.wait()
    await trio.sleep(0.6)  # the Edge's next GC report
    gc_after = edge_gc(edge)
    return {
        "edge_gc2": gc_after[0] - gc_before[0],
        "edge_gc2_s": gc_after[1] - gc_before[1],
        "rps": result["rps"],
        "errors": result["errors"],
        "p50_ms": result.get("p50_ms"),
        "edge_cpu_us_per_request": (edge.cpu_seconds() - edge_cpu) / requests * 1e6,
        "edge_cpu_share": (edge.cpu_seconds() - edge_cpu) / wall,
        "fleet_cpu_share": (fleet.cpu_seconds() - fleet_cpu) / wall,
        "fleet_max_lag_ms": fleet.max_lag_ms(t0),
    }


async def _steady(edge: Daemon, fleet: FleetProcess, seconds: float) -> dict[str, float]:
    """The Edge's and the fleet's CPU share over ``seconds`` with no client traffic (heartbeats)."""
    edge_cpu, fleet_cpu, t0 = edge.cpu_seconds(), fleet.cpu_seconds(), time.perf_counter()
    await trio.sleep(seconds)
    wall = time.perf_counter() - t0
    return {
        "edge_idle_cpu_share": (edge.cpu_seconds() - edge_cpu) / wall,
        "fleet_idle_cpu_share": (fleet.cpu_seconds() - fleet_cpu) / wall,
    }


@attrs.frozen
class Options:
    """What a run measures besides the fleet sizes and wires."""

    extra: tuple[str, ...] = ()
    """More top-level ``edge.yaml`` lines."""
    reload_only: bool = False
    """After the storm, only ``/status`` and the reload stall (no load, ``/metrics`` or restart)."""
    reloads: int = 1
    """Reload stalls measured per fleet size (each: a stream with no reload, then one with)."""


async def _measure_size(
    nodes: int, wire: int, workdir: pathlib.Path, loadgen: LoadGenerator, profiler: Profiler, options: Options
) -> dict[str, Any]:
    extra = options.extra
    (workdir / "edge.yaml").write_text(edge_yaml(nodes, extra=extra))
    edge, start_s, http_port, node_port = await _start_edge(workdir, f"edge-{nodes}-v{wire}")
    fleet = FleetProcess(node_port, nodes, wire, workdir)
    edge_cpu = edge.cpu_seconds()
    try:
        storm = await fleet.wait_for(nodes, STORM_TIMEOUT)
        row: dict[str, Any] = {"nodes": nodes, "wire": wire, "edge_start_s": start_s, "storm_s": storm}
        row["storm_registered"] = fleet.registered
        row["storm_edge_cpu_s"] = edge.cpu_seconds() - edge_cpu
        row["storm_edge_gc2"] = edge_gc(edge)
        row["storm_fleet_failures"] = fleet.last.get("failures", {})
        row["rss_mb"] = _rss_mb(edge.proc.pid)
        row.update(await _steady(edge, fleet, 3.0))
        row["status_ms"], body = await _timed_get(http_port, "/status")
        row["status_bytes"] = len(body)
        row["status_node_ms"], _ = await _timed_get(http_port, "/status?node=node-0")
        if options.reload_only:
            row["reloads"] = [await _reload_stall(edge, http_port, fleet.node0_log) for _ in range(options.reloads)]
            return row
        row["metrics_ms"], body = await _timed_get(http_port, "/metrics")
        row["metrics_bytes"] = len(body)
        row["metrics_series"] = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        row["storm_pending_closed"] = _pending_closed(body)
        for model in ("one", "all"):
            row[model] = await _load(edge, fleet, loadgen, http_port, model, profiler, f"{nodes}-v{wire}")
        row["reloads"] = [await _reload_stall(edge, http_port, fleet.node0_log) for _ in range(options.reloads)]
        row["reload"] = row["reloads"][0]
        row["recovery"] = await _restart(edge, fleet, workdir, nodes, node_port, wire, extra)
    finally:
        fleet.stop()
        edge.stop()
    return row


async def _restart(
    edge: Daemon,
    fleet: FleetProcess,
    workdir: pathlib.Path,
    nodes: int,
    node_port: int,
    wire: int,
    extra: tuple[str, ...],
) -> dict[str, Any]:
    """SIGTERM the Edge, start it again; share of nodes registered 5 / 15 / 30 s after it listens.

    The nodes keep dialling the port they know, so the new Edge binds the node port
    the kernel gave the first one (free again once it exited). Stops early once
    every node is back.
    """
    edge.stop(timeout=STOP_TIMEOUT)
    (workdir / "edge.yaml").write_text(edge_yaml(nodes, node_listen=f"127.0.0.1:{node_port}", extra=extra))
    new, start_s, _, _ = await _start_edge(workdir, f"edge-{nodes}-v{wire}-restarted")
    out: dict[str, Any] = {"edge_start_s": start_s}
    try:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            probes: list[float] = []
            nursery.start_soon(_probe_healthz, _http_port(new), probes)
            all_back = await fleet.wait_for(nodes, RECOVERY_MARKS[-1])
            nursery.cancel_scope.cancel()
        out["all_back_s"] = all_back
        out["healthz_max_ms"] = max(probes, default=0.0) * 1000
        out["healthz_p50_ms"] = statistics.median(probes) * 1000 if probes else 0.0
        for mark in RECOVERY_MARKS:
            counts = [n for t, n, _ in fleet.history if t <= t0 + mark]
            out[f"share_{mark:g}s"] = (counts[-1] if counts else 0) / nodes
            if all_back is not None and all_back <= mark:
                out[f"share_{mark:g}s"] = 1.0
        out["pending_closed"] = _pending_closed((await _timed_get(_http_port(new), "/metrics", runs=1))[1])
    finally:
        new.stop()
    return out


async def _probe_healthz(port: int, probes: list[float]) -> None:
    """``GET /healthz`` every 50 ms on one connection, each answer's seconds in ``probes`` (client
    traffic while the fleet reconnects). Checkpoints; runs until cancelled."""
    connection = HttpConnection("127.0.0.1", port)
    try:
        while True:
            t0 = time.perf_counter()
            await connection.request(HttpConnection.build("GET", "/healthz"))
            probes.append(time.perf_counter() - t0)
            await trio.sleep(0.05)
    finally:
        with trio.CancelScope(shield=True):
            await connection.aclose()


def _http_port(edge: Daemon) -> int:
    match = re.search(r"listening: http://[^:]+:(\d+)", edge.log.read_text(errors="replace"))
    assert match is not None
    return int(match[1])


async def _main(
    sizes: tuple[int, ...], wires: tuple[int, ...], workdir: pathlib.Path, profiler: Profiler, options: Options
) -> dict[str, Any]:
    loadgen = LoadGenerator()
    load_before = os.getloadavg()
    try:
        rows = []
        for nodes in sizes:
            for wire in wires:
                print(f"   {nodes} nodes, wire v{wire} ...", file=sys.stderr, flush=True)
                rows.append(await _measure_size(nodes, wire, workdir, loadgen, profiler, options))
                if not options.reload_only:
                    print(table({"rows": rows[-1:]}).splitlines()[2], file=sys.stderr, flush=True)
    finally:
        loadgen.stop()
    return {
        "rows": rows,
        "concurrency": CONCURRENCY,
        "duration_s": DURATION,
        "edge_config": list(options.extra),
        "reload_only": options.reload_only,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def run(
    runs: int = 1,
    sizes: tuple[int, ...] = SIZES,
    wires: tuple[int, ...] = WIRES,
    py_spy: str | None = None,
    profile_dir: pathlib.Path | None = None,
    extra: tuple[str, ...] = (),
    reload_only: bool = False,
    reloads: int = 1,
) -> dict[str, Any]:
    """Measure every fleet size and wire version once (``runs`` is ignored: one pass takes minutes),
    the CPUs held out of deep idle meanwhile (:func:`benchmarks.awake.cpus_awake`).

    ``py_spy``: a py-spy binary; the Edge and the fleet are then profiled under
    each load (raw folded stacks in ``profile_dir``). ``extra``, ``reload_only``,
    ``reloads``: see :class:`Options`.
    """
    del runs
    with tempfile.TemporaryDirectory(prefix="iop-scale-") as tmp, cpus_awake() as awake:
        profiler = Profiler(py_spy, profile_dir or pathlib.Path(tmp) / "profiles")
        options = Options(extra, reload_only, reloads)
        return {**trio.run(_main, sizes, wires, pathlib.Path(tmp), profiler, options), "cpus_awake": awake}


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}{unit}"


def table(result: dict[str, Any]) -> str:
    """Format :func:`run`'s result as Markdown tables (the issue's figures, then the CPU behind them,
    then the reload stall taken apart; with ``reload_only``, the storm and ``/status``, then the stalls)."""
    if result.get("reload_only"):
        lines = _reload_only_table(result["rows"])
    else:
        lines = _load_tables(result["rows"])
    lines += _reload_table(result["rows"])
    if result.get("edge_config"):
        lines += ["", "edge.yaml also set: " + ", ".join(f"`{line}`" for line in result["edge_config"])]
    if "loadavg_before" in result:
        before, after = result["loadavg_before"], result["loadavg_after"]
        lines += ["", f"load average before {before[0]:.1f}, after {after[0]:.1f} (1 min)"]
    if "cpus_awake" in result:
        held = "held awake" if result["cpus_awake"] else "not held awake (no PM QoS here)"
        lines += ["", f"CPUs {held} (benchmarks/awake.py); the fleet but node-0 at nice {FLEET_NICENESS}"]
    return "\n".join(lines)


def _load_tables(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| nodes | wire | registration storm | Edge start | RSS | `/status` (all / `?node=`) | `/metrics` "
        "| requests/s, 1 / all candidates | reload: largest stream gap (same stream, no reload) "
        "| after a restart: registered at 5 / 15 / 30 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rec = r["recovery"]
        shares = " / ".join(f"{rec[f'share_{m:g}s']:.1%}" for m in RECOVERY_MARKS)
        storm = (
            _fmt(r["storm_s"], " s")
            if r["storm_s"] is not None
            else f"{r['storm_registered']:,} in {STORM_TIMEOUT:.0f} s"
        )
        lines.append(
            f"| {r['nodes']:,} | v{r['wire']} | {storm} | {_fmt(r['edge_start_s'], ' s')} "
            f"| {r['rss_mb']:.0f} MB | {r['status_ms']:.0f} ms, {r['status_bytes'] / 1e6:.2f} MB / {r['status_node_ms']:.0f} ms "
            f"| {r['metrics_ms']:.0f} ms, {r['metrics_bytes'] / 1e6:.2f} MB, {r['metrics_series']:,} series "
            f"| {r['one']['rps']:,.0f} / {r['all']['rps']:,.0f} "
            f"| {r['reload']['reload_max_gap_ms']:.0f} ms ({r['reload']['baseline_max_gap_ms']:.0f} ms) "
            f"| {shares} (all: {_fmt(rec['all_back_s'], ' s')}; Edge start {rec['edge_start_s']:.1f} s) |"
        )
    lines += [
        "",
        "| nodes | wire | Edge CPU per registration (storm) | refused at accept (storm / restart) "
        "| CPU share with no requests (heartbeats): Edge / fleet | `/healthz` during the restart storm: p50 / max "
        "| Edge CPU per request, 1 / all | Edge CPU share, 1 / all | fleet CPU share, 1 / all | fleet loop lag, 1 / all "
        "| Edge full GCs: storm (longest) / under load 1 + all |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one, every = r["one"], r["all"]
        gc_count, gc_s, gc_long = r["storm_edge_gc2"]
        refused = sum(r["storm_pending_closed"].get(k, 0) for k in ("max_pending", "max_pending_per_source"))
        refused_restart = sum(
            r["recovery"]["pending_closed"].get(k, 0) for k in ("max_pending", "max_pending_per_source")
        )
        lines.append(
            f"| {r['nodes']:,} | v{r['wire']} | {r['storm_edge_cpu_s'] / max(1, r['storm_registered']) * 1e6:,.0f} µs "
            f"| {refused:,.0f} / {refused_restart:,.0f} "
            f"| {r['edge_idle_cpu_share']:.0%} / {r['fleet_idle_cpu_share']:.0%} "
            f"| {r['recovery']['healthz_p50_ms']:.1f} / {r['recovery']['healthz_max_ms']:.0f} ms "
            f"| {one['edge_cpu_us_per_request']:,.0f} / {every['edge_cpu_us_per_request']:,.0f} µs "
            f"| {one['edge_cpu_share']:.0%} / {every['edge_cpu_share']:.0%} "
            f"| {one['fleet_cpu_share']:.0%} / {every['fleet_cpu_share']:.0%} "
            f"| {one['fleet_max_lag_ms']:.0f} / {every['fleet_max_lag_ms']:.0f} ms "
            f"| {gc_count} in {gc_s:.2f} s ({gc_long * 1000:.0f} ms) / "
            f"{one['edge_gc2'] + every['edge_gc2']} in {one['edge_gc2_s'] + every['edge_gc2_s']:.2f} s |"
        )
    return lines


def _reload_only_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| nodes | wire | registration storm | Edge start | RSS | `/status` (all / `?node=`) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        storm = _fmt(r["storm_s"], " s") if r["storm_s"] is not None else f"{r['storm_registered']:,} registered"
        lines.append(
            f"| {r['nodes']:,} | v{r['wire']} | {storm} | {_fmt(r['edge_start_s'], ' s')} | {r['rss_mb']:.0f} MB "
            f"| {r['status_ms']:.0f} ms, {r['status_bytes'] / 1e6:.2f} MB / {r['status_node_ms']:.0f} ms |"
        )
    return lines


def _reload_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "| nodes | wire | stream's largest gap: no reload / idle spinner / reload (when the reload's fell, of the window) "
        "| Edge loop's longest batch (task, steps): "
        "no reload / reload | the largest gap taken apart, no reload / reload: node-0's own gap "
        "[node-0's largest anywhere in the window], "
        "transit of the later event (of the earlier), Edge loop's longest hold inside it (its CPU) "
        "| Edge loop in the window, no reload / reload: in batches, its CPU, waited in batches "
        "(GIL or CPU), waited for a CPU anywhere "
        "| the reload's steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for rel in r["reloads"]:
            lines.append(
                f"| {r['nodes']:,} | v{r['wire']} "
                f"| {rel['baseline_max_gap_ms']:.1f} / {_fmt(rel.get('spinner_max_gap_ms'))} "
                f"/ {rel['reload_max_gap_ms']:.1f} ms {_when(rel)} "
                f"| {_hold(rel, 'baseline')} / {_hold(rel, 'reload')} "
                f"| {_apart(rel['baseline_largest'])} / {_apart(rel['reload_largest'])} "
                f"| {_loop_split(rel['baseline_loop_time'])} / {_loop_split(rel['reload_loop_time'])} "
                f"| {rel['steps'] or 'not applied'} |"
            )
    return lines


def _when(reload: dict[str, Any]) -> str:
    """When the reload's largest gap ended, of its window (and whether a stream ended before its window did)."""
    at = reload["reload_largest"]["at_ms"]
    short = [key for key in ("baseline", "spinner", "reload") if not reload.get(f"{key}_covered", True)]
    return f"({_fmt(at and at / 1000, ' s')} of {reload.get('window_s', 0):.1f} s" + (
        f"; {' and '.join(short)} stream ended early)" if short else ")"
    )


def _apart(largest: dict[str, Any]) -> str:
    task = largest["loop_task"].rsplit(".", 1)[-1] or "none"
    return (
        f"{_fmt(largest['sent_ms'], ' ms')} [{_fmt(largest['sent_max_ms'], ' ms')}], "
        f"{_fmt(largest['transit_ms'], ' ms')} "
        f"({_fmt(largest['transit_before_ms'], ' ms')}), {largest['loop_ms']:.1f} ms {task} "
        f"({largest['loop_cpu_ms']:.1f} ms)"
    )


def _loop_split(spent: dict[str, float]) -> str:
    return f"{spent['busy_ms']:.0f}, {spent['cpu_ms']:.0f}, {spent['waited_ms']:.0f}, {spent['runq_ms']:.0f} ms"


def _hold(reload: dict[str, Any], key: str) -> str:
    task = reload[f"{key}_loop_max_task"].rsplit(".", 1)[-1]
    return f"{reload[f'{key}_loop_max_ms']:.1f} ms ({task}, {reload[f'{key}_loop_max_steps']})"


_GC_LINE = re.compile(r"^bench-gc2: (\d+) ([0-9.]+) ([0-9.]+)$", re.M)


def edge_gc(edge: Daemon) -> tuple[int, float, float]:
    """The Edge's full collections so far: count, seconds, longest (from its log)."""
    found = _GC_LINE.findall(edge.log.read_text(errors="replace"))
    if not found:
        return 0, 0.0, 0.0
    count, seconds, longest = found[-1]
    return int(count), float(seconds), float(longest)


class LoopTracer(trio.abc.Instrument):
    """Writes each long hold of the Edge's loop to stderr: ``bench-loop: END MS STEPS LONGEST_MS TASK CPU_MS``.

    A *batch* is what the loop does between two waits for I/O: every task step
    that was ready. While a batch runs, no stream event is read or written, so
    a stream's inter-event gap is at least its longest batch. END is the
    batch's end (``time.monotonic()``, comparable across processes), MS its
    length, STEPS how many task steps it ran, LONGEST_MS the longest of them
    and TASK that step's task. A wait for I/O that overran its timeout by more
    than :attr:`threshold` (the loop thread waited for the GIL after
    ``epoll_wait``) is written as a batch of 0 steps, TASK ``io-wait``. CPU_MS
    is the CPU time the loop thread used in the batch: the rest of MS it
    waited, for the GIL or for a CPU.

    Every :attr:`period` it also writes ``bench-loopsum: END SECONDS BUSY_MS
    IN_STEPS_MS STEPS CPU_MS RUNQ_MS``: over the last SECONDS, the time in
    batches, in task steps, the steps, the loop thread's CPU time and its time
    runnable but waiting for a CPU (``/proc``'s ``schedstat``): BUSY_MS minus
    CPU_MS minus RUNQ_MS is, roughly, the time the loop waited for the GIL.
    """

    def __init__(self, threshold: float = 0.005, period: float = 0.1) -> None:
        self.threshold = threshold
        self.period = period
        self._batch = self._step = self._io = self._since = time.monotonic()
        self._steps = 0
        self._longest = (0.0, "")
        self._timeout = 0.0
        self._busy = self._in_steps = 0.0
        self._all_steps = 0
        self._cpu = self._since_cpu = time.thread_time()
        try:
            self._schedstat: int | None = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self._schedstat = None
        self._since_runq = self._runq()

    def _runq(self) -> float:
        """Seconds the loop thread has been runnable but not running, so far (0.0 without ``/proc``)."""
        if self._schedstat is None:
            return 0.0
        return int(os.pread(self._schedstat, 100, 0).split()[1]) / 1e9

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step = time.monotonic()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = time.monotonic() - self._step
        self._steps += 1
        self._in_steps += took
        if took > self._longest[0]:
            self._longest = (took, task.name)

    def before_io_wait(self, timeout: float) -> None:
        now, cpu = time.monotonic(), time.thread_time()
        if now - self._batch > self.threshold:
            self._write(now, now - self._batch, self._steps, *self._longest, cpu - self._cpu)
        self._busy += now - self._batch
        self._all_steps += self._steps
        if now - self._since >= self.period:
            runq = self._runq()
            print(
                f"bench-loopsum: {now:.4f} {now - self._since:.4f} {self._busy * 1000:.2f} "
                f"{self._in_steps * 1000:.2f} {self._all_steps} {(cpu - self._since_cpu) * 1000:.2f} "
                f"{(runq - self._since_runq) * 1000:.2f}",
                file=sys.stderr,
            )
            self._since, self._busy, self._in_steps, self._all_steps = now, 0.0, 0.0, 0
            self._since_cpu, self._since_runq = cpu, runq
        self._io, self._timeout = now, timeout

    def after_io_wait(self, timeout: float) -> None:
        now = time.monotonic()
        if now - self._io - self._timeout > self.threshold:
            self._write(now, now - self._io - self._timeout, 0, 0.0, "io-wait", 0.0)
        self._batch, self._steps, self._longest, self._cpu = now, 0, (0.0, ""), time.thread_time()

    @staticmethod
    def _write(end: float, took: float, steps: int, longest: float, task: str, cpu: float) -> None:
        print(
            f"bench-loop: {end:.4f} {took * 1000:.2f} {steps} {longest * 1000:.2f} {task} {cpu * 1000:.2f}",
            file=sys.stderr,
        )


def _main_edge(argv: list[str]) -> None:
    """``iop-edge`` with its full garbage collections timed, written to stderr every 0.5 s, and its
    loop's long holds (:class:`LoopTracer`)."""
    from iop_edge.__main__ import main as edge_main

    clock = GcClock(write_over=0.005)

    def report() -> None:
        while True:
            time.sleep(0.5)
            print(f"bench-gc2: {clock.count} {clock.seconds:.4f} {clock.longest:.4f}", file=sys.stderr, flush=True)

    threading.Thread(target=report, daemon=True).start()

    edge_main(argv, instruments=[LoopTracer()])


def _main_fleet(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale fleet")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="the first node's number")
    parser.add_argument("--wire", type=int, choices=WIRES, default=2)
    args = parser.parse_args(argv)
    trio.run(run_fleet, args.port, args.first, args.nodes, args.wire)


def main(argv: list[str]) -> None:
    """``python -m benchmarks.scale [--quick] [--wire 1|2 ...] [--py-spy BIN] [--reload-only] [--reloads N] [SIZE ...]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, help=f"fleet sizes (default {', '.join(map(str, SIZES))})")
    parser.add_argument("--quick", action="store_true", help="1,000 nodes only (for iteration)")
    parser.add_argument("--wire", type=int, choices=WIRES, action="append", help="wire version(s) (default: 1 and 2)")
    parser.add_argument("--edge-config", action="append", default=[], help="one more edge.yaml line (repeatable)")
    parser.add_argument(
        "--reload-only", action="store_true", help="after the storm, only /status and the reload stall (minutes less)"
    )
    parser.add_argument("--reloads", type=int, default=1, help="reload stalls measured per fleet size (default 1)")
    parser.add_argument("--py-spy", help="a py-spy binary: profile the Edge and the fleet under each load")
    parser.add_argument("--profile-dir", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "scale-profiles")
    args = parser.parse_args(argv)
    sizes = tuple(args.sizes) or ((1_000,) if args.quick else SIZES)
    py_spy = shutil.which(args.py_spy) if args.py_spy else None
    print(
        table(
            run(
                sizes=sizes,
                wires=tuple(args.wire or WIRES),
                py_spy=py_spy,
                profile_dir=args.profile_dir,
                extra=tuple(args.edge_config),
                reload_only=args.reload_only,
                reloads=args.reloads,
            )
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["fleet"]:
        _main_fleet(sys.argv[2:])
    elif sys.argv[1:2] == ["edge"]:
        _main_edge(sys.argv[2:])
    elif sys.argv[1:2] == ["config"]:
        sys.stdout.write(edge_yaml(int(sys.argv[2])))
    else:
        main(sys.argv[1:])
