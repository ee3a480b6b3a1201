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
(``x-iop-queue-ms``) in both runs, the mean service time and its 429s. (3) Token mode
(``tenant_cost: tokens``): a tenant of 8,000-token requests (whole answers) and one of 500-token
requests (streamed with ``include_usage``) at equal weight flood until a million tokens were served
(``--full``; 200,000 otherwise); served tokens of each (the usage the answers reported) and, once
every client stopped, the Edge's ``cost_charged`` against those reported tokens. The mock counts a
prompt token per 5 characters, the Edge reserves one per 4: settlement has 25 % to correct.
(4) Decision cost: 10,000 closed-loop clients (2,000 without ``--full``), each on its own
connection, keep about that many requests waiting on the capacity-4 provider; the Edge's CPU per
request served with no tenants configured and with 1,000 tenants (client ``i`` uses tenant
``i % 1000``'s key), alternated in the same run, next to the in-process trio lease cycle.
``--parts tokens,decision`` runs some of the four.
"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys
import time
from typing import Any

import trio

from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, FairShare, Granted
from iop_edge.config import load_edge_config

from .harness import (
    BenchmarkFailed,
    Daemon,
    HttpConnection,
    Relay,
    get_json,
    percentile,
    run_suite,
    start_relay,
)


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
provider_pool: {{max_queue: {max_queue}, queue_timeout_ms: 600000}}
overload: {{shed_loop_lag_ms: 600000, max_connections: {connections}, shed_connections: {connections}}}
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
    return "tenants:\n" + "\n".join(f"  - {t}" for t in tenants)


async def _relay(
    workdir: pathlib.Path,
    daemons: list[Daemon],
    tenants: str,
    *,
    latency_ms: int = SERVICE_MS,
    max_queue: int = 256,
    connections: int = 8192,
    mock_args: tuple[str, ...] = (),
) -> Relay:
    """The mock backend (``latency_ms`` a request), an Edge with ``tenants`` (YAML lines, or "" for
    none) and the Node; the Edge's queue holds ``max_queue`` and its listener ``connections``."""
    return await start_relay(
        workdir,
        daemons,
        mock_args=["--latency-ms", str(latency_ms), "--tokens-per-second", "0", *mock_args],
        edge_yaml=EDGE_YAML.format(tenants=tenants, max_queue=max_queue, connections=connections),
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


# token mode through real processes

TOKEN_SERVICE_MS = 20
"""The mock's latency in the token-mode run (short, so a million tokens pass in seconds)."""
PROMPT_CHARS_PER_TOKEN = 5
"""The mock counts a prompt token per 5 characters; the Edge reserves one per 4 (a 25 % over-estimate
that settlement corrects)."""
MAX_TOKENS = 16
TOKEN_TENANTS = {"big": 8_000, "small": 500}
"""Tokens each request of the tenant uses (prompt + ``max_tokens``) as the backend reports them."""
_USAGE = re.compile(rb'"total_tokens"\s*:\s*([0-9]+)')


def token_body(used: int, *, stream: bool) -> bytes:
    """A chat request the mock reports ``used`` tokens for (prompt + :data:`MAX_TOKENS`)."""
    prompt = "x" * ((used - MAX_TOKENS) * PROMPT_CHARS_PER_TOKEN)
    body: dict[str, Any] = {"model": "mock", "messages": [{"role": "user", "content": prompt}]}
    body["max_tokens"] = MAX_TOKENS
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


def reported_tokens(answer: bytes) -> int:
    """The last ``usage.total_tokens`` in an answer (a JSON body, or an SSE stream's usage chunk)."""
    found = list(_USAGE.finditer(answer))
    if not found:
        raise BenchmarkFailed(f"no usage in the answer: {answer[-200:]!r}")
    return int(found[-1].group(1))


async def _token_flood(
    port: int,
    key: str,
    body: bytes,
    clients: int,
    stop: trio.Event,
    done: list[tuple[float, int]],
    counts: dict[str, int],
) -> None:
    """``clients`` closed-loop clients sending ``body`` as ``key``; each answer's (time, reported tokens) into ``done``."""
    raw = HttpConnection.build("POST", "/v1/chat/completions", body, headers={"authorization": f"Bearer {key}"})

    async def client() -> None:
        connection = HttpConnection("127.0.0.1", port)
        try:
            while not stop.is_set():
                status, answer = await connection.request(raw)
                counts[str(status)] = counts.get(str(status), 0) + 1
                if status != 200:
                    await trio.sleep(0.05)
                    continue
                done.append((time.perf_counter(), reported_tokens(answer)))
        finally:
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)


async def _tenant_rows(port: int) -> dict[str, dict[str, Any]]:
    poller = HttpConnection("127.0.0.1", port)
    try:
        status = await get_json(poller, "/status")
    finally:
        await poller.aclose()
    return {t["name"]: t for t in status["tenants"]}


async def real_tokens(workdir: pathlib.Path, total: int) -> dict[str, Any]:
    """``tenant_cost: tokens``: tenant big (8,000-token requests, whole answers) and small (500-token
    requests, streamed with ``include_usage``), weight 1 each, 8 closed-loop clients each, until
    ``total`` tokens were served after a 1 s warm-up; then every client stops after its answer and
    the Edge's ``cost_charged`` is compared with the tokens the answers reported."""
    tenants = _tenant_lines("{name: big, api_keys: [key-big]}", "{name: small, api_keys: [key-small]}")
    daemons: list[Daemon] = []
    try:
        relay = await _relay(
            workdir,
            daemons,
            "tenant_cost: tokens\n" + tenants,
            latency_ms=TOKEN_SERVICE_MS,
            mock_args=("--prompt-chars-per-token", str(PROMPT_CHARS_PER_TOKEN)),
        )
        stop = trio.Event()
        done: dict[str, list[tuple[float, int]]] = {name: [] for name in TOKEN_TENANTS}
        counts: dict[str, dict[str, int]] = {name: {} for name in TOKEN_TENANTS}
        async with trio.open_nursery() as nursery:
            for name, used in TOKEN_TENANTS.items():
                body = token_body(used, stream=name == "small")
                nursery.start_soon(
                    _token_flood, relay.http_port, f"key-{name}", body, 8, stop, done[name], counts[name]
                )
            await trio.sleep(1.0)  # both backlogged
            start = time.perf_counter()
            while True:
                await trio.sleep(0.1)
                served = {n: sum(t for at, t in d if at >= start) for n, d in done.items()}
                if sum(served.values()) >= total:
                    break
            seconds = time.perf_counter() - start
            stop.set()
        rows = await _tenant_rows(relay.http_port)
        while any(rows[n]["in_flight"] or rows[n]["waiting"] for n in TOKEN_TENANTS):
            await trio.sleep(0.05)
            rows = await _tenant_rows(relay.http_port)
        big, small = served["big"], served["small"]
        return {
            "tokens_per_request": TOKEN_TENANTS,
            "reserve_per_request": {
                n: (u - MAX_TOKENS) * PROMPT_CHARS_PER_TOKEN // 4 + MAX_TOKENS for n, u in TOKEN_TENANTS.items()
            },
            "served_tokens": served,
            "served_requests": {n: sum(1 for at, _ in d if at >= start) for n, d in done.items()},
            "ratio_big_to_small": round(big / small, 4),
            "seconds": round(seconds, 1),
            "used_tokens_whole_run": {n: sum(t for _, t in d) for n, d in done.items()},
            "charged_tokens_after_settlement": {n: rows[n]["cost_charged"] for n in TOKEN_TENANTS},
            "answers": counts,
            "mock_latency_ms": TOKEN_SERVICE_MS,
        }
    finally:
        for daemon in daemons:
            daemon.stop()


# decision cost through real processes

DECISION_SERVICE_MS = 5
"""The mock's latency in the decision-cost run."""


async def _waiting_clients(
    port: int, clients: int, keys: int, cancel: trio.CancelScope, answers: dict[str, int], *, task_status: Any
) -> None:
    """``clients`` closed-loop clients, client ``i`` with key ``key-{i % keys}``, each opening its
    connection before the next starts (then ``task_status.started()``); runs until ``cancel``."""
    with cancel:
        async with trio.open_nursery() as nursery:

            async def client(index: int, *, task_status: Any) -> None:
                headers = {"authorization": f"Bearer key-{index % keys}"}
                raw = HttpConnection.build("POST", "/v1/chat/completions", CHAT, headers=headers)
                connection = HttpConnection("127.0.0.1", port)
                try:
                    await connection.connect()
                    task_status.started()
                    while True:
                        status, _ = await connection.request(raw)
                        answers[str(status)] = answers.get(str(status), 0) + 1
                        if status != 200:
                            await trio.sleep(1.0)
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        await connection.aclose()

            for index in range(clients):
                await nursery.start(client, index)
            task_status.started()


KEY_CHECKS_PER_REQUEST = 2
"""``EdgeConfig.accepts_api_key`` calls per request in the Edge today (a cProfile of the Edge in this
run's decision phase: 6,780 calls for 3,390 of ``tenant_of``); each hashes the key once and looks the
digest up."""


def key_check_seconds(edge_yaml: pathlib.Path, keys: int, requests: int = 2_000) -> float:
    """Seconds the Edge's API-key checks and tenant lookup (:data:`KEY_CHECKS_PER_REQUEST` times
    ``accepts_api_key`` and once ``tenant_of``, before admission)
    take for one request, in process, with ``edge_yaml``."""
    config = load_edge_config(edge_yaml)
    start = time.perf_counter()
    for n in range(requests):
        key = f"key-{n % keys}"
        if config.api_keys or config.tenants:
            for _ in range(KEY_CHECKS_PER_REQUEST):
                config.accepts_api_key(key)
        if config.tenants:
            config.tenant_of(key)
    return (time.perf_counter() - start) / requests


async def _decision_phase(workdir: pathlib.Path, tenants: int, waiters: int, window: float) -> dict[str, Any]:
    """Edge CPU per request served while ``waiters`` clients wait, over ``tenants`` tenants (0: none)."""
    lines = _tenant_lines(*(f"{{name: t{i}, api_keys: [key-{i}]}}" for i in range(tenants))) if tenants else ""
    daemons: list[Daemon] = []
    try:
        relay = await _relay(
            workdir,
            daemons,
            lines,
            latency_ms=DECISION_SERVICE_MS,
            max_queue=waiters + 1_000,
            connections=waiters + 2_000,
        )
        answers: dict[str, int] = {}
        cancel = trio.CancelScope()
        poller = HttpConnection("127.0.0.1", relay.http_port)
        async with trio.open_nursery() as nursery:
            await nursery.start(_waiting_clients, relay.http_port, waiters, max(1, tenants), cancel, answers)
            while (await get_json(poller, "/status"))["queue_depth"] < 0.95 * waiters:
                relay.edge.check_alive()
                await trio.sleep(0.5)
            served0, cpu0, node0, t0 = (
                answers.get("200", 0),
                relay.edge.cpu_seconds(),
                relay.node.cpu_seconds(),
                time.perf_counter(),
            )
            await trio.sleep(window)
            served1, cpu1, node1, t1 = (
                answers.get("200", 0),
                relay.edge.cpu_seconds(),
                relay.node.cpu_seconds(),
                time.perf_counter(),
            )
            depth = (await get_json(poller, "/status"))["queue_depth"]
            await poller.aclose()
            cancel.cancel()
        served = served1 - served0
        if served <= 0:
            raise BenchmarkFailed(f"no request served in {window} s with {waiters} waiters")
        key_check = key_check_seconds(workdir / "edge.yaml", max(1, tenants))
        return {
            "key_check_us_per_request": round(key_check * 1e6, 1),
            "tenants": tenants,
            "served": served,
            "requests_per_s": round(served / (t1 - t0), 1),
            "edge_cpu_us_per_request": round(1e6 * (cpu1 - cpu0) / served, 1),
            "node_cpu_us_per_request": round(1e6 * (node1 - node0) / served, 1),
            "queue_depth_at_end": depth,
            "answers": dict(answers),
        }
    finally:
        for daemon in daemons:
            daemon.stop()


async def real_decision(workdir: pathlib.Path, waiters: int, window: float, rounds: int) -> dict[str, Any]:
    """The Edge's CPU per lease cycle with ``waiters`` waiting clients: no tenants, then 1,000 tenants
    (alternated ``rounds`` times; the median of each), in the same run."""
    phases: dict[int, list[dict[str, Any]]] = {0: [], 1_000: []}
    for n in range(rounds):
        for tenants in phases:
            phase_dir = workdir / f"decision-{tenants}-{n}"
            phase_dir.mkdir()
            phases[tenants].append(await _decision_phase(phase_dir, tenants, waiters, window))
    cost = {t: statistics.median(p["edge_cpu_us_per_request"] for p in runs) for t, runs in phases.items()}
    keys = {t: statistics.median(p["key_check_us_per_request"] for p in runs) for t, runs in phases.items()}
    less = {t: cost[t] - keys[t] for t in phases}
    return {
        "edge_cpu_less_key_check_us_per_request": {str(t): round(c, 1) for t, c in less.items()},
        "ratio_less_key_check": round(less[1_000] / less[0], 3),
        "waiters": waiters,
        "window_s": window,
        "mock_latency_ms": DECISION_SERVICE_MS,
        "runs": {str(t): runs for t, runs in phases.items()},
        "edge_cpu_us_per_request": {str(t): c for t, c in cost.items()},
        "ratio_1000_tenants_vs_none": round(cost[1_000] / cost[0], 3),
    }


PARTS: tuple[str, ...] = ("share", "light", "tokens", "decision")
"""The parts of ``--real`` (``--parts a,b`` runs some)."""


def real(full: bool, parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    async def run(workdir: pathlib.Path) -> dict[str, Any]:
        result: dict[str, Any] = {}
        with trio.fail_after(1_200):
            for part in parts:
                (workdir / part).mkdir()
            if "share" in parts:
                result["share"] = await real_share(workdir / "share", 10_000 if full else 2_000)
            if "light" in parts:
                result["light"] = await real_light(workdir / "light", 20.0 if full else 8.0)
            if "tokens" in parts:
                result["tokens"] = await real_tokens(workdir / "tokens", 1_000_000 if full else 200_000)
            if "decision" in parts:
                waiters = 10_000 if full else 2_000
                result["decision"] = await real_decision(
                    workdir / "decision", waiters, 15.0 if full else 5.0, 2 if full else 1
                )
        return result

    result = run_suite("iop-fairness-", run, with_peers=False)
    if "decision" in parts:
        plain = statistics.median(lease_cycle(0) for _ in range(3))
        fair = statistics.median(lease_cycle(1_000) for _ in range(3))
        result["decision"]["in_process_lease_cycle_us"] = {"none": round(plain * 1e6, 1), "1000": round(fair * 1e6, 1)}
    command = "python -m benchmarks.fairness --real" + (" --full" if full else "")
    result["command"] = command + ("" if parts == PARTS else " --parts " + ",".join(parts))
    return result


def main() -> None:
    if "--real" in sys.argv:
        parts = PARTS
        if "--parts" in sys.argv:
            parts = tuple(sys.argv[sys.argv.index("--parts") + 1].split(","))
            if not set(parts) <= set(PARTS):
                sys.exit(f"--parts: choose among {','.join(PARTS)}")
        print(json.dumps(real("--full" in sys.argv, parts), indent=1))
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
