"""A reload on a saturated Edge, by the config reader's priority (``python -m benchmarks reload_load``).

The figures behind :data:`iop_edge.config.reader.NICENESS` ([reload-off-loop]): an
``iop-edge`` process on a generated N-node ``edge.yaml`` (default 10,000) kept at
a full core by clients asking ``GET /status`` back to back (each answer walks
every node), and a CPU burner (a process of its own session spinning) beside
it, so both cores of the benchmark box are busy. Then, one after the other, the
config reader on that file (the Edge's own command line, :func:`reader_argv`)
is run in a session of its own under each priority of :data:`POLICIES`, and
timed from spawn to exit (given up after :data:`READER_CAP` s), with the Edge's
``/status`` answers per second meanwhile against the same window before
(what the reader took from the Edge). Last, ``POST /admin/reload`` with the
reader's priority as the Edge sets it, timed end to end.

Bounded: about two minutes at 10,000 nodes. Every port is chosen by the kernel.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import trio

from iop_edge.config.reader import NICENESS, reader_argv

from .config_scale import ADMIN_TOKEN, NODES, config_text, start_edge, timed_request
from .harness import HttpConnection

POLICIES: dict[str, tuple[bool, int]] = {
    "nice 0": (False, 0),
    "nice 5": (False, 5),
    "nice 10": (False, 10),
    "nice 19": (False, 19),
    "SCHED_IDLE, autogroup nice 19": (True, 19),
}
"""Reader priorities measured: ``(SCHED_IDLE, nice of its session's autogroup and its own)``."""

READER_CAP = 30.0
"""Seconds a reader may run before it is given up (a starved reader is reported as over it)."""

LOADERS = 2
"""Connections asking ``GET /status`` back to back."""

BASELINE = 3.0
"""Seconds of load before the readers, for the Edge's answers per second undisturbed."""


def apply_policy(pid: int, idle: bool, nice: int) -> None:
    """Put process ``pid`` (leading a session of its own) at ``nice`` as a session, and at idle
    priority when ``idle`` (else at ``nice`` itself)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as autogroup:
            autogroup.write(str(nice))
    except OSError:
        pass  # no autogroups here
    if idle:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.setpriority(os.PRIO_PROCESS, pid, nice)


class StatusLoad:
    """``GET /status`` back to back on :data:`LOADERS` connections; the answers' arrival times."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.arrivals: list[float] = []

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(LOADERS):
                nursery.start_soon(self._loop)

    async def _loop(self) -> None:
        connection = HttpConnection("127.0.0.1", self.port)
        raw = HttpConnection.build("GET", "/status")
        try:
            while True:
                await connection.request(raw)
                self.arrivals.append(time.perf_counter())
        finally:
            with trio.CancelScope(shield=True):
                await connection.aclose()

    def rate(self, since: float, until: float) -> float:
        """Answers per second between ``since`` and ``until``."""
        return sum(1 for t in self.arrivals if since <= t < until) / max(until - since, 1e-9)


async def time_reader(path: pathlib.Path, idle: bool, nice: int) -> float:
    """Seconds from spawn to exit of the reader on ``path`` at that priority (inf past :data:`READER_CAP`)."""
    start = time.perf_counter()
    process = subprocess.Popen(
        reader_argv(path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        apply_policy(process.pid, idle, nice)
        with trio.move_on_after(READER_CAP):
            while process.poll() is None:
                await trio.sleep(0.01)
            if process.returncode != 0:
                raise RuntimeError(f"the reader failed: exit code {process.returncode}")
            return time.perf_counter() - start
        return float("inf")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _measure(workdir: pathlib.Path, nodes: int) -> dict[str, Any]:
    path = workdir / "edge.yaml"
    path.write_text(config_text(nodes))
    edge, _, port = await start_edge(workdir)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    out: dict[str, Any] = {"nodes": nodes, "cpus": os.cpu_count(), "loaders": LOADERS, "code_niceness": NICENESS}
    try:
        load = StatusLoad(port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run)
            await trio.sleep(1.0)  # the loaders connected, the Edge's first answers out
            since, cpu = time.perf_counter(), edge.cpu_seconds()
            await trio.sleep(BASELINE)
            now = time.perf_counter()
            out["baseline"] = {
                "status_per_s": load.rate(since, now),
                "edge_cpu": (edge.cpu_seconds() - cpu) / (now - since),
            }
            readers: dict[str, Any] = {}
            for name, (idle, nice) in POLICIES.items():
                since, cpu = time.perf_counter(), edge.cpu_seconds()
                seconds = await time_reader(path, idle, nice)
                now = time.perf_counter()
                readers[name] = {
                    "reader_s": seconds,
                    "status_per_s": load.rate(since, now),
                    "edge_cpu": (edge.cpu_seconds() - cpu) / (now - since),
                }
                print(f"  {name}: {readers[name]}", file=sys.stderr, flush=True)
            out["readers"] = readers
            reload_ms, _ = await timed_request(port, "POST", "/admin/reload", ADMIN_TOKEN)
            out["admin_reload_s"] = reload_ms / 1000
            nursery.cancel_scope.cancel()
    finally:
        burner.kill()
        burner.wait()
        edge.stop()
    return out


def run(runs: int = 1, nodes: int = NODES) -> dict[str, Any]:
    """Every figure once for a ``nodes``-node file (``runs`` is ignored)."""
    del runs
    with tempfile.TemporaryDirectory(prefix="iop-reload-load-") as tmp:
        return trio.run(_measure, pathlib.Path(tmp), nodes)


def _seconds(value: float) -> str:
    return f"> {READER_CAP:g} s (given up)" if value == float("inf") else f"{value:.1f} s"


def table(result: dict[str, Any]) -> str:
    base = result["baseline"]
    lines = [
        f"Reload on a saturated Edge: {result['nodes']:,} nodes, {result['cpus']} CPUs, the Edge "
        f"answering {base['status_per_s']:.1f} /status per s at {base['edge_cpu'] * 100:.0f} % of a core, "
        "a CPU burner beside it",
        "",
        "| reader priority | reader, spawn to exit | Edge's /status per s meanwhile | Edge's CPU meanwhile |",
        "|---|---|---|---|",
    ]
    for name, row in result["readers"].items():
        lines.append(
            f"| {name} | {_seconds(row['reader_s'])} | {row['status_per_s']:.1f} "
            f"({row['status_per_s'] / max(base['status_per_s'], 1e-9) * 100:.0f} %) | {row['edge_cpu'] * 100:.0f} % |"
        )
    lines.append("")
    lines.append(f"`POST /admin/reload` (reader at nice {result['code_niceness']}): {result['admin_reload_s']:.1f} s")
    return "\n".join(lines)
