"""EdgeClient/EdgeSession over in-memory WebSocket streams with a MockClock: exact timing.

The connector is injected (``EdgeClient(connect=...)``), the way a simulation wraps
``trio.testing.memory_stream_pair`` streams with ``trio_websocket.wrap_client_stream``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing

from iop_node import (
    EdgeClient,
    NodeRuntime,
    ProviderConfig,
    ReconnectConfig,
    RegistrationRejected,
    backoff_delay,
    first_delay,
)
from iop_wire import OLDEST_PROTOCOL, PROTOCOL_VERSION, PROTOCOL_VERSIONS, Heartbeat, Rejected, Run
from node.harness import FakeEdge, MemoryLink, node_config

MOCK = ProviderConfig(id="m0", adapter="mock", capacity=2, latency_ms=10_000)


@attrs.define(eq=False)
class MemoryNode:
    client: EdgeClient
    runtime: NodeRuntime
    link: MemoryLink


@asynccontextmanager
async def memory_node(edge: FakeEdge, *, failures: int = 0, **config_kw: object) -> AsyncIterator[MemoryNode]:
    config = node_config("ws://edge.invalid", MOCK, **config_kw)  # type: ignore[arg-type]
    async with trio.open_nursery() as edge_nursery, NodeRuntime.from_config(config) as runtime:
        link = MemoryLink(edge, edge_nursery, failures=failures)
        client = EdgeClient(config, runtime, connect=link.connect, rng=random.Random(0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            yield MemoryNode(client, runtime, link)
            client.shutdown()
        edge_nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("configured_ms", "edge_ms", "expected"), [(100, 250, 0.1), (300, 1000, 0.3)])
async def test_heartbeat_every_min_of_both_intervals(
    autojump_clock: trio.testing.MockClock, configured_ms: int, edge_ms: int, expected: float
) -> None:
    """The node heartbeats every min(configured, registered.heartbeat_interval_ms)."""
    edge = FakeEdge(heartbeat_interval_ms=edge_ms)
    async with memory_node(edge, heartbeat_interval_ms=configured_ms):
        conn = await edge.next_connection()
        start = trio.current_time()
        times = []
        for seq in (1, 2, 3):
            assert await conn.receive() == Heartbeat(seq)
            times.append(trio.current_time() - start)
    assert times == pytest.approx([expected, 2 * expected, 3 * expected])


async def test_reconnect_backoff_doubles_to_the_cap_and_resets(autojump_clock: trio.testing.MockClock) -> None:
    """Failed attempts back off 0.1, 0.2, 0.4 s (capped at 0.3 here); a registered
    connection resets the backoff: the first attempt after a drop waits the first-attempt
    spread, uniform(0, jitter x max_ms), 0 here (jitter 0)."""
    edge = FakeEdge()
    async with memory_node(edge, failures=3, reconnect=ReconnectConfig(100, 300, 0.0)) as node:
        await edge.next_connection()
        await node.link.server_streams[0].aclose()  # abrupt drop, no close frame
        await edge.next_connection()
    attempts = node.link.attempts
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(attempts)]
    assert gaps == [0.1, 0.2, 0.3, 0.0]


@pytest.mark.req("reconnect-storm")
def test_first_attempt_is_spread_over_jitter_times_max() -> None:
    """[reconnect-storm] the first attempt (start, or after a registered connection ended)
    waits uniform(0, jitter x max_ms): 10,000 nodes dropped at once do not dial at once."""
    policy = ReconnectConfig(initial_ms=100, max_ms=5000, jitter=0.2)
    rng = random.Random(2)
    delays = sorted(first_delay(policy, rng) for _ in range(10_000))
    assert 0.0 <= delays[0] < 0.01 and 0.99 < delays[-1] <= 1.0
    per_tenth = [sum(1 for d in delays if i / 10 <= d < (i + 1) / 10) for i in range(10)]
    assert min(per_tenth) > 800  # no 100 ms window holds more than its share (~1,000)
    assert max(per_tenth) < 1200
    assert first_delay(ReconnectConfig(100, 300, 0.0), rng) == 0.0


def test_backoff_delay_jitter_stays_within_20_percent() -> None:
    policy = ReconnectConfig(initial_ms=100, max_ms=5000, jitter=0.2)
    rng = random.Random(1)
    for attempt, base in [(0, 0.1), (1, 0.2), (5, 3.2), (6, 5.0), (100, 5.0)]:
        delays = [backoff_delay(attempt, policy, rng) for _ in range(200)]
        assert base * 0.8 <= min(delays) < max(delays) <= base * 1.2


@pytest.mark.req("runtime-concurrency")
async def test_abrupt_drop_cancels_every_run_of_the_connection(autojump_clock: trio.testing.MockClock) -> None:
    """[runtime-concurrency] A transport drop (no close frame) cancels all runs of that
    connection at once and returns their permits; the node then reconnects."""
    edge = FakeEdge()
    async with memory_node(edge) as node:
        conn = await edge.next_connection()
        for run_id in ("a", "b"):
            await conn.send(Run(run_id, "m0", "chat/completions", {"max_tokens": 1}, True))
        await trio.testing.wait_all_tasks_blocked()
        assert node.runtime.gate.statistics().total_in_use == 2
        session = node.client.session
        assert session is not None and session.active_runs == 2
        dropped_at = trio.current_time()
        await node.link.server_streams[0].aclose()
        await edge.next_connection()
        assert node.runtime.gate.statistics().total_in_use == 0
        assert session.active_runs == 0
        assert trio.current_time() - dropped_at < 1  # well before the mock's 10 s latency


async def test_protocol_violation_closes_with_1002_and_reconnects(autojump_clock: trio.testing.MockClock) -> None:
    edge = FakeEdge()
    async with memory_node(edge) as node:
        conn = await edge.next_connection()
        await conn.ws.send_message('{"type": "run", "run_id": 7}')
        await conn.closed.wait()
        assert conn.close_reason is not None and conn.close_reason.code == 1002
        await edge.next_connection()
        assert node.client.connections == 2


async def test_retryable_rejection_is_retried(autojump_clock: trio.testing.MockClock) -> None:
    edge = FakeEdge(reject=Rejected("duplicate", "node-a is already connected", retryable=True))
    async with memory_node(edge) as node:
        while len(edge.registers) < 3:
            await trio.sleep(0.01)
        assert node.client.session_registered is False


async def final_rejection(edge: FakeEdge) -> tuple[RegistrationRejected, MemoryLink]:
    """Run a client against ``edge`` until a rejection ends it: that rejection, and the link it dialled."""
    config = node_config("ws://edge.invalid", MOCK)
    async with trio.open_nursery() as edge_nursery, NodeRuntime.from_config(config) as runtime:
        link = MemoryLink(edge, edge_nursery)
        client = EdgeClient(config, runtime, connect=link.connect)
        with pytest.raises(RegistrationRejected) as caught:
            await client.run()
        edge_nursery.cancel_scope.cancel()
    return caught.value, link


async def test_final_rejection_ends_the_client(autojump_clock: trio.testing.MockClock) -> None:
    rejected, link = await final_rejection(
        FakeEdge(reject=Rejected("bad_token", "token does not match", retryable=False))
    )
    assert (rejected.code, rejected.retryable) == ("bad_token", False)
    assert len(link.attempts) == 1


@pytest.mark.req("wire-versioning")
async def test_an_edge_older_than_the_previous_version_ends_the_client(autojump_clock: trio.testing.MockClock) -> None:
    """[wire-versioning] An Edge that speaks neither version of the pair (a v3 Edge): the node offers
    the current version, falls back to the previous once, and stops when that is refused too."""
    edge = FakeEdge(protocols=(OLDEST_PROTOCOL - 1,))
    rejected, _ = await final_rejection(edge)
    assert (rejected.code, rejected.retryable) == ("protocol_mismatch", False)
    assert [register.protocol for register in edge.registers] == [PROTOCOL_VERSION, OLDEST_PROTOCOL]


@pytest.mark.req("wire-versioning")
async def test_after_a_fallback_the_next_connection_offers_the_current_version_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """[wire-versioning] A connection at the previous version ends (its Edge upgraded meanwhile):
    the next one offers the current version again."""
    edge = FakeEdge(protocols=(OLDEST_PROTOCOL,))
    async with memory_node(edge) as node:
        await edge.next_connection()
        edge.protocols = PROTOCOL_VERSIONS
        await node.link.server_streams[-1].aclose()
        conn = await edge.next_connection()
        assert conn.register.protocol == PROTOCOL_VERSION
    assert [register.protocol for register in edge.registers] == [PROTOCOL_VERSION, OLDEST_PROTOCOL, PROTOCOL_VERSION]
