"""Fair share in-process: ``python -m benchmarks.fairness``.

Drives :class:`iop_admission.core.FairShare` alone (no Edge, no Node):
the 1:1:2 share of three flooding tenants on a capacity-4 provider over 10,000
grants, token mode (8,000- against 500-token prompts, one million tokens), and
the decision cost of a grant+release cycle with 1,000 tenants and 10,000
waiters as a ratio to one tenant with 10,000 waiters, measured in the same run.
Then the same cycle through the wired admission core (``AdmissionState``: a
release that grants the next waiter, and a new request), 1,000 tenants against
no tenants configured (the global FIFO), 10,000 waiters on a capacity-4 provider;
and the whole lease cycle through the trio layer, 10,000 tasks asking at once.

``--real`` (``--real --full``: the issue's 10,000 grants) runs the part through real processes
([tenant-edge]): an Edge with ``tenants:``, a Node and the mock backend (``benchmarks.harness``),
the tenants told apart by their API keys. (1) Three tenants 1:1:2 flood a capacity-4 provider:
each tenant's share of the grants (``/status`` ``tenants[].grants``, the difference over the
measured window). (2) A light tenant at 10 % of capacity (open loop) alone, then while another
tenant floods with 10x the capacity in concurrent clients: the light tenant's p99 queue wait
(``x-iop-queue-ms``) in both runs, the mean service time and its 429s.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time
from typing import Any

import trio

from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, FairShare, Granted

from .harness import Daemon, HttpConnection, Relay, get_json, percentile, run_suite, start_relay


def share(grants: int = 10_000) -> dict[str, float]:
    core = FairShare([TenantSpec("a"), TenantSpec("b"), TenantSpec("c", weight=2)])
    held: list[object] = []
    for name in ("a", "b", "c"):
        for n in range(grants):
            core.enqueue(name, (name, n))
    for _ in range(grants):
        if len(held) == 4:
            core.release(held.pop(0))  # type: ignore[arg-type]
        ticket = core.grant(lambda item: len(held) < 4)
        assert ticket is not None
        held.append(ticket)
    return {n: 100 * core.grants(n) / grants for n in ("a", "b", "c")}


def tokens(total: float = 1_000_000) -> dict[str, float]:
    core = FairShare([TenantSpec("big"), TenantSpec("small")])
    for n in range(200):
        core.enqueue("big", n, 8000.0)
    for n in range(3000):
        core.enqueue("small", n, 500.0)
    used = 0.0
    while used < total:
        ticket = core.grant()
        assert ticket is not None
        core.settle(ticket, ticket.cost * 0.9)
        core.release(ticket)
        used += ticket.charged
    return {"big": core.served("big"), "small": core.served("small")}


def cycle(tenants: int, waiters: int, cycles: int = 2_000) -> float:
    """Seconds per grant+release+enqueue cycle with ``waiters`` queued over ``tenants``."""
    core = FairShare([TenantSpec(f"t{i}") for i in range(tenants)])
    names = [f"t{i}" for i in range(tenants)]
    for n in range(waiters):
        core.enqueue(names[n % tenants], n)
    start = time.perf_counter()
    for n in range(cycles):
        ticket = core.grant()
        assert ticket is not None
        core.release(ticket)
        core.enqueue(ticket.tenant, waiters + n)
    return (time.perf_counter() - start) / cycles


def core_cycle(tenants: int, waiters: int = 10_000, cycles: int = 20_000) -> float:
    """Seconds per release (granting the next waiter) + request through ``AdmissionState``.

    ``tenants`` 0: none configured (today's FIFO); otherwise weights 1, 2, 3 in turn.
    """
    key = ProviderKey("node", "gpu")
    spec = ProviderSpec(capacity=4, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    specs = tuple(TenantSpec(f"t{i}", weight=1 + i % 3) for i in range(tenants))
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(max_queue=10 * waiters, queue_timeout=1e9),
            providers={key: spec},
            models={"m": ModelGroup(candidates=(key,))},
            tenants=specs,
        )
    )
    state.connect("node")
    names = [s.name for s in specs] or [None]
    held = [state.request("m", False, 0.0, names[0]) for _ in range(4)]
    for n in range(waiters):
        state.request("m", False, 0.0, names[n % len(names)])
    start = time.perf_counter()
    for _ in range(cycles):
        (granted,) = state.release(held.pop(0))  # type: ignore[arg-type]
        assert isinstance(granted, Granted)
        held.append(granted.lease)
        state.request("m", False, 0.0, granted.lease.tenant)
    return (time.perf_counter() - start) / cycles


def lease_cycle(tenants: int, requests: int = 10_000) -> float:
    """Seconds per lease through the trio layer: ``requests`` tasks all asking at once
    (so up to that many waiting) on a capacity-4 provider, over ``tenants`` (0: none configured)."""
    key = ProviderKey("node", "gpu")
    spec = ProviderSpec(capacity=4, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    specs = tuple(TenantSpec(f"t{i}", weight=1 + i % 3) for i in range(tenants))
    admission = Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=2 * requests, queue_timeout=1e9),
            providers={key: spec},
            models={"m": ModelGroup(candidates=(key,))},
            tenants=specs,
        )
    )
    admission.connect("node")
    names = [s.name for s in specs] or [None]

    async def one(name: str | None) -> None:
        async with admission.lease("m", tenant=name):
            await trio.lowlevel.checkpoint()

    async def run() -> float:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for n in range(requests):
                nursery.start_soon(one, names[n % len(names)])
        return (time.perf_counter() - start) / requests

    return trio.run(run)


# ------------------------------------------------------------ through real processes

CAPACITY = 4
SERVICE_MS = 50
"""The mock backend's latency: one request's service time."""

EDGE_YAML = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
provider_pool: {{max_queue: 256, queue_timeout_ms: 60000}}
overload: {{shed_loop_lag_ms: 600000}}
tenants:
{tenants}
nodes:
  - id: bench-node
    token: bench-token
    providers:
      - {{id: mock, capacity: 4}}
models:
  - id: mock
    candidates: [{{node: bench-node, provider: mock, upstream_model: mock}}]
"""

NODE_YAML = """\
node_id: bench-node
edge_url: ws://127.0.0.1:{node_port}
token: bench-token
runtime: {{concurrency: 64}}
providers:
  - {{id: mock, adapter: openai, base_url: "http://127.0.0.1:{backend_port}/v1", capacity: 4}}
"""

CHAT = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}).encode()


