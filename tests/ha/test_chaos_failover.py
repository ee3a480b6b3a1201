"""[warm-standby] Chaos with real processes: SIGKILL the leading Edge under load, SIGSTOP
it past its TTL, kill etcd under load, restart a standby under load.

One etcd, two Edges with ``ha:``, one Node registered with both (``edge_urls``)
in front of the mock backend. Clients send a bounded number of requests to
whichever Edge answers (the leader; a standby's 503 or a dead Edge sends them to
the other). The fault strikes once a few have been served. Bounded in count
(``REQUESTS``) and time (``fail_after``); every process is reaped at the end.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from tests.e2e.harness import (
    BIG,
    EDGE_READY,
    NODE_REGISTERED,
    Daemon,
    Stack,
    drained,
    edge_config,
    node_config,
    open_stack,
    write_config,
)

from .etcd_server import EtcdServer

pytestmark = pytest.mark.req("warm-standby")

CAPACITY = 2
"""gpu0's capacity, at the Edge and at the Node."""
WORKERS = 3
REQUESTS = 24
"""Requests in all, each retried on the other Edge until it is answered 200."""
KILL_AFTER = 6
"""200s served before the leader is killed."""
ATTEMPTS = 200
"""Attempts per request at most (a failover is a few seconds of 50 ms retries)."""
ETCD_REQUESTS = 80
"""Requests of the etcd-kill test: the leader serves some 25 until it steps down, the rest wait out etcd's outage."""
STANDBY_REQUESTS = 120
"""Requests of the standby-restart test: they outlast the restart (about 20/s at capacity 2)."""
TTL_S = 2
"""The Edges' etcd lease TTL."""


@attrs.define(eq=False)
class RunningEdge:
    name: str
    daemon: Daemon
    http_port: int
    node_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@attrs.define
class Tally:
    ok: int = 0
    ok_by_edge: dict[str, int] = attrs.field(factory=dict)
    cut: int = 0
    """Attempts whose connection broke after the request was sent: each may have reached the backend."""
    refused: int = 0
    """503s and refused connections: none reached the backend."""
    other: int = 0
    done: int = 0


async def start_edge(
    stack: Stack, etcd: EtcdServer, name: str, *, capacity: int = CAPACITY, ports: tuple[int, int] | None = None
) -> RunningEdge:
    """An Edge with ``ha:`` (TTL 2 s); ``ports`` (API, node socket): listen there again after a restart."""
    ha = {"endpoints": [etcd.url], "advertise": name, "ttl_s": TTL_S, "poll_interval_ms": 50}
    config = edge_config(providers={"gpu0": capacity}, ha=ha)
    if ports is not None:
        config["listen"], config["node_listen"] = (f"127.0.0.1:{port}" for port in ports)
    path = write_config(stack.directory / f"{name}.yaml", config)
    daemon = await stack.spawn(name, ["-m", "iop_edge", "--config", str(path)])
    match = await daemon.wait_for_line(EDGE_READY)
    return RunningEdge(name, daemon, int(match[1]), int(match[2]))


async def ready(http: httpx.AsyncClient, edge: RunningEdge) -> int:
    return (await http.get(f"{edge.url}/readyz")).status_code


async def until_ready(http: httpx.AsyncClient, edge: RunningEdge, status: int) -> None:
    while await ready(http, edge) != status:  # bounded by the test's fail_after
        await trio.sleep(0.05)


