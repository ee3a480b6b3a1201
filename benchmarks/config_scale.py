"""The Edge's config and ops endpoints at fleet size (``python -m benchmarks config_scale``).

Prints the figures behind [reload-off-loop] and [status-at-size] for a
generated ``edge.yaml`` of N nodes with one provider each (the same file
:mod:`benchmarks.scale` generates; default N = 10,000), without a fleet:

1. **Parse**: :func:`iop_edge.config.load_edge_config` in this process, wall
   and CPU seconds (the start path); the reload path: the reader process
   (spawn to exit, wall, and its own CPU seconds: start-up, parse, pool,
   lookups, pickles) and the config rebuilt from its output in this
   process (wall, and the largest step: what one loop turn holds).
2. **Loop stalls**: an ``iop-edge`` process on that file; a probe asks
   ``GET /healthz`` on its own connection every 2 ms and records the gap
   between two answers. Largest and 99th-percentile gap with nothing else
   going on (baseline), while ``POST /admin/reload`` re-reads the file (and
   for :data:`AFTER_RELOAD` seconds after it answered), and
   while ``GET /status`` and ``GET /metrics`` are answered. A gap is what a
   stream's inter-event gap would be: the loop answers nothing while it is held.
3. **Ops endpoints**: ``GET /status`` and ``GET /metrics`` time (median of 3),
   the Edge's CPU per request (the probe's own CPU, measured in the baseline,
   taken off) and size, the metrics' series count, and the series count with
   ``metrics_per_provider: false`` and with ``metrics_per_node: false``
   (rendered in this process).

Every port is chosen by the kernel; every wait is bounded.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import re
import statistics
import tempfile
import time
from typing import Any

import trio

from iop_admission import Admission
from iop_edge import rebuild_config, run_config_reader
from iop_edge.config import load_edge_config
from iop_edge.metrics import EdgeMetrics

from .harness import BenchmarkFailed, Daemon, HttpConnection, python_command
from .scale import edge_yaml

NODES = 10_000
ADMIN_TOKEN = "config-scale-admin"
PROBE_INTERVAL = 0.002
"""Seconds between two ``/healthz`` probes."""
BASELINE = 1.0
"""Seconds of probing with nothing else going on."""
AFTER_RELOAD = 2.0
"""Seconds of probing after the reload answered, counted in the reload's gaps."""
START_TIMEOUT = 120.0
STEP_TIMEOUT = 120.0


def config_text(nodes: int) -> str:
    """:func:`benchmarks.scale.edge_yaml` plus an admin token (for ``/admin/reload``)."""
    return edge_yaml(nodes) + f"admin_token: {ADMIN_TOKEN}\n"


def parse_times(path: pathlib.Path) -> dict[str, float]:
    """Wall and CPU seconds of one load of ``path`` as the Edge starts; a reload's reader and rebuild."""
    wall, cpu = time.perf_counter(), time.process_time()
    load_edge_config(path)
    out = {"start_wall_s": time.perf_counter() - wall, "start_cpu_s": time.process_time() - cpu}
    out.update(trio.run(_read_and_rebuild, path))
    return out


async def _read_and_rebuild(path: pathlib.Path) -> dict[str, float]:
    steps: list[float] = []

    class Steps(trio.abc.Instrument):
        def __init__(self) -> None:
            self.start = time.perf_counter()  # added in the middle of a step: that one counts from here

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            self.start = time.perf_counter()

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            steps.append(time.perf_counter() - self.start)

    wall = time.perf_counter()
    output = await run_config_reader(path)
    read_wall = time.perf_counter() - wall
    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    wall = time.perf_counter()
    read = await rebuild_config(output)
    rebuild_wall = time.perf_counter() - wall
    trio.lowlevel.remove_instrument(instrument)
    return {
        "reader_wall_s": read_wall,
        "reader_cpu_s": read.reader_cpu,
        "rebuild_wall_s": rebuild_wall,
        "rebuild_step_max_ms": max(steps) * 1000,
    }


