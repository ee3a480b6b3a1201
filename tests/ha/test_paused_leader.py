"""[epoch-fencing] [ha-step-down] The paused leader, with real processes: nothing runs twice.

A real etcd, two Edges with ``ha:`` (TTL 2 s), one Node registered with both
(``edge_urls``, two providers of capacity 2), each provider in front of an independent
counting backend (:mod:`tests.system.backend`, the whole-system check's witness: each
request's marker, arrival and end), judged by :mod:`tests.system.checker`. Clients send requests with a unique marker each, first to the
leader, and try again -- the same marker -- at the other Edge on a 503, a broken
connection or a timeout, as behind a load balancer. With runs in flight and
requests queued on the leader, it is SIGSTOPped past its TTL, the standby takes
over, and the leader is SIGCONTed 3.5 s after the pause, with its queued
requests (some its clients gave up on and sent to the new leader), before its
election task has run. Twice: with the node's heartbeat at 5 s it still holds
the paused Edge's connection when that Edge wakes (runs' answers wait in its
sockets, runs end, queued requests are granted); at 1 s it dropped it during
the pause (the woken Edge's runs were cut: their retries are asked, and the
node dials it again).

Checked: no request whose run did not reach the backend in the paused leader's
term is executed twice, and none at all is executed twice once the new leader
leads (the woken leader sends nothing); each provider's concurrency at the backend never passes its
capacity; the woken leader answers ``503 not_leader`` (``leader_stepped_down``
for a request whose run it had sent; never ``overloaded``),
naming the new leader once it knows it; no run of the woken leader was refused
``stale_epoch`` (it sent none). Bounded in count (``REQUESTS``) and time
(``fail_after``); every wait is for a condition.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from tests.e2e.harness import BIG, EDGE_READY, NODE_REGISTERED, Daemon, Stack, drained, open_stack, write_config
from tests.system.checker import Execution, at_most_once, read_executions, within_capacity
from tests.system.cluster import BACKEND_READY

from .etcd_server import EtcdServer
from .test_chaos_failover import RunningEdge, until_ready

pytestmark = pytest.mark.req("epoch-fencing", "ha-step-down")

PROVIDERS = {"gpu0": 2, "gpu1": 2}
"""Capacity per provider, at the Edges and at the Node."""
LATENCY_MS = 400
WORKERS = 8
"""More clients than slots: some requests wait in the leader's queue at the pause."""
REQUESTS = 48
PAUSE_AFTER = 8
"""200s served before the pause."""
PAUSE_S = 3.5
"""SIGSTOP to SIGCONT: past the TTL (2 s); the standby leads at about +2 s."""
IMPATIENT_S = 2.5
"""Half the clients give up on an attempt at edge-a after this long and try the other Edge (their requests
are still in the paused leader when it wakes); the other half are still waiting when it wakes."""
PATIENT_S = 60.0
ATTEMPTS = 200
TTL_S = 2


@attrs.define
class History:
    """What the clients saw."""

    ok: dict[str, str] = attrs.field(factory=dict)
    """marker -> the Edge whose 200 answered it."""
    refusals: list[tuple[str, int, str]] = attrs.field(factory=list)
    """(Edge, status, error code) of every answer but a 200."""
    from_woken: list[tuple[int, str]] = attrs.field(factory=list)
    """(status, error code) of the answers the old leader gave after it woke."""
    woke: bool = False


async def start_backends(stack: Stack) -> dict[str, int]:
    """One counting backend per provider, logging to ``backend-<provider>.log``; their ports."""
    ports = {}
    for provider in PROVIDERS:
        log = stack.directory / f"backend-{provider}.log"
        argv = ["-m", "tests.system.backend", "--label", provider, "--log", str(log), "--latency-ms", str(LATENCY_MS)]
        daemon = await stack.spawn(f"backend-{provider}", argv)
        ports[provider] = int((await daemon.wait_for_line(BACKEND_READY))[1])
    return ports


def executions(stack: Stack) -> list[Execution]:
    return read_executions(stack.directory / f"backend-{provider}.log" for provider in PROVIDERS)


