"""One Edge at fleet size: 1,000 / 5,000 / 10,000 fake nodes (``python -m benchmarks.scale``).

Three processes, so the Edge's loop carries only the Edge: the Edge (``iop-edge``
on a generated ``edge.yaml``), the fake fleet (``python -m benchmarks.scale fleet``:
every node in one trio process, one provider ``p0`` of capacity 4 each,
heartbeats, answers runs at once, either wire version) and the load generator
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
import json
import os
import pathlib
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
from typing import Any

import attrs
import trio

from benchmarks.awake import cpus_awake
from benchmarks.harness import ROOT, BenchmarkFailed, Daemon, HttpConnection, LoadGenerator, cpu_seconds, rss_mb
from iop_edge import lower_priority

from . import edge as scale_edge
from . import fleet as scale_fleet
from .fleet import CAPACITY, FLEET_NICENESS, RECOVERY_MARKS, STORM_TIMEOUT, TOKEN, WIRES
from .logs import RELOAD_LINE, edge_gc, largest_gap, loop_holds, loop_time, reload_seconds, sent_times
from .report import table

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


# ------------------------------------------------------------- the measurement

SIZES = (1_000, 5_000, 10_000)
CONCURRENCY = 32
DURATION = 3.0
START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0
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
        return sum(cpu_seconds(proc.pid) for proc in self.procs)

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
    connection = HttpConnection("127.0.0.1", port)
    arrivals: list[float] = []
    body = json.dumps(_chat("one", stream=True)).encode()
    mark = 0.0

    def on_body(data: bytes) -> None:
        nonlocal mark
        arrivals.extend([time.monotonic()] * data.count(b"data: "))
        if not mark and len(arrivals) > 50:
            if at_mark is not None:
                at_mark()
            mark = time.monotonic()

    with trio.move_on_after(60):
        try:
            await connection.request(HttpConnection.build("POST", CHAT_PATH, body), on_body)
        finally:
            await connection.aclose()
    return mark, arrivals


class _Spinner:
    """:data:`SPINNER` started at the reader's priority in a session of its own, as the reload's reader is
    (:func:`iop_edge.config.reader.lower_priority`); :meth:`stop` kills it (it ends by itself
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
    (:func:`largest_gap`).
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
        sent_before = len(sent_times(node0_log))
        try:
            mark, arrivals = await _stream_gaps(port, at_mark)
        finally:
            spinner.stop()
        if key == "reload":
            with trio.move_on_after(60):
                while edge.log.read_text(errors="replace").count("config reloaded") <= reloads:
                    await trio.sleep(0.05)
            steps = RELOAD_LINE.findall(edge.log.read_text(errors="replace"))
            out["reload_applied"] = float(len(steps) > reloads)
            out["steps"] = steps[-1] if len(steps) > reloads else ""
            window = reload_seconds(out["steps"]) + AFTER_RELOAD
        await trio.sleep(0.2)  # the Edge's last loop lines, node-0's send times
        log = edge.log.read_text(errors="replace")
        streams = sent_times(node0_log)
        sent = streams[-1] if len(streams) > sent_before else []
        until = mark + window
        end = min(arrivals[-1], until) if arrivals else mark
        out[f"{key}_covered"] = bool(arrivals) and arrivals[-1] >= until
        out[f"{key}_largest"] = largest_gap(mark, until, arrivals, sent, log)
        out[f"{key}_max_gap_ms"] = out[f"{key}_largest"]["max_gap_ms"]
        hold = loop_holds(log, mark, end)
        out[f"{key}_loop_max_ms"], out[f"{key}_loop_max_task"], out[f"{key}_loop_max_steps"], _ = hold
        out[f"{key}_loop_time"] = loop_time(log, mark, end)
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
        row["rss_mb"] = rss_mb(edge.proc.pid)
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


def main(argv: list[str]) -> None:
    """``python -m benchmarks.scale [--quick] [--wire 4|5 ...] [--py-spy BIN] [--reload-only] [--reloads N] [SIZE ...]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, help=f"fleet sizes (default {', '.join(map(str, SIZES))})")
    parser.add_argument("--quick", action="store_true", help="1,000 nodes only (for iteration)")
    parser.add_argument(
        "--wire", type=int, choices=WIRES, action="append", help="wire version(s) (default: both spoken)"
    )
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


def entry(argv: list[str]) -> None:
    """``python -m benchmarks.scale``: the driver, or the fleet / Edge / config role its child processes play."""
    if argv[:1] == ["fleet"]:
        scale_fleet.main(argv[1:])
    elif argv[:1] == ["edge"]:
        scale_edge.main(argv[1:])
    elif argv[:1] == ["config"]:
        sys.stdout.write(edge_yaml(int(argv[1])))
    else:
        main(argv)
