"""The live queue page's cost ([queue-page]), in process, on one trio loop.

- ``build``: one view: the state read on the loop (``Admission.snapshot`` + ``Admission.waiters``),
  then the view model + JSON (a worker thread in the Edge),
  at 1,000 providers with 1,000 waiters and with 10,000 waiters, against the reference
  ``Admission.snapshot()`` alone (what ``/status`` reads) measured in the same run.
- ``viewers``: the loop's CPU while the page's memory runs (``QueuePage.run``: one chart
  sample a second and the event count, as in the Edge from its start) and 50 streams run at
  one update a second (the view changes every second: waiters age), minus the same loop idle
  for as long, as a share of one core; and the memory alone, without viewers. The history
  is full (five minutes of samples) before the viewers open, so each is sent the whole of
  it. The streams write to loopback sockets that a child process reads (the Edge's socket
  writes are counted, the readers' CPU is not; no HTTP framing).
- ``memory``: the page's memory alone (no viewer) at 1,000 and 10,000 idle providers.

- ``flood``: the stream's update delay, and the page's open latency (``GET /ui``, then a new
  stream's first view), while the overload benchmark's 5,000-client flood runs against a
  real Edge (:func:`_under_flood`).

``python -m benchmarks.ui flood [--quick]`` runs the flood figure alone (``--quick``: a 4 s window);
``python -m benchmarks.ui viewers`` the viewers figure alone (about 35 s);
``python -m benchmarks.ui memory`` the page's memory alone at 1,000 and 10,000 providers (about 40 s).

Every provider is full (1,000 leases held), so every waiter waits.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import trio
import trio.testing

from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_edge import QueuePage, build_view
from iop_edge.config import UiConfig
from iop_edge.ui.history import HISTORY_SECONDS
from iop_edge.ui.parts import PageAlone

from . import overload
from .harness import ROOT, Daemon, HttpConnection, percentile, start_relay

NODES = 1_000
MODELS = 10
VIEWERS = 50
WINDOW_S = 10.0


def _pool(waiters: int) -> PoolConfig:
    keys = [ProviderKey(f"node-{i:05d}", "gpu0") for i in range(NODES)]
    spec = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=8192, total_context_tokens=8192)
    per = NODES // MODELS
    return PoolConfig(
        policy=QueuePolicy(max_queue=waiters + NODES, queue_timeout=3600.0),
        providers=dict.fromkeys(keys, spec),
        models={f"model-{m}": ModelGroup(candidates=tuple(keys[m * per : (m + 1) * per])) for m in range(MODELS)},
    )


async def _hold(admission: Admission, model: str, done: trio.Event) -> None:
    async with admission.lease(model):
        await done.wait()


async def _filled(nursery: trio.Nursery, waiters: int, done: trio.Event) -> Admission:
    admission = Admission(_pool(waiters))
    for i in range(NODES):
        admission.connect(f"node-{i:05d}")
    for i in range(NODES + waiters):
        nursery.start_soon(_hold, admission, f"model-{i % MODELS}", done)
    await trio.testing.wait_all_tasks_blocked()
    assert admission.queue_depth == waiters
    return admission


def _median_ms(work: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _read(admission: Admission) -> tuple[Any, Any]:
    return admission.snapshot(), admission.waiters()


def _made(admission: Admission, state: tuple[Any, Any]) -> bytes:
    return json.dumps(build_view(*state, admission.config.models)).encode()


async def _build(waiters: int, runs: int) -> dict[str, float]:
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        admission = await _filled(nursery, waiters, done)
        state = _read(admission)
        snapshot_ms = _median_ms(admission.snapshot, runs)
        read_ms = _median_ms(lambda: _read(admission), runs)
        made_ms = _median_ms(lambda: _made(admission, state), runs)
        size = len(_made(admission, state))
        done.set()
    return {
        "waiters": waiters,
        "snapshot_ms": snapshot_ms,
        "read_ms": read_ms,
        "made_ms": made_ms,
        "view_ms": read_ms + made_ms,
        "ratio": (read_ms + made_ms) / snapshot_ms,
        "bytes": size,
    }


_DRAIN = """
import selectors, socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
picker = selectors.DefaultSelector()
for _ in range(count):
    picker.register(socket.create_connection(("127.0.0.1", port)), selectors.EVENT_READ)