async def start_edge(stack: Stack, etcd: EtcdServer, name: str, heartbeat_ms: int) -> RunningEdge:
    """An Edge with ``ha:``; its nodes heartbeat every ``heartbeat_ms`` (a third of its heartbeat timeout)."""
    ha = {"endpoints": [etcd.url], "advertise": name, "ttl_s": TTL_S, "poll_interval_ms": 50}
    config = {
        "listen": "127.0.0.1:0",
        "node_listen": "127.0.0.1:0",
        "heartbeat_timeout_ms": 3 * heartbeat_ms,
        "provider_pool": {"max_queue": 64, "queue_timeout_ms": 30_000},
        "nodes": [
            {"id": "node-a", "token": "t", "providers": [{"id": p, "capacity": c} for p, c in PROVIDERS.items()]}
        ],
        "models": [
            {"id": BIG, "candidates": [{"node": "node-a", "provider": p, "upstream_model": "m"} for p in PROVIDERS]}
        ],
        "ha": ha,
    }
    daemon = await stack.spawn(
        name, ["-m", "iop_edge", "--config", str(write_config(stack.directory / f"{name}.yaml", config))]
    )
    match = await daemon.wait_for_line(EDGE_READY)
    return RunningEdge(name, daemon, int(match[1]), int(match[2]))


async def start_node(stack: Stack, ports: dict[str, int], heartbeat_ms: int, *edges: RunningEdge) -> Daemon:
    """A Node on every Edge's node socket, dropping a silent one after 1 to 1.25 ``heartbeat_ms``."""
    config = {
        "node_id": "node-a",
        "token": "t",
        "heartbeat_interval_ms": heartbeat_ms,
        "runtime": {"concurrency": 16},
        "reconnect": {"initial_ms": 50, "max_ms": 500},
        "edge_urls": [f"ws://127.0.0.1:{edge.node_port}" for edge in edges],
        "providers": [
            {"id": p, "adapter": "openai", "capacity": c, "base_url": f"http://127.0.0.1:{ports[p]}/v1"}
            for p, c in PROVIDERS.items()
        ],
    }
    node = await stack.spawn(
        "node", ["-m", "iop_node", "--config", str(write_config(stack.directory / "node.yaml", config))]
    )
    await node.wait_for_line(NODE_REGISTERED, count=len(edges))
    return node


