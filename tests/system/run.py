"""One schedule of the whole-system check, end to end: cluster up, clients and nemesis, then the checker.

Clients (``workers`` of them) send requests for ``length`` seconds, each attempt with a unique
marker, to the Edge that last answered them 200 (first the first Edge), and on anything else try
the next Edge after 50 ms, as a load balancer would; every attempt is recorded. Meanwhile the
nemesis strikes its seeded faults one at a time. Then every process is resumed, the cluster is
given :data:`SETTLE_S` to drain, and the history is checked: the checker's promises
(:mod:`.checker`), every leader stepped down within its TTL of its last renewal (:mod:`.terms`,
from the Edges' logs), and every Edge drained.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import trio
from tests.e2e.harness import open_stack
from tests.ha.etcd_server import EtcdServer

from .checker import Attempt, Loss, read_executions, violations
from .cluster import MODEL, TTL_S, Cluster
from .nemesis import KINDS, apply, schedule
from .terms import Stop, Term, stepped_down_in_time, terms_of

SETTLE_S = 20.0
"""Seconds the cluster has, after the load, to drain every Edge."""
ATTEMPT_TIMEOUT_S = 15.0


@attrs.define
class Result:
    seed: int
    faults: list[str]
    attempts: list[Attempt]
    executions: int
    violations: list[str]
    losses: list[Loss] = attrs.field(factory=list)
    stops: list[Stop] = attrs.field(factory=list)
    terms: list[Term] = attrs.field(factory=list)
    """Every leader term the Edges' logs show (the step-down check's material)."""

    @property
    def answered(self) -> int:
        return sum(1 for a in self.attempts if a.status == 200)


@attrs.define(eq=False)
class _Load:
    """The clients and the nemesis of one schedule, and what they recorded."""

    cluster: Cluster
    http: httpx.AsyncClient
    seed: int
    attempts: list[Attempt] = attrs.field(factory=list)
    losses: list[Loss] = attrs.field(factory=list)
    stops: list[Stop] = attrs.field(factory=list)
    faults: list[str] = attrs.field(factory=list)
    markers: Iterator[int] = attrs.field(factory=itertools.count)
    preferred: int = 0
    """The Edge that last answered 200: where a client goes first (a load balancer's choice)."""

    async def client(self, stop_at: float) -> None:
        turn = self.preferred
        while trio.current_time() < stop_at:
            edge = self.cluster.edges[turn % len(self.cluster.edges)]
            attempt = await _attempt(self.http, edge.name, edge.url, f"s{self.seed}-{next(self.markers)}")
            self.attempts.append(attempt)
            if attempt.status == 200:
                self.preferred = turn
            else:
                turn += 1
                await trio.sleep(0.05)

    async def nemesis(self, length: float, kinds: tuple[str, ...]) -> None:
        started = trio.current_time()
        for fault in schedule(self.seed, length, kinds):
            await trio.sleep_until(started + fault.at)
            self.faults.append(
                f"{fault.at:6.2f} s {await apply(fault, self.cluster, self.http, self.losses, self.stops)}"
            )


async def run_schedule(
    seed: int,
    directory: Path,
    *,
    length: float = 12.0,
    edges: int = 2,
    workers: int = 10,
    latency_ms: float = 400,
    kinds: tuple[str, ...] = KINDS,
) -> Result:
    """Run schedule ``seed`` in ``directory`` (its processes' logs and the executions stay there).

    Checkpoints. Every process is reaped on the way out, whatever happens.
    """
    etcd = EtcdServer(directory / "etcd-data")
    http = httpx.AsyncClient(timeout=ATTEMPT_TIMEOUT_S, limits=httpx.Limits(max_connections=64))
    async with open_stack(directory) as stack, http, trio.open_nursery() as services:
        cluster = Cluster(stack, etcd)
        load = _Load(cluster, http, seed)
        try:
            await cluster.start(edges, latency_ms, services)
            await _wait_for_a_leader(cluster, http)
            stop_at = trio.current_time() + length
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load.nemesis, length, kinds)
                for _ in range(workers):
                    nursery.start_soon(load.client, stop_at)
            cluster.resume_everything()
            left = await _settle(cluster, http)
        finally:
            cluster.resume_everything()
            with trio.CancelScope(shield=True):  # etcd is no child of the stack: stopped here, whatever happened
                await trio.to_thread.run_sync(etcd.stop)
            services.cancel_scope.cancel()
    executions = read_executions(cluster.backend_logs)
    found = violations(load.attempts, executions, cluster.capacity) + left
    terms = _terms(cluster)
    found += stepped_down_in_time(terms, load.stops, TTL_S)
    return Result(seed, load.faults, load.attempts, len(executions), found, load.losses, load.stops, terms)


async def _attempt(http: httpx.AsyncClient, edge: str, url: str, marker: str) -> Attempt:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": marker}]}
    start = time.monotonic()
    try:
        answer = await http.post(f"{url}/v1/chat/completions", json=body)
    except httpx.HTTPError:
        return Attempt(marker, edge, start, time.monotonic(), None)
    code = None
    if answer.status_code != 200:
        try:
            code = answer.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
    return Attempt(marker, edge, start, time.monotonic(), answer.status_code, code)


async def _wait_for_a_leader(cluster: Cluster, http: httpx.AsyncClient) -> None:
    with trio.fail_after(30):
        while await cluster.leader(http) is None:
            await trio.sleep(0.05)


async def _settle(cluster: Cluster, http: httpx.AsyncClient) -> list[str]:
    """Empty when every Edge drains within :data:`SETTLE_S`; else what was left."""
    left: list[str] = []
    with trio.move_on_after(SETTLE_S):
        while left := await cluster.undrained(http):
            await trio.sleep(0.2)
    return [f"after the load: {what}" for what in left]


def _terms(cluster: Cluster) -> list[Term]:
    """Every leader term in every Edge process's log (a restarted Edge's processes each have one)."""
    return [
        term
        for edge in cluster.edges
        for path in sorted(cluster.stack.directory.glob(f"{edge.name}-*.stderr"))
        for term in terms_of(edge.name, path.read_text(encoding="utf-8", errors="replace"))
    ]


def save_failure(result: Result, folder: Path) -> Path:
    """Write a failing schedule's seed, faults and violations (replay: ``--seed SEED --schedules 1``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"failed-seed-{result.seed}.json"
    path.write_text(
        json.dumps({"seed": result.seed, "faults": result.faults, "violations": result.violations}, indent=2) + "\n"
    )
    return path


def keep_history(result: Result, directory: Path, folder: Path) -> None:
    """Copy a failing schedule's ``directory`` (every process's stderr, the backends' executions) to
    ``folder``, with the clients' attempts, the nemesis's losses and its Edge stops (``attempts.jsonl``,
    ``losses.jsonl``, ``stops.jsonl``): the history the checker judged."""
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(directory, folder, ignore=shutil.ignore_patterns("etcd-data"))
    for name, records in (("attempts", result.attempts), ("losses", result.losses), ("stops", result.stops)):
        with (folder / f"{name}.jsonl").open("w", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(attrs.asdict(record)) + "\n")