open_ = count
while open_:
    for key, _ in picker.select():
        if not key.fileobj.recv(1 << 20):
            picker.unregister(key.fileobj)
            open_ -= 1
"""
"""The viewers' side: a child process that connects and reads every stream until it ends."""


async def _viewers() -> dict[str, float]:
    """50 streams written to loopback sockets read by a child process (its CPU is not counted)."""
    done = trio.Event()
    sent = [0]
    opened = [0]  # the first stream's history event, in bytes

    async with trio.open_nursery() as nursery:
        admission = await _filled(nursery, NODES, done)
        page = QueuePage(PageAlone(admission, UiConfig(enabled=True, viewer_token="t", max_viewers=VIEWERS)))
        idle_start, idle_cpu = time.perf_counter(), time.process_time()
        await trio.sleep(WINDOW_S)
        idle = (time.process_time() - idle_cpu) / (time.perf_counter() - idle_start)
        for second in range(HISTORY_SECONDS):  # five minutes kept: each viewer opens on all of it
            page.memory.history.add(NODES, NODES, second % 50, second % 7)
        nursery.start_soon(page.run)
        memory_start, memory_cpu = time.perf_counter(), time.process_time()
        await trio.sleep(WINDOW_S)
        memory = (time.process_time() - memory_cpu) / (time.perf_counter() - memory_start)
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listener.socket.getsockname()[1]
        drain = await trio.lowlevel.open_process([sys.executable, "-c", _DRAIN, str(port), str(VIEWERS)])
        scope = {"type": "http", "method": "GET", "path": "/ui/stream", "query_string": b"token=t", "headers": []}

        async def viewer(stream: trio.SocketStream) -> None:
            async def send(message: dict[str, Any]) -> None:
                body = message.get("body", b"")
                if body:
                    sent[0] += len(body)
                    if not opened[0]:
                        opened[0] = len(body)
                    await stream.send_all(body)

            async def receive() -> dict[str, Any]:
                await done.wait()
                return {"type": "http.disconnect"}

            async with stream:
                await page(dict(scope), receive, send)

        for _ in range(VIEWERS):
            nursery.start_soon(viewer, await listener.accept())
        await trio.sleep(1.0)  # every stream has sent its first view
        start, cpu, bytes_before = time.perf_counter(), time.process_time(), sent[0]
        await trio.sleep(WINDOW_S)
        busy = (time.process_time() - cpu) / (time.perf_counter() - start)
        rate = (sent[0] - bytes_before) / WINDOW_S
        done.set()
        await trio.sleep(0.5)  # the streams see their viewers go
        nursery.cancel_scope.cancel()  # and the page's memory stops
    await listener.aclose()
    await drain.wait()
    return {
        "viewers": VIEWERS,
        "idle_core_pct": idle * 100,
        "memory_core_pct": (memory - idle) * 100,
        "core_pct": (busy - idle) * 100,
        "bytes_per_s": rate,
        "history_bytes": opened[0],
    }


async def _memory(providers: int) -> dict[str, float]:
    """The page's memory alone (``QueuePage.run``, no viewer) over ``providers`` connected
    providers, idle: the loop's CPU over ``WINDOW_S`` minus the same loop without it."""
    keys = [ProviderKey(f"node-{i:05d}", "gpu0") for i in range(providers)]
    spec = ProviderSpec(capacity=4, long_context_capacity=1, context_window_tokens=8192, total_context_tokens=8192)
    admission = Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=100, queue_timeout=30.0),
            providers=dict.fromkeys(keys, spec),
            models={"m": ModelGroup(candidates=tuple(keys))},
        )
    )
    for key in keys:
        admission.connect(key.node_id)
    page = QueuePage(PageAlone(admission, UiConfig(enabled=True, viewer_token="t")))
    start, cpu = time.perf_counter(), time.process_time()
    await trio.sleep(WINDOW_S / 2)
    idle = (time.process_time() - cpu) / (time.perf_counter() - start)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(page.run)
        start, cpu = time.perf_counter(), time.process_time()
        await trio.sleep(WINDOW_S)
        busy = (time.process_time() - cpu) / (time.perf_counter() - start)
        nursery.cancel_scope.cancel()
    return {"providers": providers, "core_pct": (busy - idle) * 100, "samples": len(page.memory.history)}


