"""Overload benchmark: a flood of retrying clients against one small provider.

``python -m benchmarks overload [--quick]`` (part of ``make bench``) starts four kinds of
process on loopback, every port chosen by the OS: ``iop-mock-backend --latency-ms 100
--tokens-per-second 0``, an Edge (one provider of capacity 8, ``max_queue: 64``,
``queue_timeout_ms: 2000``), a Node in front of the backend -- ideal: 8 / 0.1 s = 80
answered requests/s -- and, for every scenario, two measuring processes started
together: the *flood* and the *probe* (``python -m benchmarks.overload flood|probe``).

- The flood: N closed-loop clients, each with its own keep-alive connection (all opened
  before the warm-up starts, so the window holds no accept storm), send a
  small non-stream chat request; after a rejection (429 or 503) or a lost connection
  the client waits ``retry`` (10 ms or 1 s; or, in the ``Retry-After`` rows, the
  ``Retry-After`` it was sent) and sends again. The flood's client is minimal (prebuilt
  request bytes, the head parsed by hand) to leave the cores to the Edge, and its own CPU
  is reported.
- The probe: ``GET /healthz`` every 100 ms on the same listener, one connection,
  plus ``GET /metrics`` and ``GET /status`` every 500 ms.

Scenarios: 200, 1,000 and 5,000 clients, each with 10 ms and 1 s retry, and 1,000 and
5,000 clients that honour ``Retry-After`` (``--quick``: 200 and 1,000 clients with 10 ms
retry, shorter windows). A refusal's latency is the client's (request sent to answer
read): when the Edge paces a refused connection, a request sent before its
``Retry-After`` waited unread, and that wait is in the figure; refusals of requests
sent after the previous ``Retry-After`` had passed are also reported apart. Only answers completed in the
measurement window (after the warm-up) count. Reported per scenario: answered 200/s
against the ideal, 200 p50/p99, the p99 of an on-time 200's latency beyond the queue
wait the Edge reports (``x-iop-queue-ms``), rejection p99 (all; on-time) and rejections/s, the probe's p99 per
endpoint, CPU (% of one core) of the Edge, the Node, the flood and the probe (each read
from ``/proc`` by the flood itself at the start and end of its window, so CPU and answers
cover the same seconds), and the Edge's CPU per refusal against a served request's.

Edge CPU per refusal, measured against references taken in the same run, before the
scenarios, with the same Edge: a request served without overload (8 clients, capacity 8:
``served_ms``, the reference of the ratio), a request served through a full queue (64
clients: every slot busy, 56 waiting, none refused; ``queued_ms``) and the Edge with only
the probe as client (``probe_ms_per_s``, read over 6 s). Both request references are
measured as a row is: by the flood process (8 or 64 clients, no probe), the Edge's CPU
over the flood's own window divided by the 200s answered in it, connections opened before
the warm-up (so neither a row nor a reference pays for accepting or closing connections:
the flood's clients keep theirs alive, as the Edge asks of a refused client), and the
idle Edge's own CPU over the window left out (``idle_ms_per_s``: node heartbeats, the
loop-lag sampler, read over 8 s with no client), which the probe's baseline already
holds. A row's refusal cost is its Edge CPU minus its answered requests at ``queued_ms``
(they waited in the queue too) minus the probe's baseline, divided by its refusals; the
JSON also keeps it with the probe's share left in. What it counts is what the flood adds
to the Edge's CPU per refusal -- the refusals' own work and the loop wake-ups and other
work they cause -- for clients that keep their connection (what a refused connection that
closes costs on top, an accept and a close, is not in any row).

That figure is a remainder: it leans on the served requests of the flood costing what
they cost in the references. So the refusal cost is also measured with nothing to subtract
(*refusals alone*, after the scenarios, on a relay of its own): a backend that answers
after an hour and a queue timeout as long, so a flood's first 72 requests hold every slot
and queue place and every later request is refused on its head; the Edge's CPU in the
window minus the idle Edge's, divided by the refusals (1,000 clients retrying after 10 ms
and 1 s, 5,000 after 1 s; ``--quick``: 1,000 after 1 s). It is the dearer case for a
refusal -- no other work shares the event loop's passes -- and its clients are told the
longest ``Retry-After`` the queue gives (the service time is not known yet: 1 s), so the
``Retry-After`` rows have no counterpart there.
Rows with fewer than ``FEW_REFUSALS`` refusals per answered request show no figure: there
the remainder is within the noise of the served requests' cost. After each scenario the flood stops and
the driver waits for ``/status`` to show nothing queued or in flight and reads the
backend's peak concurrency (must be <= 8).

Writes ``benchmarks/results/overload.json`` (through ``python -m benchmarks``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import trio

from .harness import (
    ROOT,
    BenchmarkFailed,
    Daemon,
    HttpConnection,
    LoadGenerator,
    Relay,
    cpu_seconds,
    get_json,
    percentile,
    python_command,
    start_relay,
)

CAPACITY = 8
BACKEND_LATENCY_MS = 100
QUEUE_TIMEOUT_MS = 2000
IDEAL_RPS = CAPACITY * 1000 / BACKEND_LATENCY_MS
HONOUR = -1.0
"""A retry value: the client waits the Retry-After it was sent."""
SCENARIOS = (
    (200, 0.01),
    (200, 1.0),
    (1000, 0.01),
    (1000, 1.0),
    (1000, HONOUR),
    (5000, 0.01),
    (5000, 1.0),
    (5000, HONOUR),
)
QUICK_SCENARIOS = ((200, 0.01), (1000, 0.01))
FEW_REFUSALS = 4
"""A row's Edge CPU per refusal is shown when it has at least this many refusals per answered request."""
QUEUED_CLIENTS = 64
"""Closed-loop clients of the served-through-the-queue baseline: every slot busy, the queue 56 deep, none refused."""
WARMUP, DURATION = 3.0, 8.0
QUICK_WARMUP, QUICK_DURATION = 1.5, 4.0
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}

