"""[warm-standby] Chaos with real processes: SIGKILL the leading Edge under load.

One etcd, two Edges with ``ha:``, one Node registered with both (``edge_urls``)
in front of the mock backend. Clients send a bounded number of requests to
whichever Edge answers (the leader; a standby's 503 or a dead Edge sends them to
the other). The leader is killed once a few have been served. Bounded in count
(``REQUESTS``) and time (``fail_after``); every process is reaped at the end.
"""

from __future__ import annotations

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


async def start_edge(stack: Stack, etcd: EtcdServer, name: str, *, capacity: int = CAPACITY) -> RunningEdge:
    ha = {"endpoints": [etcd.url], "advertise": name, "ttl_s": 2, "poll_interval_ms": 50}
    path = write_config(stack.directory / f"{name}.yaml", edge_config(providers={"gpu0": capacity}, ha=ha))
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
    with trio.fail_after(120):
        async with open_stack(tmp_path) as stack:
            await stack.start_backend(latency_ms=100)
            a = await start_edge(stack, etcd, "edge-a")
            await until_ready(stack.http, a, 200)
            b = await start_edge(stack, etcd, "edge-b")
            await until_ready(stack.http, b, 503)

            node = await start_node(stack, a, b, capacity=CAPACITY)

            tally = Tally()
            killed = trio.Event()
            edges = [a, b]

            async def one_request(worker: int) -> None:
                for attempt in range(ATTEMPTS):
                    edge = edges[(worker + attempt) % 2] if attempt else edges[0]
                    try:
                        answer = await stack.http.post(
                            f"{edge.url}/v1/chat/completions",
                            json={"model": BIG, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                        )
                    except httpx.ConnectError:
                        tally.refused += 1
                    except httpx.TransportError:
                        tally.cut += 1
                    else:
                        if answer.status_code == 200:
                            tally.ok += 1
                            tally.ok_by_edge[edge.name] = tally.ok_by_edge.get(edge.name, 0) + 1
                            if tally.ok >= KILL_AFTER and not killed.is_set():
                                a.daemon.kill()
                                killed.set()
                            return
                        if answer.status_code == 503:
                            tally.refused += 1
                        else:
                            tally.other += 1
                    await trio.sleep(0.05)  # the client's own backoff before it tries the other Edge
                raise AssertionError(f"request not served in {ATTEMPTS} attempts: {tally}")

            async def worker(index: int) -> None:
                while tally.done < REQUESTS:
                    tally.done += 1
                    await one_request(index)

            async with trio.open_nursery() as nursery:
                for index in range(WORKERS):
                    nursery.start_soon(worker, index)

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
            # No lease leaks on the survivor.
            while not drained((await stack.http.get(f"{b.url}/status")).json()):
                await trio.sleep(0.05)


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
            await stack.start_backend(latency_ms=400)
            a = await start_edge(stack, etcd, "edge-a", capacity=1)
            await until_ready(stack.http, a, 200)
            b = await start_edge(stack, etcd, "edge-b", capacity=1)
            await until_ready(stack.http, b, 503)
            await start_node(stack, a, b, capacity=1)

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