FLOOD_CLIENTS = 5_000
FLOOD_RETRY_S = 1.0
FLOOD_WARMUP_S, FLOOD_DURATION_S = 3.0, 20.0
FLOOD_INTERVAL_MS = 100
OPEN_EVERY_S = 0.25
OPEN_TIMEOUT_S = 10.0


async def _fetched(port: int, raw: bytes, answered: bytes) -> float:
    """Seconds for ``raw`` on a new connection to be answered ``200`` with ``answered`` in its body
    (``math.inf`` when not, or not within ``OPEN_TIMEOUT_S``)."""
    start = time.perf_counter()
    with trio.move_on_after(OPEN_TIMEOUT_S):
        connection = HttpConnection("127.0.0.1", port)
        try:
            status, body = await connection.request(raw)
        finally:
            await connection.aclose()
        if status == 200 and answered in body:
            return time.perf_counter() - start
    return math.inf


async def _open_page(port: int, opens: list[tuple[float, float, float, float]]) -> None:
    """Open the page as a new viewer does, every ``OPEN_EVERY_S``, until cancelled: ``GET /ui`` on
    a new connection, then ``/ui/stream`` on another until its first view; and, as the
    reference, ``GET /healthz`` on a new connection. Each open is ``(start, page_s,
    first_view_s, healthz_s)`` (``math.inf`` for a part not answered within ``OPEN_TIMEOUT_S``
    or refused)."""
    page = HttpConnection.build("GET", "/ui?token=bench-viewer")
    stream = HttpConnection.build("GET", "/ui/stream?token=bench-viewer")
    healthz = HttpConnection.build("GET", "/healthz")
    while True:
        start = time.perf_counter()
        first_s = math.inf
        page_s = await _fetched(port, page, b"</html>")
        first = time.perf_counter()
        with trio.move_on_after(OPEN_TIMEOUT_S) as scope:
            connection = HttpConnection("127.0.0.1", port)

            def on_event(data: bytes) -> None:
                if b'data: {"totals"' in data:  # a view (the history event comes first)
                    scope.cancel()

            try:
                await connection.request(stream, on_event)
            finally:
                await connection.aclose()
        if scope.cancelled_caught and time.perf_counter() - first < OPEN_TIMEOUT_S:
            first_s = time.perf_counter() - first
        healthz_s = await _fetched(port, healthz, b"")
        opens.append((start, page_s, first_s, healthz_s))
        await trio.sleep(max(0.0, OPEN_EVERY_S - (time.perf_counter() - start)))


def _p(values: list[float], q: float) -> float:
    return percentile(sorted(values), q) * 1000 if values else math.nan