EDGE_YAML = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
provider_pool: {{max_queue: 64, queue_timeout_ms: {queue_timeout_ms}}}
{extra}nodes:
  - id: bench-node
    token: bench-token
    providers:
      - {{id: mock, capacity: {capacity}}}
models:
  - id: mock
    candidates: [{{node: bench-node, provider: mock, upstream_model: mock}}]
"""

NODE_YAML = """\
node_id: bench-node
edge_url: ws://127.0.0.1:{node_port}
token: bench-token
runtime: {{concurrency: {capacity}}}
providers:
  - {{id: mock, adapter: openai, base_url: "http://127.0.0.1:{backend_port}/v1", capacity: {capacity}}}
"""


# ------------------------------------------------------------------- the flood


READY = "connected"
"""The flood's first line (with its window's start): every client's connection is open."""


async def _connect_all(connections: list[HttpConnection], at_once: int = 64) -> None:
    """Open every connection, ``at_once`` at a time (the listen backlog is finite). Checkpoints."""
    limiter = trio.CapacityLimiter(at_once)

    async def connect(connection: HttpConnection) -> None:
        async with limiter:
            await connection.connect()

    async with trio.open_nursery() as nursery:
        for connection in connections:
            nursery.start_soon(connect, connection)


async def _cpu_window(pids: dict[str, int], begin: float, end: float, out: dict[str, float]) -> None:
    """CPU seconds each of ``pids`` used between ``begin`` and ``end`` (``time.perf_counter``), into ``out``.

    Read by the flood (and the probe alone, for the baseline) itself, so the CPU window is exactly
    the window its answers are counted in, however long the process took to start.
    """
    await trio.sleep(max(0.0, begin - time.perf_counter()))
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    await trio.sleep(max(0.0, end - time.perf_counter()))
    out.update({name: cpu_seconds(pid) - before[name] for name, pid in pids.items()})


