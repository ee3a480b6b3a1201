"""``/healthz`` while clients flood the Edge with maximum-size bodies: ``python -m benchmarks.body_flood``.

Starts an ``iop-edge`` process on loopback (``max_body_bytes`` 4 MiB) and, from this process,
probes ``GET /healthz`` every ``--interval`` ms on its own keep-alive connection while
``--clients`` connections each post, back to back, a body of about 4 MB of small integers
(``{"model": ..., "x": [0, 1, 2, ...]}``) for a model the Edge does not serve: the Edge reads
and checks the whole body, then answers 404, so what is measured is the body's reading.

Three phases, in the same run: ``idle`` (no flood), ``on loop`` (the reference: an Edge whose
off-loop threshold is set above any body, so each body is decoded on the event loop, as before
issue 37) and ``off loop`` (this Edge: bodies over ``OFF_LOOP_BODY_BYTES`` read in a worker
thread). Prints the probe's p50, p99 and max latency per phase, the bodies read per second and the
Edge's resident memory at the phase's start and at its peak (sampled every 100 ms).
Bounded: ``--seconds`` per phase (default 10), loopback only. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile
import time

import trio

from benchmarks.harness import HttpConnection, percentile, rss_mb

EDGE_YAML = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
max_body_bytes: 4194304
nodes:
  - id: node-a
    token: flood-node-token
    providers:
      - {id: gpu0, capacity: 1}
models:
  - id: m
    candidates: [{node: node-a, provider: gpu0}]
"""
LISTENING = re.compile(r"listening: http://[^:]+:(\d+) \(API\)")
ON_LOOP = (
    "import sys, iop_edge.api.app as app; app.OFF_LOOP_BODY_BYTES = 1 << 62; "
    "from iop_edge.__main__ import main; main(sys.argv[1:])"
)
"""The reference Edge: every body decoded on the event loop."""


def flood_body(size: int = 4_000_000) -> bytes:
    head = b'{"model":"not-served","messages":[{"role":"user","content":"x"}],"x":['
    numbers = []
    total = len(head) + 2
    i = 0
    while total < size:
        number = b"%d" % (i % 100_000)
        numbers.append(number)
        total += len(number) + 1
        i += 1
    return head + b",".join(numbers) + b"]}"


async def start_edge(config: pathlib.Path, on_loop: bool) -> tuple[trio.Process, int]:
    log = config.with_name("edge-on-loop.log" if on_loop else "edge.log")
    argv = ["-c", ON_LOOP] if on_loop else ["-m", "iop_edge"]
    with log.open("wb") as sink:
        edge = await trio.lowlevel.open_process([sys.executable, *argv, "--config", str(config)], stderr=sink)
    with trio.fail_after(30):
        while not (match := LISTENING.search(log.read_text())):
            if edge.poll() is not None:
                raise RuntimeError(f"iop-edge exited before listening:\n{log.read_text()}")
            await trio.sleep(0.05)
    return edge, int(match[1])


async def probe(port: int, interval: float, until: float, latencies: list[float]) -> None:
    connection = HttpConnection("127.0.0.1", port)
    request = HttpConnection.build("GET", "/healthz")
    while time.monotonic() < until:
        started = time.monotonic()
        status, _ = await connection.request(request)
        assert status == 200, status
        latencies.append(time.monotonic() - started)
        await trio.sleep(interval)


async def sample(pids: dict[str, int], until: float, peaks: dict[str, float]) -> None:
    """Each process's resident memory (MiB) every 100 ms until ``until``; the largest in ``peaks``."""
    while time.monotonic() < until:
        for name, pid in pids.items():
            peaks[name] = max(peaks.get(name, 0.0), rss_mb(pid))
        await trio.sleep(0.1)


async def flood(port: int, body: bytes, until: float, counts: list[int]) -> None:
    connection = HttpConnection("127.0.0.1", port)
    request = HttpConnection.build("POST", "/v1/chat/completions", body)
    while time.monotonic() < until:
        status, _ = await connection.request(request)
        assert status == 404, status  # read whole, then: no such model
        counts.append(1)


Measured = tuple[list[float], int, tuple[float, float]]
"""A phase's probe latencies (s, sorted), bodies read, and the Edge's resident memory (MiB) at its start and peak."""


async def phase(edge: trio.Process, port: int, clients: int, seconds: float, interval: float) -> Measured:
    latencies: list[float] = []
    counts: list[int] = []
    body = flood_body()
    start = rss_mb(edge.pid)
    peaks: dict[str, float] = {}
    until = time.monotonic() + seconds
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(flood, port, body, until, counts)
        nursery.start_soon(probe, port, interval, until, latencies)
        nursery.start_soon(sample, {"edge": edge.pid}, until, peaks)
    return sorted(latencies), len(counts), (start, peaks["edge"])


def report(name: str, measured: Measured, seconds: float) -> str:
    latencies, bodies, (start, peak) = measured
    ms = [1000 * x for x in latencies]
    return (
        f"| {name} | {len(ms)} | {percentile(ms, 0.5):.1f} | {percentile(ms, 0.99):.1f} | {ms[-1]:.1f} "
        f"| {bodies / seconds:.1f} | {start:.0f} -> {peak:.0f} |"
    )


async def main(clients: int, seconds: float, interval: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = pathlib.Path(tmp) / "edge.yaml"
        config.write_text(EDGE_YAML)
        rows = []
        for name, on_loop, flooders in (
            ("idle", False, 0),
            ("on loop (reference)", True, clients),
            ("off loop", False, clients),
        ):
            edge, port = await start_edge(config, on_loop)
            try:
                rows.append(report(name, await phase(edge, port, flooders, seconds, interval), seconds))
            finally:
                edge.terminate()
                await edge.wait()
    print(
        f"{clients} clients, 4 MB bodies of small integers, {seconds:.0f} s per phase, probe every {interval * 1000:.0f} ms"
    )
    print("| phase | probes | /healthz p50 ms | p99 ms | max ms | bodies/s | Edge RSS MiB (start -> peak) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=10.0, help="ms between probes")
    args = parser.parse_args()
    trio.run(main, args.clients, args.seconds, args.interval / 1000)
