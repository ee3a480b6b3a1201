"""The whole-system check's nemesis: a seeded schedule of faults, applied to a running cluster.

A schedule is a list of :class:`Fault` values drawn from a seed (:func:`schedule`), so a failing
one is replayed exactly by its seed. Kinds (each one at a time, with a quiet gap after it):

- ``pause_leader``: SIGSTOP the leading Edge past its TTL (the standby takes over), then SIGCONT;
- ``pause_edge``: SIGSTOP a random Edge for less than its TTL, then SIGCONT (the Nodes may drop
  its links, [edge-liveness]: a loss of both Nodes for that Edge, as for a link fault);
- ``kill_edge``: SIGKILL a random Edge, restart it on its ports;
- ``kill_node`` / ``pause_node``: SIGKILL a Node and restart it / SIGSTOP it past the Edges'
  heartbeat timeout, then SIGCONT;
- ``kill_etcd`` / ``pause_etcd``: SIGKILL etcd and restart it on its data / SIGSTOP it, then SIGCONT;
- ``reload``: SIGHUP every Edge (a reload of the same file under load);
- ``partition_link`` / ``half_open_link`` / ``delay_link`` / ``drop_link``: the links between the
  Nodes and one Edge blackholed both ways past the heartbeat timeout / blackholed from the Edge to
  the Nodes / slowed by 60-300 ms a chunk / reset (:mod:`.proxy`), then healed; each a loss of both
  Nodes for that Edge, but a delay of at most :data:`SILENCE_S`.
"""

from __future__ import annotations

import random
import signal
import time

import attrs
import httpx
import trio

from .checker import Loss
from .cluster import NODE_HEARTBEAT_S, NODES, TTL_S, Cluster, provider_label
from .terms import Stop

KINDS = (
    "pause_leader",
    "pause_edge",
    "kill_edge",
    "kill_node",
    "pause_node",
    "kill_etcd",
    "pause_etcd",
    "reload",
    "partition_link",
    "half_open_link",
    "delay_link",
    "drop_link",
)
SILENCE_S = NODE_HEARTBEAT_S / 5
"""An Edge stopped, or its link delayed a chunk, longer than this may go silent past the Nodes'
heartbeat interval on a busy machine (a Node pings every quarter interval; two delays stack up
in the proxy): the Nodes drop its links and cancel its runs, a loss like a link fault's."""
LINK_MODES = {"partition_link": "blackhole", "half_open_link": "half_open", "delay_link": "delay", "drop_link": "drop"}


@attrs.frozen
class Fault:
    at: float
    """Seconds after the load starts."""
    kind: str
    target: int
    """Which Edge or Node (an index; taken modulo their number)."""
    duration: float
    """How long the process stays stopped or down."""


def schedule(seed: int, length: float, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """The faults of ``seed`` over ``length`` seconds of load: one at a time, a quiet gap between,
    each of one of ``kinds``."""
    rng = random.Random(seed)
    faults = []
    at = rng.uniform(1.0, 2.5)
    while at < length - 2.0:
        kind = rng.choice(kinds)
        if kind == "pause_leader":
            duration = rng.uniform(TTL_S + 0.5, TTL_S + 2.0)
        elif kind == "pause_edge":
            duration = rng.uniform(0.2, TTL_S - 0.5)
        else:
            duration = rng.uniform(0.3, 2.5)
        faults.append(Fault(round(at, 3), kind, rng.randrange(8), round(duration, 3)))
        at += duration + rng.uniform(1.0, 3.0)
    return faults


async def apply(fault: Fault, cluster: Cluster, http: httpx.AsyncClient, losses: list[Loss], stops: list[Stop]) -> str:
    """Strike ``fault`` and undo it after its duration; a line for the run's log. A Node's loss
    goes into ``losses`` (kept with a failing schedule's history; the checker excuses nothing), an Edge's stop into ``stops``
    (wall clock: the step-down check leaves it out of the Edge's running time). Checkpoints."""
    edge = cluster.edges[fault.target % len(cluster.edges)]
    node = NODES[fault.target % len(NODES)]
    if fault.kind == "pause_leader":
        leader = await cluster.leader(http)
        if leader is None:
            return "pause_leader: no leader now, nothing paused"
        stopped = time.time()
        leader.daemon.sigstop()
        await trio.sleep(fault.duration)
        leader.daemon.sigcont()
        stops.append(Stop(leader.name, stopped, time.time()))
        return f"paused leader {leader.name} {fault.duration} s"
    if fault.kind == "pause_edge":
        start, stopped = time.monotonic(), time.time()
        edge.daemon.sigstop()
        await trio.sleep(fault.duration)
        edge.daemon.sigcont()
        stops.append(Stop(edge.name, stopped, time.time()))
        if time.monotonic() - start > SILENCE_S:  # the Nodes may have dropped it: its runs cut
            losses.extend(Loss(provider_label(node), start, time.monotonic() + 1.0) for node in NODES)
        return f"paused {edge.name} {fault.duration} s"
    if fault.kind == "kill_edge":
        edge.daemon.kill()
        await trio.sleep(fault.duration)
        await cluster.restart_edge(cluster.edges.index(edge))
        return f"killed and restarted {edge.name}"
    if fault.kind == "kill_node":
        start = time.monotonic()
        cluster.nodes[node].kill()
        await trio.sleep(fault.duration)
        await cluster.restart_node(node)
        losses.append(Loss(provider_label(node), start, time.monotonic()))
        return f"killed and restarted {node}"
    if fault.kind == "pause_node":
        start = time.monotonic()
        cluster.nodes[node].sigstop()
        await trio.sleep(fault.duration + 1.5)  # past the Edges' heartbeat timeout
        cluster.nodes[node].sigcont()
        losses.append(Loss(provider_label(node), start, time.monotonic() + 1.0))  # its runs end on waking
        return f"paused {node} {fault.duration + 1.5:.3f} s"
    if fault.kind == "kill_etcd":
        await trio.to_thread.run_sync(cluster.etcd.stop)
        await trio.sleep(fault.duration)
        await trio.to_thread.run_sync(cluster.etcd.start)
        return f"killed and restarted etcd after {fault.duration} s"
    if fault.kind == "pause_etcd":
        cluster.etcd.pause()
        await trio.sleep(fault.duration)
        cluster.etcd.resume()
        return f"paused etcd {fault.duration} s"
    if fault.kind in LINK_MODES:
        return await _link_fault(fault, cluster, losses)
    assert fault.kind == "reload"
    for each in cluster.edges:
        each.daemon.send_signal(signal.SIGHUP)
    return "reloaded every Edge"


async def _link_fault(fault: Fault, cluster: Cluster, losses: list[Loss]) -> str:
    """Set one Edge's link proxy to the fault's mode, then back to ``pass``. A partition past the
    heartbeat timeout loses both Nodes for that Edge: its runs are cut (recorded in ``losses``)."""
    index = fault.target % len(cluster.proxies)
    proxy, name = cluster.proxies[index], cluster.edges[index].name
    mode = LINK_MODES[fault.kind]
    start = time.monotonic()
    proxy.set(mode, delay=min(0.3, fault.duration / 5))  # type: ignore[arg-type]
    hold = fault.duration + (1.5 if mode in ("blackhole", "half_open") else 0.0)  # past the heartbeat timeout
    await trio.sleep(hold)
    proxy.set("pass")
    if mode != "delay" or proxy.delay > SILENCE_S:  # a chunk can wait two delays: silence past the interval
        losses.extend(Loss(provider_label(node), start, time.monotonic() + 1.0) for node in NODES)
    return f"{fault.kind} to {name} {hold:.3f} s"