async def _flood(
    port: int, clients: int, retry: float, warmup: float, duration: float, pids: dict[str, int]
) -> dict[str, Any]:
    """N closed-loop clients; answered-200 and rejection latencies inside the window.

    ``retry`` < 0: each client waits the ``Retry-After`` it was sent (clients that honour it).
    A refusal's latency is the client's: from sending the request to the end of the answer,
    so after pacing it includes the time the request waited unread. ``on_time`` refusals are
    those of requests sent once the previous refusal's ``Retry-After`` had passed (or the
    first on the connection): what a client that honours ``Retry-After`` sees.
    """
    raw = HttpConnection.build("POST", "/v1/chat/completions", json.dumps(CHAT).encode())
    clock = time.perf_counter
    connections = [HttpConnection("127.0.0.1", port) for _ in range(clients)]
    await _connect_all(connections)
    begin = clock() + warmup
    end = begin + duration
    print(READY, begin, flush=True)  # the driver hands the window to the probe (one clock for both)
    ok: list[float] = []
    beyond_queue: list[float] = []  # a 200 sent on time: its latency minus the Edge's queue wait
    rejected: list[float] = []  # refused at once: queue_full, overloaded
    on_time: list[float] = []  # of those, sent after the previous Retry-After had passed
    timed_out: list[float] = []  # queue_timeout: waited queue_timeout_ms, by design
    other: dict[str, int] = {}

    async def client(index: int) -> None:
        await trio.sleep(warmup * 0.5 * index / clients)  # first requests spread over the first half of the warm-up
        connection = connections[index]
        come_back = 0.0  # when the last Retry-After ends
        try:
            while (t0 := clock()) < end:
                try:
                    with trio.fail_after(max(1.0, end + 1.0 - t0)):  # bounded: an admitted request may never end
                        status, body = await connection.request(raw)
                    head = connection.headers
                except Exception as exc:  # a lost connection is counted and retried
                    status, head, kind = 0, {}, type(exc).__name__
                else:
                    kind = str(status) if b'"queue_timeout"' not in body else "429 queue_timeout"
                t1 = clock()
                inside = begin <= t1 < end
                if status == 200:
                    if inside:
                        ok.append(t1 - t0)
                        if t0 >= come_back:
                            beyond_queue.append(t1 - t0 - int(head.get(b"x-iop-queue-ms", b"0")) / 1000)
                    continue
                advised = int(head.get(b"retry-after", b"0"))
                if inside:
                    if kind in ("429", "503"):
                        rejected.append(t1 - t0)
                        if t0 >= come_back:
                            on_time.append(t1 - t0)
                    elif kind == "429 queue_timeout":
                        timed_out.append(t1 - t0)
                    other[kind] = other.get(kind, 0) + 1
                come_back = t1 + advised
                await trio.sleep(retry if retry >= 0 else advised or 1.0)
        finally:
            await connection.aclose()

    cpu: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cpu_window, {**pids, "flood": os.getpid()}, begin, end, cpu)
        for index in range(clients):
            nursery.start_soon(client, index)
    ok.sort()
    beyond_queue.sort()
    rejected.sort()
    on_time.sort()
    return {
        "ok": len(ok),
        "ok_rps": len(ok) / duration,
        "ok_p50_ms": percentile(ok, 0.5) * 1000,
        "ok_p99_ms": percentile(ok, 0.99) * 1000,
        "beyond_queue_p99_ms": percentile(beyond_queue, 0.99) * 1000,
        "rejected": len(rejected),
        "rejected_rps": len(rejected) / duration,
        "reject_p99_ms": percentile(rejected, 0.99) * 1000,
        "on_time": len(on_time),
        "on_time_p99_ms": percentile(on_time, 0.99) * 1000,
        "timed_out": len(timed_out),
        "answers": other,
        "cpu_s": cpu,
    }