def code_of(answer: httpx.Response) -> str:
    try:
        return str(answer.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


async def load(http: httpx.AsyncClient, a: RunningEdge, b: RunningEdge, history: History, paused: trio.Event) -> None:
    """``REQUESTS`` requests by ``WORKERS`` clients, each answered 200 in the end; ``paused`` is set
    once ``PAUSE_AFTER`` have been served (the test pauses the leader then)."""
    markers = iter(range(REQUESTS))

    async def one_request(worker: int, marker: str) -> None:
        body = {"model": BIG, "max_tokens": 4, "messages": [{"role": "user", "content": marker}]}
        for attempt in range(ATTEMPTS):
            edge = (a, b)[(worker + attempt) % 2] if attempt else a
            woken = edge is a and history.woke
            try:
                timeout = IMPATIENT_S if edge is a and worker % 2 else PATIENT_S
                answer = await http.post(f"{edge.url}/v1/chat/completions", json=body, timeout=timeout)
            except httpx.TransportError:
                pass  # refused, cut, or timed out on the paused leader: the other Edge next
            else:
                if woken:
                    history.from_woken.append((answer.status_code, code_of(answer)))
                if answer.status_code == 200:
                    history.ok[marker] = edge.name
                    if len(history.ok) == PAUSE_AFTER:
                        paused.set()
                    return
                history.refusals.append((edge.name, answer.status_code, code_of(answer)))
            await trio.sleep(0.05)  # the client's backoff before it tries the other Edge
        raise AssertionError(f"request {marker} not served in {ATTEMPTS} attempts")

    async def worker(index: int) -> None:
        for marker in markers:
            await one_request(index, f"request {marker}")

    async with trio.open_nursery() as nursery:
        for index in range(WORKERS):
            nursery.start_soon(worker, index)


@pytest.mark.parametrize(
    "heartbeat_ms",
    [
        pytest.param(5000, id="the-node-keeps-its-connection"),  # woken: runs end, queued requests are granted
        pytest.param(1000, id="the-node-drops-the-paused-edge"),  # woken: its runs were cut, retries are asked
    ],
)
async def test_a_leader_paused_past_its_ttl_runs_nothing_twice_and_answers_not_leader_when_it_wakes(
    etcd: EtcdServer, tmp_path: Path, heartbeat_ms: int
) -> None:
    with trio.fail_after(180):
        async with open_stack(tmp_path) as stack:
            http = stack.http
            ports = await start_backends(stack)
            a = await start_edge(stack, etcd, "edge-a", heartbeat_ms)
            await until_ready(http, a, 200)
            b = await start_edge(stack, etcd, "edge-b", heartbeat_ms)
            await until_ready(http, b, 503)
            await start_node(stack, ports, heartbeat_ms, a, b)

            history = History()
            paused = trio.Event()
            seen: dict[str, object] = {}

            async def pause_the_leader() -> None:
                await paused.wait()
                while True:  # runs in flight on both providers and requests queued on a
                    status = (await http.get(f"{a.url}/status")).json()
                    if status["queue_depth"] >= 1 and sum(p["in_flight"] for p in status["providers"]) == 4:
                        break
                    await trio.sleep(0.01)
                a.daemon.sigstop()
                stopped_at = time.monotonic()
                # Until b leads (a's lease expires in etcd, at least 1.3 s from now) only what a sent
                # before it stopped can reach the backend: the runs of its term, however slow the box.
                await until_ready(http, b, 200)
                seen["b leads"] = time.monotonic()  # the backends' clock: the system's monotonic one
                await trio.sleep(max(0.0, PAUSE_S - (time.monotonic() - stopped_at)))
                history.woke = True
                a.daemon.sigcont()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pause_the_leader)
                await load(http, a, b, history, paused)

            # The woken leader is a standby: 503 not_leader, naming edge-b once it has read the key.
            await until_ready(http, a, 503)
            while (await http.get(f"{a.url}/status")).json()["ha"]["leader"] != "edge-b":
                await trio.sleep(0.05)
            refused = await http.post(
                f"{a.url}/v1/chat/completions", json={"model": BIG, "messages": [{"role": "user", "content": "x"}]}
            )
            assert (refused.status_code, code_of(refused)) == (503, "not_leader"), refused.text
            assert refused.headers["x-iop-leader"] == "edge-b"

            # Every lease ended on both Edges (a cut run ends as its node closes it) and every 200 logged.
            for edge in (a, b):
                while not drained((await http.get(f"{edge.url}/status")).json()):
                    await trio.sleep(0.05)
            assert len(history.ok) == REQUESTS, history
            while not set(history.ok) <= {e.marker for e in executions(stack)}:  # logged after the answer
                await trio.sleep(0.05)
            ran = executions(stack)
            b_leads = seen["b leads"]
            assert isinstance(b_leads, float)

            # Since b leads, every request ran at most once: the woken leader sent nothing.
            assert at_most_once(e for e in ran if e.arrival > b_leads) == [], history
            # A request that had not reached a backend in a's term ran exactly once in all (one a's
            # term ran may run again at b: its client gave up on the paused a and tried b).
            in_a_term = {e.marker for e in ran if e.arrival <= b_leads}
            runs = Counter(e.marker for e in ran)
            assert all(runs[m] == 1 or (m in in_a_term and runs[m] == 2) for m in history.ok), runs
            # Every provider within its capacity at its backend, at every instant.
            assert within_capacity(ran, PROVIDERS) == []
            # The woken leader answered 503 not_leader (leader_stepped_down for a request whose run it had
            # sent), never overloaded; it sent no run a node refused stale.
            assert history.from_woken, history
            assert all(status in (200, 503) for status, _ in history.from_woken), history.from_woken
            refusals = {code for status, code in history.from_woken if status == 503}
            assert refusals <= {"not_leader", "leader_stepped_down"}, history.from_woken
            metrics = (await http.get(f"{a.url}/metrics")).text
            assert "iop_ha_stale_epoch_refused_total 0.0" in metrics
            assert "iop_ha_step_downs_total 1.0" in metrics