def _tenant_lines(*tenants: str) -> str:
    return "\n".join(f"  - {t}" for t in tenants)


async def _relay(workdir: pathlib.Path, daemons: list[Daemon], tenants: str) -> Relay:
    """The mock backend (:data:`SERVICE_MS` a request), an Edge with ``tenants`` and the Node."""
    return await start_relay(
        workdir,
        daemons,
        mock_args=["--latency-ms", str(SERVICE_MS), "--tokens-per-second", "0"],
        edge_yaml=EDGE_YAML.format(tenants=tenants),
        node_yaml=NODE_YAML,
    )


async def _flood(port: int, key: str, clients: int, stop: trio.Event, counts: dict[str, int]) -> None:
    """``clients`` closed-loop clients of tenant key ``key`` until ``stop``; a 429 waits 50 ms."""
    raw = HttpConnection.build("POST", "/v1/chat/completions", CHAT, headers={"authorization": f"Bearer {key}"})

    async def client() -> None:
        connection = HttpConnection("127.0.0.1", port)
        try:
            while not stop.is_set():
                status, _ = await connection.request(raw)
                counts[str(status)] = counts.get(str(status), 0) + 1
                if status != 200:
                    await trio.sleep(0.05)
        finally:
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)


async def _grants(port: int) -> dict[str, int]:
    poller = HttpConnection("127.0.0.1", port)
    try:
        status = await get_json(poller, "/status")
    finally:
        await poller.aclose()
    return {t["name"]: t["grants"] for t in status["tenants"]}


async def real_share(workdir: pathlib.Path, grants: int) -> dict[str, Any]:
    """Tenants a, b (weight 1) and c (weight 2) flood with 8 clients each: shares over ``grants`` grants."""
    tenants = _tenant_lines(
        "{name: a, weight: 1, api_keys: [key-a]}",
        "{name: b, weight: 1, api_keys: [key-b]}",
        "{name: c, weight: 2, api_keys: [key-c]}",
    )
    daemons: list[Daemon] = []
    try:
        relay = await _relay(workdir, daemons, tenants)
        stop = trio.Event()
        counts: dict[str, int] = {}
        async with trio.open_nursery() as nursery:
            for key in ("key-a", "key-b", "key-c"):
                nursery.start_soon(_flood, relay.http_port, key, 8, stop, counts)
            await trio.sleep(1.0)  # every tenant backlogged
            start = await _grants(relay.http_port)
            while True:
                await trio.sleep(0.5)
                now = await _grants(relay.http_port)
                done = {n: now[n] - start[n] for n in ("a", "b", "c")}
                if sum(done.values()) >= grants:
                    break
            stop.set()
        total = sum(done.values())
        return {"grants": total, "share": {n: round(100 * v / total, 2) for n, v in done.items()}, "answers": counts}
    finally:
        for daemon in daemons:
            daemon.stop()