async def test_sigkill_of_the_leader_under_load_the_standby_serves_without_a_new_registration(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    with trio.fail_after(300):  # a bound for a hang, not a budget: a busy machine is slow
        async with open_stack(tmp_path) as stack:
            a, b, node = await leader_and_standby(stack, etcd, latency_ms=100)

            killed = trio.Event()

            async def kill_the_leader() -> None:
                a.daemon.kill()
                killed.set()

            tally = await load(stack, [a, b], kill_the_leader, attempts=600)  # the failover may be slow

            assert killed.is_set()
            assert tally.ok == REQUESTS
            assert tally.ok_by_edge.get("edge-b", 0) >= 1, tally
            assert await ready(stack.http, b) == 200
            # b served over the registration it held while standing by: the node dialled it once.
            assert node.stderr().count(f"connecting to ws://127.0.0.1:{b.node_port}") == 1
            stats = await stack.backend_stats()
            assert stats["peak_in_flight"] <= CAPACITY, stats
            # Nothing executed twice: every 200 is one backend request, plus at most one per cut attempt.
            assert tally.ok <= stats["total"] <= tally.ok + tally.cut + tally.other, (stats, tally)
            assert stats["repeated"] == 0, stats  # no attempt ran twice at the backend
            # No lease leaks on the survivor.
            while not drained((await stack.http.get(f"{b.url}/status")).json()):
                await trio.sleep(0.05)


async def leader_and_standby(
    stack: Stack, etcd: EtcdServer, *, latency_ms: int, capacity: int = CAPACITY
) -> tuple[RunningEdge, RunningEdge, Daemon]:
    """The mock backend, edge-a leading, edge-b standing by, and a Node registered with both."""
    await stack.start_backend(latency_ms=latency_ms, track_repeats=True)
    a = await start_edge(stack, etcd, "edge-a", capacity=capacity)
    await until_ready(stack.http, a, 200)
    b = await start_edge(stack, etcd, "edge-b", capacity=capacity)
    await until_ready(stack.http, b, 503)
    return a, b, await start_node(stack, a, b, capacity=capacity)


async def start_node(stack: Stack, *edges: RunningEdge, capacity: int) -> Daemon:
    """A Node registered with every Edge of ``edges`` (``edge_urls``), heartbeat 1 s."""
    config = node_config(providers={"gpu0": capacity}, heartbeat_interval_ms=1000)
    config["edge_urls"] = [f"ws://127.0.0.1:{edge.node_port}" for edge in edges]
    config["providers"] = [{**p, "base_url": f"http://127.0.0.1:{stack.backend_port}/v1"} for p in config["providers"]]
    node = await stack.spawn(
        "node", ["-m", "iop_node", "--config", str(write_config(stack.directory / "node.yaml", config))]
    )
    await node.wait_for_line(NODE_REGISTERED, count=len(edges))
    return node


@pytest.mark.req("epoch-fencing")
async def test_a_leader_paused_past_its_ttl_dispatches_nothing_when_it_wakes(etcd: EtcdServer, tmp_path: Path) -> None:
    """SIGSTOP the leader with one request running and two queued, past its TTL; the standby leads and
    serves; SIGCONT: the old leader's queued requests fail, and no run of its epoch reaches the backend
    after the new leader's first grant."""
    with trio.fail_after(120):
        async with open_stack(tmp_path) as stack:
            a, b, _ = await leader_and_standby(stack, etcd, latency_ms=400, capacity=1)

            body = {"model": BIG, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            old_answers: list[int | str] = []

            async def to_a() -> None:
                try:
                    answer = await stack.http.post(f"{a.url}/v1/chat/completions", json=body, timeout=60)
                except httpx.TransportError as exc:
                    old_answers.append(type(exc).__name__)
                else:
                    old_answers.append(answer.status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(to_a)
                while (await stack.backend_stats())["in_flight"] < 1:  # one runs, two wait in a's queue
                    await trio.sleep(0.02)
                a.daemon.sigstop()
                await until_ready(stack.http, b, 200)  # b won: a's lease expired in etcd
                served = await stack.http.post(f"{b.url}/v1/chat/completions", json=body)
                assert served.status_code == 200, served.text
                after_first_grant = (await stack.backend_stats())["total"]
                a.daemon.sigcont()
            # The run under way at the pause ran in its own term and may still be answered (its answer was
            # in a's socket when a woke); the two queued behind it must not run.
            assert len(old_answers) == 3 and old_answers.count(200) <= 1, old_answers
            # Zero runs of the old epoch executed after the new leader's first grant.
            while (await stack.backend_stats())["in_flight"]:
                await trio.sleep(0.02)
            stats = await stack.backend_stats()
            assert stats["total"] == after_first_grant, stats
            assert stats["peak_in_flight"] <= 1, stats
            assert await ready(stack.http, a) == 503  # a woke as a standby


BODY = {"model": BIG, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
ATTEMPT_IDS = itertools.count()
"""Each attempt's prompt is unique, so the backend's ``repeated`` count is what ran twice."""


async def load(
    stack: Stack,
    edges: list[RunningEdge],
    fault: Callable[[], Awaitable[None]],
    *,
    attempts: int = ATTEMPTS,
    fault_after: int = KILL_AFTER,
    requests: int = REQUESTS,
    tally: Tally | None = None,
) -> Tally:
    """``requests`` requests by ``WORKERS`` clients, each tried at the Edges in turn until answered 200;
    ``fault`` runs (in its own task, once) when ``fault_after`` have been served, and the load goes on."""
    tally = Tally() if tally is None else tally
    async with trio.open_nursery() as nursery:

        async def one_request(worker: int) -> None:
            for attempt in range(attempts):
                edge = edges[(worker + attempt) % len(edges)] if attempt else edges[0]
                body = {**BODY, "messages": [{"role": "user", "content": f"attempt {next(ATTEMPT_IDS)}"}]}
                try:
                    answer = await stack.http.post(f"{edge.url}/v1/chat/completions", json=body)
                except httpx.ConnectError:
                    tally.refused += 1
                except httpx.TransportError:
                    tally.cut += 1
                else:
                    if answer.status_code == 200:
                        tally.ok += 1
                        tally.ok_by_edge[edge.name] = tally.ok_by_edge.get(edge.name, 0) + 1
                        if tally.ok == fault_after:
                            nursery.start_soon(fault)
                        return
                    if answer.status_code == 503:
                        tally.refused += 1
                    else:
                        tally.other += 1
                await trio.sleep(0.05)  # the client's own backoff before it tries the other Edge
            raise AssertionError(f"request not served in {attempts} attempts: {tally}")

        async def worker(index: int) -> None:
            while tally.done < requests:
                tally.done += 1
                await one_request(index)

        for index in range(WORKERS):
            nursery.start_soon(worker, index)
    return tally


async def ha_status(http: httpx.AsyncClient, edge: RunningEdge) -> dict[str, object]:
    block: dict[str, object] = (await http.get(f"{edge.url}/status")).json()["ha"]
    return block


async def until_drained(http: httpx.AsyncClient, *edges: RunningEdge) -> None:
    """No lease and no waiter left on any of ``edges`` (bounded by the test's fail_after)."""
    for edge in edges:
        while not drained((await http.get(f"{edge.url}/status")).json()):
            await trio.sleep(0.05)


@pytest.mark.req("ha-step-down")
async def test_etcd_killed_under_load_the_leader_steps_down_standbys_wait_service_resumes_when_it_returns(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """SIGKILL etcd under load: the leader steps down within its TTL (counted from the kill), no standby
    takes over while etcd is gone, every Edge refuses; etcd restarted on the same port and data dir, an
    Edge leads again and the load completes. The backend never passes capacity, nothing runs twice."""
    with trio.fail_after(50):
        async with open_stack(tmp_path) as stack:
            a, b, _ = await leader_and_standby(stack, etcd, latency_ms=100)
            seen: dict[str, object] = {}

            async def kill_etcd_then_restart() -> None:
                await trio.to_thread.run_sync(etcd.stop)  # SIGKILL, reaped (bounded wait)
                killed_at = time.time()
                await until_ready(stack.http, a, 503)
                seen["a"] = await ha_status(stack.http, a)
                seen["killed_at"] = killed_at
                served = (await stack.backend_stats())["total"]
                # A TTL and more with etcd gone: the standby never took over, nothing was dispatched.
                await trio.sleep(TTL_S + 0.5)
                seen["b"] = await ha_status(stack.http, b)
                seen["b_ready"] = await ready(stack.http, b)
                seen["dispatched while etcd was gone"] = (await stack.backend_stats())["total"] - served
                await trio.to_thread.run_sync(etcd.start)  # same ports, same data dir; bounded start
                seen["served before the restart"] = tally.ok

            tally = Tally()
            # Enough requests that some wait out the outage (the leader serves up to its step-down).
            await load(stack, [a, b], kill_etcd_then_restart, attempts=600, requests=ETCD_REQUESTS, tally=tally)

            served_before = seen["served before the restart"]
            assert isinstance(served_before, int) and served_before < ETCD_REQUESTS, seen  # service resumed
            step_down = seen["a"]
            assert isinstance(step_down, dict) and step_down["role"] == "standby" and step_down["step_downs"] == 1
            since, killed_at = step_down["since"], seen["killed_at"]
            assert isinstance(since, float) and isinstance(killed_at, float)
            assert since - killed_at <= TTL_S, seen  # the contract: stepped down before its lease could expire
            standby = seen["b"]
            assert isinstance(standby, dict) and standby["role"] == "standby" and standby["elections_won"] == 0, seen
            assert seen["b_ready"] == 503 and seen["dispatched while etcd was gone"] == 0, seen
            assert tally.ok == ETCD_REQUESTS, tally
            stats = await stack.backend_stats()
            assert stats["peak_in_flight"] <= CAPACITY, stats
            # Nothing executed twice: past the 200s, the backend saw only the runs the step-down cut
            # (at most a capacity's worth, answered 503) and attempts whose connection broke.
            assert tally.ok <= stats["total"] <= tally.ok + CAPACITY + tally.cut, (stats, tally)
            assert stats["repeated"] == 0, stats  # no attempt ran twice at the backend
            await until_drained(stack.http, a, b)


@pytest.mark.req("warm-standby")
async def test_a_standby_restarted_under_load_has_no_effect_on_service(etcd: EtcdServer, tmp_path: Path) -> None:
    """SIGKILL the standby under load and start it again on its ports: every request is served by the
    leader at the first attempt, the node registers with the new standby, which stands by."""
    with trio.fail_after(50):
        async with open_stack(tmp_path) as stack:
            a, b, node = await leader_and_standby(stack, etcd, latency_ms=100)
            restarted: list[RunningEdge] = []

            async def restart_standby() -> None:
                b.daemon.kill()
                await b.daemon.wait()
                again = await start_edge(stack, etcd, "edge-b", ports=(b.http_port, b.node_port))
                await node.wait_for_line(NODE_REGISTERED, count=3)  # a, b, and b again
                restarted.append(again)
                served_at_restart.append(tally.ok)

            served_at_restart: list[int] = []
            tally = Tally()
            await load(stack, [a], restart_standby, fault_after=4, requests=STANDBY_REQUESTS, tally=tally)
            again = restarted[0]
            assert served_at_restart[0] < STANDBY_REQUESTS, "the restart was not under load"
            assert tally.ok == tally.ok_by_edge["edge-a"] == STANDBY_REQUESTS, tally
            assert tally.refused == tally.cut == tally.other == 0, tally  # no effect on service
            assert await ready(stack.http, again) == 503
            status = await ha_status(stack.http, again)
            assert status["role"] == "standby" and status["leader"] == "edge-a", status
            stats = await stack.backend_stats()
            assert stats["peak_in_flight"] <= CAPACITY, stats
            assert stats["total"] == tally.ok, (stats, tally)  # nothing executed twice, nothing cut
            assert stats["repeated"] == 0, stats
            await until_drained(stack.http, a, again)