def per_node_series(path: pathlib.Path) -> dict[str, float]:
    """Series count and render time of ``/metrics`` per provider, per node and Edge-wide, in this process."""
    config = load_edge_config(path)
    out: dict[str, float] = {}
    for name, per_provider, per_node in (
        ("per_provider", True, True),
        ("per_node", False, True),
        ("edge", False, False),
    ):
        metrics = EdgeMetrics(Admission(config.pool_config()), per_provider=per_provider, per_node=per_node)
        t0 = time.perf_counter()
        body, _ = metrics.render()
        out[f"{name}_render_ms"] = (time.perf_counter() - t0) * 1000
        out[f"{name}_series"] = _series(body)
    return out


def _series(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


class Probe:
    """``GET /healthz`` every :data:`PROBE_INTERVAL` on one connection; the answers' arrival times."""

    def __init__(self, port: int) -> None:
        self._connection = HttpConnection("127.0.0.1", port)
        self.arrivals: list[float] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        raw = HttpConnection.build("GET", "/healthz")
        await self._connection.request(raw)  # connected before anyone relies on it
        task_status.started()
        try:
            while True:
                await self._connection.request(raw)
                self.arrivals.append(time.perf_counter())
                await trio.sleep(PROBE_INTERVAL)
        finally:
            with trio.CancelScope(shield=True):
                await self._connection.aclose()

    def gaps_since(self, since: float) -> dict[str, float]:
        """Largest and 99th-percentile gap (ms) between answers that arrived after ``since``."""
        gaps = sorted((b - a) * 1000 for a, b in itertools.pairwise(self.arrivals) if a >= since)
        if not gaps:
            return {"max_ms": 0.0, "p99_ms": 0.0, "answers": 0}
        return {"max_ms": gaps[-1], "p99_ms": gaps[int(0.99 * (len(gaps) - 1))], "answers": len(gaps)}


async def timed_request(port: int, method: str, path: str, token: str | None = None) -> tuple[float, bytes]:
    """Milliseconds of one request on a fresh connection, and the body."""
    connection = HttpConnection("127.0.0.1", port)
    headers = None if token is None else {"authorization": f"Bearer {token}"}
    raw = HttpConnection.build(method, path, b"" if method == "POST" else None, headers=headers)
    try:
        t0 = time.perf_counter()
        with trio.fail_after(STEP_TIMEOUT):
            status, body = await connection.request(raw)
        elapsed = (time.perf_counter() - t0) * 1000
    finally:
        await connection.aclose()
    if status != 200:
        raise BenchmarkFailed(f"{method} {path}: {status} {body[:300]!r}")
    return elapsed, body


async def start_edge(workdir: pathlib.Path) -> tuple[Daemon, float, int]:
    start = time.perf_counter()
    edge = Daemon("edge", python_command("-m", "iop_edge", "--config", str(workdir / "edge.yaml")), workdir)
    pattern = re.compile(r"listening: http://[^:]+:(\d+) \(API\)")
    with trio.move_on_after(START_TIMEOUT):
        while True:
            match = pattern.search(edge.log.read_text(errors="replace"))
            if match:
                return edge, time.perf_counter() - start, int(match[1])
            edge.check_alive()
            await trio.sleep(0.02)
    edge.stop()
    raise BenchmarkFailed(f"the Edge did not listen within {START_TIMEOUT:.0f} s:\n{edge.tail()}")


async def _edge_figures(workdir: pathlib.Path) -> dict[str, Any]:
    edge, start_s, port = await start_edge(workdir)
    out: dict[str, Any] = {"edge_start_s": start_s}
    try:
        probe = Probe(port)
        async with trio.open_nursery() as nursery:
            await nursery.start(probe.run)
            since, cpu = time.perf_counter(), edge.cpu_seconds()
            await trio.sleep(BASELINE)
            out["baseline"] = probe.gaps_since(since)
            idle_cpu = (edge.cpu_seconds() - cpu) / (time.perf_counter() - since)  # the probe's own cost
            since = time.perf_counter()
            out["reload_ms"], _ = await timed_request(port, "POST", "/admin/reload", ADMIN_TOKEN)
            await trio.sleep(AFTER_RELOAD)  # garbage collections the reload's allocations start come after it
            out["reload"] = probe.gaps_since(since)
            for name, path in (("status", "/status"), ("status_node", "/status?node=node-0"), ("metrics", "/metrics")):
                since, times, cpu = time.perf_counter(), [], edge.cpu_seconds()
                for _ in range(3):
                    elapsed, body = await timed_request(port, "GET", path)
                    times.append(elapsed)
                cpu = edge.cpu_seconds() - cpu - idle_cpu * (time.perf_counter() - since)
                out[name] = {"ms": statistics.median(times), "bytes": len(body), **probe.gaps_since(since)}
                out[name]["cpu_ms"] = cpu / 3 * 1000
                if name == "metrics":
                    out[name]["series"] = _series(body)
            nursery.cancel_scope.cancel()
    finally:
        edge.stop()
    return out


def run(runs: int = 1, nodes: int = NODES) -> dict[str, Any]:
    """Every figure once for a ``nodes``-node file (``runs`` is ignored)."""
    del runs
    with tempfile.TemporaryDirectory(prefix="iop-config-scale-") as tmp:
        workdir = pathlib.Path(tmp)
        path = workdir / "edge.yaml"
        path.write_text(config_text(nodes))
        result: dict[str, Any] = {"nodes": nodes, "file_bytes": path.stat().st_size}
        result["parse"] = parse_times(path)
        result["metrics_local"] = per_node_series(path)
        result.update(trio.run(_edge_figures, workdir))
    return result


def table(result: dict[str, Any]) -> str:
    """Format :func:`run`'s result as Markdown lines."""
    p, m = result["parse"], result["metrics_local"]
    n = f"{result['nodes']:,}"
    rows = [
        f"| parse {n}-node edge.yaml ({result['file_bytes'] / 1e6:.1f} MB), start path | "
        f"{p['start_wall_s']:.2f} s wall, {p['start_cpu_s']:.2f} s CPU |",
        f"| reload path: reader process (spawn to exit) / its CPU; rebuild here (largest loop turn) | "
        f"{p['reader_wall_s']:.2f} s wall / {p['reader_cpu_s']:.2f} s CPU; {p['rebuild_wall_s'] * 1000:.0f} ms "
        f"({p['rebuild_step_max_ms']:.1f} ms) |",
        f"| Edge start (spawn to listening) | {result['edge_start_s']:.2f} s |",
        _gap_row("loop gap, baseline (no reload)", result["baseline"]),
        _gap_row(
            f"loop gap during `POST /admin/reload` ({result['reload_ms']:.0f} ms) and {AFTER_RELOAD:g} s after",
            result["reload"],
        ),
    ]
    for name, path in (("status", "/status"), ("status_node", "/status?node=node-0"), ("metrics", "/metrics")):
        r = result[name]
        extra = f", {r['series']:,} series" if "series" in r else ""
        what = f"`GET {path}`: {r['ms']:.0f} ms ({r['cpu_ms']:.0f} ms Edge CPU), {r['bytes'] / 1e6:.2f} MB{extra}"
        rows.append(_gap_row(f"{what}; loop gap", r))
    rows.append(
        "| `/metrics` rendered in-process: per provider / per node (`metrics_per_provider: false`) "
        f"/ Edge-wide (`metrics_per_node: false`) | {m['per_provider_series']:,} / {m['per_node_series']:,} "
        f"/ {m['edge_series']:,} series, {m['per_provider_render_ms']:.0f} / {m['per_node_render_ms']:.0f} "
        f"/ {m['edge_render_ms']:.0f} ms |"
    )
    return "\n".join(["| what | figure |", "|---|---|", *rows])


def _gap_row(what: str, gaps: dict[str, float]) -> str:
    return f"| {what} | max {gaps['max_ms']:.1f} ms, p99 {gaps['p99_ms']:.1f} ms ({gaps['answers']:,} probes) |"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.config_scale", description=__doc__)
    parser.add_argument("nodes", nargs="?", type=int, default=NODES)
    args = parser.parse_args()
    print(table(run(nodes=args.nodes)))