async def _under_flood(quick: bool = False) -> dict[str, Any]:
    """The stream's update delay and the page's open latency while the overload benchmark's
    flood runs against the Edge (its window only).

    The relay and the flood are the overload benchmark's (``benchmarks/overload.py``: one
    provider of capacity 8, ``max_queue: 64``, 5,000 closed-loop clients retrying after 1 s),
    with the page on (``update_interval_ms: 100``). A viewer in this process reads
    ``/ui/stream``; an event's delay is its gap from the one before minus the interval (the
    queue is full all along, and waiters age, so every interval has a new view to send).
    Meanwhile a new viewer opens the page every 0.25 s (:func:`_open_page`).
    """
    duration = 4.0 if quick else FLOOD_DURATION_S
    daemons: list[Daemon] = []
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="iop-ui-flood-"))
    extra = f"ui: {{enabled: true, viewer_token: bench-viewer, update_interval_ms: {FLOOD_INTERVAL_MS}}}\n"
    try:
        relay = await start_relay(
            workdir,
            daemons,
            mock_args=["--latency-ms", str(overload.BACKEND_LATENCY_MS), "--tokens-per-second", "0"],
            edge_yaml=overload.EDGE_YAML.format(
                capacity=overload.CAPACITY, extra=extra, queue_timeout_ms=overload.QUEUE_TIMEOUT_MS
            ),
            node_yaml=overload.NODE_YAML.replace("{capacity}", str(overload.CAPACITY)),
        )
        arrivals: list[float] = []

        def on_event(data: bytes) -> None:
            arrivals.extend([time.perf_counter()] * data.count(b'data: {"totals"'))

        async def view_stream() -> None:
            viewer = HttpConnection("127.0.0.1", relay.http_port)
            try:
                await viewer.request(HttpConnection.build("GET", "/ui/stream?token=bench-viewer"), on_event)
            finally:
                await viewer.aclose()

        flood_argv = [
            sys.executable, "-m", "benchmarks.overload", "flood", "--port", str(relay.http_port),
            "--clients", str(FLOOD_CLIENTS), "--retry", str(FLOOD_RETRY_S),
            "--warmup", str(FLOOD_WARMUP_S), "--duration", str(duration),
        ]  # fmt: skip
        opens: list[tuple[float, float, float, float]] = []
        with trio.fail_after(FLOOD_WARMUP_S + duration + 120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(view_stream)
                nursery.start_soon(_open_page, relay.http_port, opens)
                flood = await trio.run_process(flood_argv, capture_stdout=True, cwd=str(ROOT), check=False)
                nursery.cancel_scope.cancel()
        lines = flood.stdout.decode().split("\n")
        summary = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
        ready = next(line.split() for line in lines if line.startswith(overload.READY))
        begin = float(ready[1])  # the flood's window (time.perf_counter: the system's monotonic clock)
        arrivals = [t for t in arrivals if begin <= t <= begin + duration]
        opens = [o for o in opens if begin <= o[0] <= begin + duration]
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
    gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
    delays = [max(0.0, g - FLOOD_INTERVAL_MS / 1000) * 1000 for g in gaps]
    pages = [o[1] for o in opens if o[1] < math.inf]
    firsts = [o[2] for o in opens if o[2] < math.inf]
    healthz = [o[3] for o in opens if o[3] < math.inf]
    return {
        "clients": FLOOD_CLIENTS,
        "retry_s": FLOOD_RETRY_S,
        "interval_ms": FLOOD_INTERVAL_MS,
        "events": len(arrivals),
        "delay_p50_ms": delays[len(delays) // 2] if delays else math.nan,
        "delay_p99_ms": delays[min(len(delays) - 1, int(len(delays) * 0.99))] if delays else math.nan,
        "delay_max_ms": delays[-1] if delays else math.nan,
        "opens": len(opens),
        "page_failed": len(opens) - len(pages),
        "page_p50_ms": _p(pages, 0.5),
        "page_p99_ms": _p(pages, 0.99),
        "page_max_ms": _p(pages, 1.0),
        "first_view_failed": len(opens) - len(firsts),
        "first_view_p50_ms": _p(firsts, 0.5),
        "first_view_p99_ms": _p(firsts, 0.99),
        "first_view_max_ms": _p(firsts, 1.0),
        "healthz_failed": len(opens) - len(healthz),
        "healthz_p50_ms": _p(healthz, 0.5),
        "healthz_p99_ms": _p(healthz, 0.99),
        "healthz_max_ms": _p(healthz, 1.0),
        "flood_ok": summary.get("ok"),
        "flood_rejected": summary.get("rejected"),
    }


def run(runs: int = 5) -> dict[str, Any]:
    """The figures (``runs`` timings per build figure, median)."""

    async def main() -> dict[str, Any]:
        return {
            "nodes": NODES,
            "build": [await _build(1_000, max(runs, 5)), await _build(10_000, max(runs, 5))],
            "viewers": await _viewers(),
            "memory": await _memories(),
            "flood": await _under_flood(),
        }

    return trio.run(main)


def table(result: dict[str, Any]) -> str:
    lines = [f"queue page, {result['nodes']:,} providers (all full)"]
    for b in result["build"]:
        lines.append(
            f"  one view, {b['waiters']:,} waiters: {b['view_ms']:.1f} ms ({b['bytes']:,} bytes): state read on the"
            f" loop {b['read_ms']:.1f} ms, view + JSON in a thread {b['made_ms']:.1f} ms;"
            f" snapshot alone {b['snapshot_ms']:.1f} ms; ratio {b['ratio']:.2f}"
        )
    lines.extend(_viewer_lines(result["viewers"]))
    lines.extend(_memory_lines(result["memory"]))
    lines.extend(_flood_lines(result["flood"]))
    return "\n".join(lines)


def _flood_lines(f: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines.append(
        f"  under a flood of {f['clients']:,} clients (retry {f['retry_s']:g} s): {f['events']} stream events,"
        f" update delay beyond the {f['interval_ms']} ms interval p50 {f['delay_p50_ms']:.0f} ms,"
        f" p99 {f['delay_p99_ms']:.0f} ms, max {f['delay_max_ms']:.0f} ms"
        f" (flood: {f['flood_ok']} answered, {f['flood_rejected']} refused)"
    )
    lines.append(
        f"  opening the page under that flood, {f['opens']} opens: GET /ui p50 {f['page_p50_ms']:.0f} ms,"
        f" p99 {f['page_p99_ms']:.0f} ms, max {f['page_max_ms']:.0f} ms ({f['page_failed']} failed);"
        f" a new stream's first view p50 {f['first_view_p50_ms']:.0f} ms, p99 {f['first_view_p99_ms']:.0f} ms,"
        f" max {f['first_view_max_ms']:.0f} ms ({f['first_view_failed']} failed);"
        f" reference GET /healthz (new connection, same run) p50 {f['healthz_p50_ms']:.0f} ms,"
        f" p99 {f['healthz_p99_ms']:.0f} ms, max {f['healthz_max_ms']:.0f} ms ({f['healthz_failed']} failed)"
    )
    return lines


def _viewer_lines(v: dict[str, Any]) -> list[str]:
    return [
        f"  {v['viewers']} viewers at 1 update/s, 1,000 waiters, history on: {v['core_pct']:.2f} % of a core"
        f" (idle loop {v['idle_core_pct']:.2f} %; the page's memory alone {v['memory_core_pct']:.2f} %),"
        f" {v['bytes_per_s'] / 1000:,.0f} kB/s written; the history sent on open {v['history_bytes']:,} bytes"
    ]


def _memory_lines(memory: list[dict[str, Any]]) -> list[str]:
    return [f"  the page's memory alone, {m['providers']:,} providers: {m['core_pct']:.2f} % of a core" for m in memory]


async def _memories() -> list[dict[str, Any]]:
    return [await _memory(NODES), await _memory(10 * NODES)]


if __name__ == "__main__":
    part = sys.argv[1:2]
    if part == ["memory"]:
        memories = trio.run(_memories)
        print(json.dumps(memories))
        print("\n".join(_memory_lines(memories)))
        raise SystemExit(0)
    if part == ["viewers"]:
        viewers = trio.run(_viewers)
        print(json.dumps(viewers))
        print("\n".join(_viewer_lines(viewers)))
        raise SystemExit(0)
    if part != ["flood"]:
        raise SystemExit(
            "usage: python -m benchmarks.ui flood [--quick] | viewers | memory   (the whole suite: python -m benchmarks ui)"
        )
    quick = "--quick" in sys.argv[2:]
    figures = trio.run(_under_flood, quick)
    print(json.dumps(figures))
    print("\n".join(_flood_lines(figures)))