async def _probe(
    port: int, warmup: float, duration: float, pids: dict[str, int], begin: float | None = None
) -> dict[str, Any]:
    """``/healthz`` every 100 ms, ``/metrics`` and ``/status`` every 500 ms, one connection each.

    The window starts at ``begin`` (``time.perf_counter``, the system's monotonic clock: the
    flood's window) or ``warmup`` from now.
    """
    clock = time.perf_counter
    begin = clock() + warmup if begin is None else begin
    end = begin + duration
    samples: dict[str, list[float]] = {"/healthz": [], "/metrics": [], "/status": []}
    failures: dict[str, int] = {}
    seen: dict[str, list[float]] = {}

    async def probe(path: str, every: float) -> None:
        connection = HttpConnection("127.0.0.1", port)
        raw = HttpConnection.build("GET", path)
        try:
            while (t0 := clock()) < end:
                try:
                    status, body = await connection.request(raw)
                except Exception:  # counted, the probe goes on
                    status, body = 0, b""
                t1 = clock()
                if path == "/status" and status == 200 and t0 >= begin:
                    overload = json.loads(body).get("overload", {})
                    for key in ("loop_lag_ms", "service_time_ms", "waiting", "open_connections"):
                        if key in overload:
                            seen.setdefault(key, []).append(overload[key])
                if t0 >= begin:
                    if status == 200:
                        samples[path].append(t1 - t0)
                    else:
                        failures[path] = failures.get(path, 0) + 1
                await trio.sleep(max(0.0, every - (t1 - t0)))
        finally:
            await connection.aclose()

    cpu: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cpu_window, {**pids, "probe": os.getpid()}, begin, end, cpu)
        nursery.start_soon(probe, "/healthz", 0.1)
        nursery.start_soon(probe, "/metrics", 0.5)
        nursery.start_soon(probe, "/status", 0.5)
    out: dict[str, Any] = {"failures": failures, "edge_status": {k: [min(v), max(v)] for k, v in seen.items()}}
    out["cpu_s"] = cpu
    for path, values in samples.items():
        values.sort()
        out[path] = {
            "n": len(values),
            "p50_ms": percentile(values, 0.5) * 1000,
            "p99_ms": percentile(values, 0.99) * 1000,
        }
        out[path]["max_ms"] = values[-1] * 1000 if values else math.nan
    return out


# ------------------------------------------------------------------ the driver


def _per_refusal(row: dict[str, Any], costs: dict[str, float]) -> None:
    """The Edge's CPU per refusal in ``row``, against a served request's (same run).

    ``edge_cpu_us_per_reject``: the Edge's CPU in the window, minus the answered requests at
    the cost of a request served through a full queue (``queued_ms``: the 200s of a flood
    waited in the queue too) and minus what the probe alone costs the Edge over as long
    (``probe_ms_per_s``), divided by the refusals; ``reject_share`` is that against a
    request served without overload (``served_ms``). ``edge_cpu_us_per_reject_all`` keeps
    the probe's share in (an upper bound).
    """
    refusals = max(1, row["rejected"] + row["timed_out"])
    rest = row["cpu_s"]["edge"] * 1000 - costs["queued_ms"] * row["ok"]
    row["edge_cpu_us_per_reject_all"] = rest * 1000 / refusals
    rest -= costs["probe_ms_per_s"] * row["duration_s"]
    row["edge_cpu_us_per_reject"] = rest * 1000 / refusals
    row["reject_share"] = row["edge_cpu_us_per_reject"] / (costs["served_ms"] * 1000)


def _pid_args(pids: dict[str, int]) -> list[str]:
    return ["--pids", ",".join(f"{name}={pid}" for name, pid in pids.items())]


async def _scenario(
    daemons: dict[str, Daemon],
    http_port: int,
    backend_port: int,
    clients: int,
    retry: float,
    quick: bool,
    with_probe: bool = True,
) -> dict[str, Any]:
    warmup, duration = (QUICK_WARMUP, QUICK_DURATION) if quick else (WARMUP, DURATION)
    backend = HttpConnection("127.0.0.1", backend_port)
    await backend.request(HttpConnection.build("POST", "/stats/reset"))
    await backend.aclose()
    common = ["--port", str(http_port), "--warmup", str(warmup), "--duration", str(duration)]
    pids = {name: d.proc.pid for name, d in daemons.items()}
    # Both start now (a Python process takes seconds to start on a busy box); the probe then
    # waits for the flood's window, sent on its stdin once every flood connection is open.
    probe = subprocess.Popen(
        python_command("-m", "benchmarks.overload", "probe", *common, "--begin", "stdin", *_pid_args({})),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        text=True,
    ) if with_probe else None  # fmt: skip
    flood = subprocess.Popen(
        python_command(
            "-m", "benchmarks.overload", "flood", *common, "--clients", str(clients), "--retry", str(retry),
            *_pid_args(pids),
        ),
        stdout=subprocess.PIPE,
        cwd=ROOT,
        text=True,
    )  # fmt: skip
    assert flood.stdout is not None
    ready = (await trio.to_thread.run_sync(flood.stdout.readline)).split()
    if ready[:1] != [READY]:
        flood.kill()
        if probe is not None:
            probe.kill()
        raise BenchmarkFailed(f"the flood did not connect: {ready!r}")
    if probe is not None:
        assert probe.stdin is not None
        probe.stdin.write(ready[1] + "\n")
        probe.stdin.flush()  # (communicate closes it)
    flood_out, _ = await trio.to_thread.run_sync(flood.communicate)
    probe_out, _ = await trio.to_thread.run_sync(probe.communicate) if probe is not None else ("", None)
    if flood.returncode or (probe is not None and probe.returncode):
        raise BenchmarkFailed(f"flood exited {flood.returncode}, probe exited {probe and probe.returncode}")
    result: dict[str, Any] = {"clients": clients, "retry_s": retry, "duration_s": duration, **json.loads(flood_out)}
    if probe is not None:
        result["probe"] = json.loads(probe_out)
        result["cpu_s"]["probe"] = result["probe"]["cpu_s"]["probe"]  # over the probe's own window
    result["cpu_pct"] = {k: round(v * 100 / duration, 1) for k, v in result["cpu_s"].items()}
    edge_cpu = result["cpu_s"]["edge"]
    result["edge_cpu_ms_per_answer"] = edge_cpu * 1000 / max(1, result["ok"] + result["rejected"] + result["timed_out"])
    result["edge_cpu_ms_per_ok"] = edge_cpu * 1000 / max(1, result["ok"])
    result["drain"] = await _drained(http_port, backend)
    return result