async def _light(
    port: int, rate: float, duration: float, waits: list[float], counts: dict[str, int], served: list[float]
) -> None:
    """Open loop: one request of tenant ``light`` every ``1 / rate`` s for ``duration`` s."""
    raw = HttpConnection.build("POST", "/v1/chat/completions", CHAT, headers={"authorization": "Bearer key-light"})

    async def one() -> None:
        connection = HttpConnection("127.0.0.1", port)
        try:
            start = time.perf_counter()
            status, _ = await connection.request(raw)
            counts[str(status)] = counts.get(str(status), 0) + 1
            if status == 200:
                wait = int(connection.headers.get(b"x-iop-queue-ms", b"0")) / 1000
                waits.append(wait)
                served.append(time.perf_counter() - start - wait)
        finally:
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        deadline = trio.current_time() + duration
        while trio.current_time() < deadline:
            nursery.start_soon(one)
            await trio.sleep(1 / rate)


async def real_light(workdir: pathlib.Path, duration: float) -> dict[str, Any]:
    """The light tenant at 10 % of capacity, alone then beside a 10x flood (40 clients, max_queue 32)."""
    tenants = _tenant_lines(
        "{name: light, api_keys: [key-light]}",
        "{name: flood, max_queue: 32, api_keys: [key-flood]}",
    )
    rate = 0.1 * CAPACITY * 1000 / SERVICE_MS
    daemons: list[Daemon] = []
    result: dict[str, Any] = {"rate": rate}
    try:
        relay = await _relay(workdir, daemons, tenants)
        for phase in ("alone", "flooded"):
            waits: list[float] = []
            served: list[float] = []
            counts: dict[str, int] = {}
            flood: dict[str, int] = {}
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                if phase == "flooded":
                    nursery.start_soon(_flood, relay.http_port, "key-flood", 10 * CAPACITY, stop, flood)
                    await trio.sleep(1.0)
                await _light(relay.http_port, rate, duration, waits, counts, served)
                stop.set()
            waits.sort()
            result[phase] = {
                "light_p99_ms": round(1000 * percentile(waits, 0.99), 1),
                "light_p50_ms": round(1000 * percentile(waits, 0.5), 1),
                "light_mean_service_ms": round(1000 * statistics.fmean(served), 1),
                "light_answers": counts,
                "flood_answers": flood,
            }
        result["mock_latency_ms"] = SERVICE_MS
        return result
    finally:
        for daemon in daemons:
            daemon.stop()


def real(full: bool) -> dict[str, Any]:
    async def both(workdir: pathlib.Path) -> dict[str, Any]:
        share_dir, light_dir = workdir / "share", workdir / "light"
        share_dir.mkdir()
        light_dir.mkdir()
        with trio.fail_after(600):
            return {
                "share": await real_share(share_dir, 10_000 if full else 2_000),
                "light": await real_light(light_dir, 20.0 if full else 8.0),
            }

    result = run_suite("iop-fairness-", both, with_peers=False)
    result["command"] = "python -m benchmarks.fairness --real" + (" --full" if full else "")
    return result


def main() -> None:
    if "--real" in sys.argv:
        print(json.dumps(real("--full" in sys.argv), indent=1))
        return
    print("share 1:1:2 over 10,000 grants (%):", {k: round(v, 2) for k, v in share().items()})
    served = tokens()
    print("tokens served (8,000 vs 500-token prompts):", {k: round(v) for k, v in served.items()})
    one = statistics.median(cycle(1, 10_000) for _ in range(3))
    many = statistics.median(cycle(1_000, 10_000) for _ in range(3))
    print(f"decision cost: 1 tenant {one * 1e6:.1f} us, 1,000 tenants {many * 1e6:.1f} us, ratio {many / one:.1f}x")
    none = statistics.median(core_cycle(0) for _ in range(3))
    wired = statistics.median(core_cycle(1_000) for _ in range(3))
    print(
        f"admission core cycle, 10,000 waiters: no tenants {none * 1e6:.1f} us,"
        f" 1,000 tenants {wired * 1e6:.1f} us, ratio {wired / none:.1f}x"
    )
    plain = statistics.median(lease_cycle(0) for _ in range(3))
    fair = statistics.median(lease_cycle(1_000) for _ in range(3))
    print(
        f"trio lease cycle, 10,000 tasks asking at once: no tenants {plain * 1e6:.1f} us,"
        f" 1,000 tenants {fair * 1e6:.1f} us, ratio {fair / plain:.1f}x"
    )


if __name__ == "__main__":
    main()
