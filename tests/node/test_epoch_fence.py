"""[epoch-fencing] One fence per node, across its Edge connections: a stale leader's run is refused.

Real sockets on 127.0.0.1: two fake Edges, one node with ``edge_urls`` to both
(:class:`~iop_node.EdgeClients` over one runtime), bounded by ``fail_after``.
"""

from __future__ import annotations

import random

import attrs
import pytest
import trio

from iop_node import EdgeClients, EpochFence, NodeRuntime, ProviderConfig, RunFailed
from iop_wire import PROTOCOL_VERSION, Cancel, InFlight, Leader, Run, RunEnd, TunnelEnd, TunnelRequest
from node.harness import EdgeConn, FakeEdge, node_config

pytestmark = pytest.mark.req("epoch-fencing", "held-elsewhere")

SLOW = ProviderConfig(id="gpu0", adapter="mock", capacity=3, latency_ms=60_000)
"""Runs stay in flight until cancelled."""


def run(run_id: str, epoch: int | None, *, long: bool = False) -> Run:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    return Run(run_id, "gpu0", "chat/completions", body, False, epoch, long)


def test_the_fence_only_goes_up_and_refuses_epoch_less_runs_once_it_has_seen_an_epoch() -> None:
    fence = EpochFence()
    assert fence.admits(None) and fence.seen == 0  # an Edge without ha: sends no epoch, nor leader
    assert fence.admits(5) and fence.seen == 5
    assert fence.admits(5)
    assert not fence.admits(4) and fence.refused == 1
    fence.raise_to(3)
    assert fence.seen == 5
    assert not fence.admits(None) and fence.refused == 2  # an HA group's node: no epoch, no run
    with pytest.raises(RunFailed, match="run without an epoch; this node has seen epoch 5"):
        fence.check(None)


def test_a_leader_message_alone_makes_epoch_less_runs_refused() -> None:
    fence = EpochFence()
    fence.raise_to(7)
    assert not fence.admits(None) and fence.seen == 7 and fence.refused == 1


async def test_a_stale_leaders_run_is_refused_once_a_newer_leader_spoke(nursery: trio.Nursery) -> None:
    old, new = FakeEdge(), FakeEdge()
    await nursery.start(old.serve)
    await nursery.start(new.serve)
    config = attrs.evolve(node_config(old.url, SLOW), edge_url=None, edge_urls=(old.url, new.url))
    with trio.fail_after(10):
        async with NodeRuntime.from_config(config) as runtime:
            clients = EdgeClients(config, runtime, rng=random.Random(1))
            nursery.start_soon(clients.run)
            to_old, to_new = await old.next_connection(), await new.next_connection()
            assert to_old.register.protocol == to_new.register.protocol == PROTOCOL_VERSION

            await to_old.send(Leader(5))
            assert await to_old.receive() == InFlight(5, ())
            await to_old.send(run("r1", 5, long=True))  # the leader of epoch 5 runs r1, a long one: it stays
            while runtime.in_flight() != (("gpu0", 1),):
                await trio.sleep(0.01)

            # A new leader: it learns the run the old one left running, on the same gate, and that it is long.
            await to_new.send(Leader(6))
            assert await to_new.receive() == InFlight(6, (("gpu0", 1),), (("gpu0", 1),))

            # The old leader, unaware, sends another run of epoch 5: refused, nothing upstream.
            await to_old.send(run("r2", 5))
            end = await to_old.receive_for("r2")
            assert isinstance(end, RunEnd) and (end.status, end.code, end.failure) == (
                "error",
                "stale_epoch",
                "stale_leader",
            )
            await to_old.send(TunnelRequest.from_bytes("t1", "gpu0", "GET", "/v1/models", epoch=4))
            tunnel_end = await to_old.receive_for("t1")
            assert isinstance(tunnel_end, TunnelEnd) and tunnel_end.code == "stale_epoch"
            assert (runtime.fence.seen, runtime.fence.refused) == (6, 2)
            assert runtime.in_flight() == (("gpu0", 1),)  # the refused runs took no permit

            # The new leader's runs go through; a run without an epoch is refused like a stale one:
            # this node has seen an epoch, it serves an HA group (a woken leader's epoch-less run).
            await to_new.send(run("r3", 6))
            await to_old.send(run("r4", None))
            end = await to_old.receive_for("r4")
            assert isinstance(end, RunEnd) and (end.code, end.failure) == ("stale_epoch", "stale_leader")
            await to_new.send(run("r5", 6))
            while runtime.in_flight() != (("gpu0", 3),):
                await trio.sleep(0.01)

            # [held-elsewhere] the old leader's run ends: the new leader hears the count go down.
            await to_old.send(Cancel("r1"))
            assert await next_in_flight(to_new) == InFlight(6, ())
            assert runtime.in_flight() == (("gpu0", 2),)  # its own runs are never reported to it
            assert +runtime.long_runs == {}  # and the long one's count went with it
            clients.shutdown()


async def next_in_flight(edge: EdgeConn) -> InFlight:
    """The next ``in_flight`` on a fake Edge's connection (heartbeats and run messages skipped)."""
    while True:
        message = await edge.receive()
        if isinstance(message, InFlight):
            return message