async def _drained(http_port: int, backend: HttpConnection) -> dict[str, Any]:
    """Wait (at most 10 s) for nothing queued or in flight; read the backend's peak."""
    poller = HttpConnection("127.0.0.1", http_port)
    start = time.perf_counter()
    status: dict[str, Any] = {}
    try:
        with trio.move_on_after(10):
            while True:
                status = await get_json(poller, "/status")
                busy = sum(p.get("in_flight", 0) for p in status.get("providers", []))
                if busy == 0 and not status.get("queue_depth", 0):
                    break
                await trio.sleep(0.05)
    finally:
        await poller.aclose()
    _, body = await backend.request(HttpConnection.build("GET", "/stats"))
    await backend.aclose()
    stats = json.loads(body)
    return {
        "seconds": round(time.perf_counter() - start, 2),
        "in_flight": sum(p.get("in_flight", 0) for p in status.get("providers", [])),
        "queued": status.get("queue_depth"),
        "backend_peak": stats["peak_in_flight"],
        "backend_in_flight": stats["in_flight"],
    }


async def _costs(processes: dict[str, Daemon], http_port: int, backend_port: int, quick: bool) -> dict[str, float]:
    """The Edge's CPU per answer without overload; the references of a row's refusal figure.

    ``served_ms``: a chat answered by the backend (8 closed-loop clients, capacity 8), and
    ``queued_ms``: the same through a full queue (64 clients: 8 running, 56 waiting), each
    measured the way a row is -- by the flood process, over its own window, connections
    opened before its warm-up -- and the idle Edge's CPU over the window left out: the
    Edge's CPU in the window divided by the 200s answered in it. (They used to be read
    around a whole load-generator run and divided by the answers in its window scaled to
    the run: the requests still in flight at the window's end -- 64 of ~200 through the
    full queue -- were paid for and not counted, which made ``queued_ms`` a third too
    dear, so a row subtracted too much for its answered requests and its refusals looked
    cheaper than they are.) ``reject_us``: a chat for an unknown model (body read and
    parsed, admission asked, 404: the path of a queue-full 429 without the queue), 32
    clients, and ``healthz_us``: ``GET /healthz``, 32 clients (load-generator runs, shown
    for comparison only).
    """
    edge = processes["edge"]
    idle = await _idle_ms_per_s(edge)
    out: dict[str, float] = {"idle_ms_per_s": idle, "probe_ms_per_s": await _probe_only(edge, http_port)}
    for name, clients in (("served_ms", CAPACITY), ("queued_ms", QUEUED_CLIENTS)):
        row = await _scenario(processes, http_port, backend_port, clients, 0.01, quick, with_probe=False)
        spent_ms = row["cpu_s"]["edge"] * 1000 - idle * row["duration_s"]
        out[name] = spent_ms / max(1, row["ok"])
        out[name.split("_")[0] + "_rps"] = row["ok_rps"]
        out[name.split("_")[0] + "_refused"] = row["rejected"] + row["timed_out"]
    loadgen = LoadGenerator()
    unknown = {**CHAT, "model": "no-such-model"}
    commands = {  # name: load
        "reject_us": {"path": "/v1/chat/completions", "body": unknown, "concurrency": 32},
        "healthz_us": {"path": "/healthz", "body": None, "concurrency": 32},
    }
    try:
        for name, command in commands.items():
            before, start = edge.cpu_seconds(), time.perf_counter()
            result = await loadgen.measure(
                port=http_port, method="GET" if command["body"] is None else "POST", **command
            )
            spent = edge.cpu_seconds() - before - idle / 1000 * (time.perf_counter() - start)
            answered = (result["requests"] + result["errors"]) * (2.0 + 0.5) / 2.0
            out[name] = spent * 1e6 / max(1.0, answered)
            out[name.split("_")[0] + "_rps"] = result["rps"]
    finally:
        loadgen.stop()
    return out


IDLE_S = 8.0
"""Seconds the idle Edge's CPU is read over (in 10 ms ticks)."""


async def _idle_ms_per_s(edge: Daemon) -> float:
    """The Edge's CPU (ms per second) with no client at all: node heartbeats, the loop-lag sampler."""
    before, start = edge.cpu_seconds(), time.perf_counter()
    await trio.sleep(IDLE_S)
    return (edge.cpu_seconds() - before) * 1000 / (time.perf_counter() - start)


async def _probe_only(edge: Daemon, http_port: int) -> float:
    """The Edge's CPU (ms per second) with the probe as its only client: the baseline of every row."""
    warmup, duration = 0.5, 6.0  # ~10-20 ms/s read in 10 ms ticks: 6 s keep the tick within 2 ms/s
    command = ["--port", str(http_port), "--warmup", str(warmup), "--duration", str(duration)]
    probe = subprocess.Popen(
        python_command("-m", "benchmarks.overload", "probe", *command, *_pid_args({"edge": edge.proc.pid})),
        stdout=subprocess.PIPE,
        cwd=ROOT,
        text=True,
    )
    out, _ = await trio.to_thread.run_sync(probe.communicate)
    if probe.returncode:
        raise BenchmarkFailed(f"probe exited {probe.returncode}")
    spent: float = json.loads(out)["cpu_s"]["edge"]
    return spent * 1000 / duration


async def _start(
    workdir: pathlib.Path, daemons: list[Daemon], latency_ms: int, queue_timeout_ms: int, edge_extra: str
) -> Relay:
    """The mock backend (``latency_ms`` to answer), an Edge (``queue_timeout_ms``) and a Node."""
    return await start_relay(
        workdir,
        daemons,
        mock_args=["--latency-ms", str(latency_ms), "--tokens-per-second", "0"],
        edge_yaml=EDGE_YAML.format(capacity=CAPACITY, extra=edge_extra, queue_timeout_ms=queue_timeout_ms),
        node_yaml=NODE_YAML.replace("{capacity}", str(CAPACITY)),  # the ports are start_relay's to fill
    )


ALONE_SCENARIOS = ((1000, 0.01), (1000, 1.0), (5000, 1.0))
QUICK_ALONE_SCENARIOS = ((1000, 1.0),)
STUCK_MS = 3_600_000
"""The refusals-alone relay's backend latency and queue timeout: no admitted request ends in a window."""


async def _refusals_alone(workdir: pathlib.Path, quick: bool, edge_extra: str) -> dict[str, Any]:
    """Edge CPU per refusal measured with nothing else to subtract: a second relay whose backend
    never answers within the window (``--latency-ms`` of an hour, ``queue_timeout_ms`` as long),
    so the first 72 requests of a flood hold every slot and queue place and every other one is
    refused on its head. A row's figure is the Edge's CPU in the window minus the idle Edge's
    (read before the floods), divided by the refusals; no probe runs."""
    daemons: list[Daemon] = []
    try:
        relay = await _start(workdir, daemons, STUCK_MS, STUCK_MS, edge_extra)
        idle = await _idle_ms_per_s(relay.edge)
        rows = []
        for clients, retry in QUICK_ALONE_SCENARIOS if quick else ALONE_SCENARIOS:
            print(f"   refusals alone: {clients} clients, retry {retry * 1000:g} ms ...", file=sys.stderr, flush=True)
            processes = {"edge": relay.edge, "node": relay.node, "backend": relay.backend}
            row = await _scenario(processes, relay.http_port, relay.backend_port, clients, retry, quick, False)
            spent_ms = row["cpu_s"]["edge"] * 1000 - idle * row["duration_s"]
            row["edge_cpu_us_per_reject"] = spent_ms * 1000 / max(1, row["rejected"])
            rows.append(row)
            print(_alone_row(row), file=sys.stderr, flush=True)
        return {"idle_ms_per_s": idle, "rows": rows}
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


def _alone_row(r: dict[str, Any]) -> str:
    retry = "Retry-After" if r["retry_s"] < 0 else f"{r['retry_s'] * 1000:g} ms"
    return (
        f"| {r['clients']:,} | {retry} | {r['rejected_rps']:.0f}/s | {r['cpu_pct']['edge']:.0f} %"
        f" | {r['edge_cpu_us_per_reject']:.0f} µs | {r['ok']} |"
    )


async def _main(quick: bool, workdir: pathlib.Path, edge_extra: str) -> dict[str, Any]:
    daemons: list[Daemon] = []
    try:
        relay = await _start(workdir, daemons, BACKEND_LATENCY_MS, QUEUE_TIMEOUT_MS, edge_extra)
        edge, node, backend = relay.edge, relay.node, relay.backend
        http_port, backend_port = relay.http_port, relay.backend_port
        processes = {"edge": edge, "node": node, "backend": backend}
        costs = await _costs(processes, http_port, backend_port, quick)
        cost = costs["served_ms"]
        print(f"   Edge CPU without overload: {costs}", file=sys.stderr, flush=True)
        rows = []
        for clients, retry in QUICK_SCENARIOS if quick else SCENARIOS:
            print(f"   {clients} clients, retry {retry * 1000:g} ms ...", file=sys.stderr, flush=True)
            rows.append(await _scenario(processes, http_port, backend_port, clients, retry, quick))
            row = rows[-1]
            _per_refusal(row, costs)
            print(_row(rows[-1]), file=sys.stderr, flush=True)
        for daemon in reversed(daemons):
            daemon.stop()  # the refusals-alone relay gets the cores to itself
        alone = await _refusals_alone(workdir / "alone", quick, edge_extra)
        return {
            "alone": alone,
            "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
            "costs": costs,
            "served_cpu_ms": cost,
            "ideal_rps": IDEAL_RPS,
            "capacity": CAPACITY,
            "quick": quick,
            "cpus": os.cpu_count(),
            "rows": rows,
        }
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


def run(runs: int = 1, quick: bool = False, edge_extra: str = "") -> dict[str, Any]:
    """Start the processes and run every scenario once (``runs`` is ignored: each row is long)."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="iop-overload-"))
    (workdir / "alone").mkdir()
    try:
        result = trio.run(_main, quick, workdir, edge_extra)
    except BenchmarkFailed:
        print(f"(logs kept in {workdir})", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    result["command"] = "python -m benchmarks overload" + (" --quick" if quick else "")
    return result


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.0f} ms" if value < 1000 else f"{value / 1000:.2f} s"


def _per_refusal_cell(r: dict[str, Any]) -> str:
    if r["rejected"] + r["timed_out"] < FEW_REFUSALS * r["ok"]:
        return "(few refusals)"  # the served requests' CPU dominates: the remainder is within its noise
    return f"{r['edge_cpu_us_per_reject']:.0f} µs ({r['reject_share']:.1%})"


def _row(r: dict[str, Any]) -> str:
    probe = r["probe"]
    cpu = r["cpu_pct"]
    drain = r["drain"]
    retry = "Retry-After" if r["retry_s"] < 0 else f"{r['retry_s'] * 1000:g} ms"
    return (
        f"| {r['clients']:,} | {retry} | {r['ok_rps']:.1f} ({r['ok_rps'] / IDEAL_RPS:.0%})"
        f" | {_ms(r['ok_p50_ms'])} / {_ms(r['ok_p99_ms'])} | {_ms(r['beyond_queue_p99_ms'])}"
        f" | {r['rejected_rps']:.0f}/s, p99 {_ms(r['reject_p99_ms'])}"
        f" | {_ms(r['on_time_p99_ms'])} ({r['on_time']})"
        f" | {r['timed_out'] / r['duration_s']:.0f}/s"
        f" | {_ms(probe['/healthz']['p99_ms'])} ({probe['/healthz']['n']})"
        f" | {_ms(probe['/status']['p99_ms'])} / {_ms(probe['/metrics']['p99_ms'])}"
        f" | {cpu['edge']:.0f} % | {_per_refusal_cell(r)}"
        f" | {cpu['flood']:.0f} % | {cpu['node']:.0f} % | {drain['backend_peak']}, drained {drain['seconds']} s |"
    )


def table(result: dict[str, Any]) -> str:
    head = (
        "| clients | retry | answered 200/s (of ideal) | 200 p50 / p99 | 200 beyond queue wait, p99"
        " | refused at once, p99 (client side)"
        " | refusals after Retry-After: p99 (n) | queue timeouts | `/healthz` p99 (n)"
        " | `/status` / `/metrics` p99 | Edge CPU | Edge CPU per refusal (of a served request) | flood CPU"
        " | Node CPU | backend peak, drain |\n|" + "---|" * 15
    )
    costs = result["costs"]
    title = (
        f"ideal {result['ideal_rps']:g} answered/s; Edge CPU without overload: per served request"
        f" {costs['served_ms']:.2f} ms ({costs['queued_ms']:.2f} ms through a full queue), per refused"
        f" 404 {costs['reject_us']:.0f} µs, per `/healthz` {costs['healthz_us']:.0f} µs (the idle Edge's"
        f" {costs['idle_ms_per_s']:.1f} ms/s left out), with only the probe {costs['probe_ms_per_s']:.1f} ms/s"
        f" ({result['command']}; load average {result['load']})"
    )
    alone = result["alone"]
    alone_title = (
        f"\nRefusals alone (a backend that never answers in the window; idle Edge {alone['idle_ms_per_s']:.1f} ms/s"
        f" subtracted): Edge CPU per refusal, against a served request's {costs['served_ms']:.2f} ms"
    )
    alone_head = (
        "| clients | retry | refusals | Edge CPU | Edge CPU per refusal | answered (must be 0) |\n|" + "---|" * 6
    )
    alone_rows = [_alone_row(r).replace(" µs |", f" µs ({_share(r, costs)}) |", 1) for r in alone["rows"]]
    return "\n".join([title, head, *map(_row, result["rows"]), alone_title, alone_head, *alone_rows])


def _share(row: dict[str, Any], costs: dict[str, float]) -> str:
    return f"{row['edge_cpu_us_per_reject'] / (costs['served_ms'] * 1000):.1%}"


def main(argv: list[str] | None = None) -> None:
    """The flood and probe processes: ``python -m benchmarks.overload flood|probe ...``; prints JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overload")
    parser.add_argument("role", choices=("flood", "probe"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--retry", type=float, default=0.01)
    parser.add_argument("--warmup", type=float, default=WARMUP)
    parser.add_argument("--duration", type=float, default=DURATION)
    parser.add_argument("--pids", default="", help="name=pid,...: processes whose CPU to read over the window")
    parser.add_argument(
        "--begin", default=None, help="probe: 'stdin': read the window's start (time.perf_counter) from stdin"
    )
    args = parser.parse_args(argv)
    pids = {name: int(pid) for name, _, pid in (item.partition("=") for item in args.pids.split(",") if item)}
    # No cyclic garbage collection in the load generator: a flood of 5,000 clients holds enough
    # objects that each full collection stopped its loop for 150-270 ms (gc.callbacks, quiet box),
    # several times per window, and every answer in flight then looked that much slower. The
    # process lives for one window (seconds); reference counting frees the rest.
    gc.disable()
    if args.role == "flood":
        out = trio.run(_flood, args.port, args.clients, args.retry, args.warmup, args.duration, pids)
    else:
        begin = float(sys.stdin.readline()) if args.begin == "stdin" else None
        out = trio.run(_probe, args.port, args.warmup, args.duration, pids, begin)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
