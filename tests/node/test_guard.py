"""[tunnel-guard] [runtime-concurrency]: one LocalGate in front of every run, no queue at the node."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from iop_admission import ConcurrencyLimitExceeded
from iop_node import NodeRuntime, ProviderConfig
from iop_wire import Cancel, Run, RunData, RunEnd, TunnelEnd, TunnelRequest, TunnelStart
from node.harness import Backend, EdgeConn, FakeEdge, node_config, openai_provider, running_node

SLOW_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "stream": True}


def slow_run(run_id: str, provider: str = "gpu0") -> Run:
    return Run(run_id, provider, "chat/completions", SLOW_CHAT, True)


def slow_tunnel(run_id: str, provider: str = "gpu0") -> TunnelRequest:
    body = json.dumps(SLOW_CHAT).encode()
    headers = (("content-type", "application/json"),)
    return TunnelRequest.from_bytes(run_id, provider, "POST", "/v1/chat/completions", headers, body)


def assert_concurrency_limit(end: object, run_id: str) -> None:
    assert isinstance(end, RunEnd | TunnelEnd)
    assert (end.run_id, end.status, end.code) == (run_id, "error", "concurrency_limit")


async def first_started(conn: EdgeConn, run_id: str) -> None:
    message = await conn.receive_for(run_id)
    assert isinstance(message, RunData | TunnelStart), message


async def finish(conn: EdgeConn, backend: Backend, *run_ids: str) -> None:
    """Cancel the admitted runs and check the upstream and the gate drain."""
    for run_id in run_ids:
        await conn.send(Cancel(run_id))
        end = (await conn.receive_until_end(run_id))[-1]
        assert (end.status, end.code) == ("cancelled", "cancelled")
    await backend.wait_idle()


@pytest.mark.req("tunnel-guard")
async def test_two_tunnels_on_capacity_one_open_one_upstream_request(edge: FakeEdge, backend: Backend) -> None:
    """[tunnel-guard] The second concurrent tunnel request is refused at once; the
    backend sees exactly one request."""
    backend.backend.tokens_per_second = 20
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, openai_provider(backend.port))) as node:
            conn = await edge.next_connection()
            await conn.send(slow_tunnel("t1"))
            await conn.send(slow_tunnel("t2"))
            assert_concurrency_limit(await conn.receive_for("t2"), "t2")
            await first_started(conn, "t1")
            assert backend.backend.stats()["peak_in_flight"] == 1
            assert node.runtime.gate.statistics().rejected == 1
            await finish(conn, backend, "t1")
            assert node.runtime.gate.statistics().total_in_use == 0
    assert backend.backend.stats()["total"] == 1


@pytest.mark.req("tunnel-guard")
async def test_two_runs_on_capacity_one(edge: FakeEdge, backend: Backend) -> None:
    """[tunnel-guard] The same for two concurrent normalized runs."""
    backend.backend.tokens_per_second = 20
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, openai_provider(backend.port))):
            conn = await edge.next_connection()
            await conn.send(slow_run("r1"))
            await conn.send(slow_run("r2"))
            assert_concurrency_limit(await conn.receive_for("r2"), "r2")
            await first_started(conn, "r1")
            assert backend.backend.stats()["peak_in_flight"] == 1
            await finish(conn, backend, "r1")
    assert backend.backend.stats()["total"] == 1


@pytest.mark.req("tunnel-guard")
@pytest.mark.parametrize("first_is_tunnel", [True, False])
async def test_run_and_tunnel_share_the_provider_limit(edge: FakeEdge, backend: Backend, first_is_tunnel: bool) -> None:
    """[tunnel-guard] A run and a tunnel request together: one upstream request, in
    either order; after the first ends, the provider serves again."""
    backend.backend.tokens_per_second = 20
    first, second = (slow_tunnel("a"), slow_run("b")) if first_is_tunnel else (slow_run("a"), slow_tunnel("b"))
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, openai_provider(backend.port))):
            conn = await edge.next_connection()
            await conn.send(first)
            await conn.send(second)
            assert_concurrency_limit(await conn.receive_for("b"), "b")
            await first_started(conn, "a")
            assert backend.backend.stats()["peak_in_flight"] == 1
            await finish(conn, backend, "a")
            # The permit is back before the end was sent: the next run is admitted.
            await conn.send(slow_run("c"))
            await first_started(conn, "c")
            await finish(conn, backend, "c")
    assert backend.backend.stats()["peak_in_flight"] == 1


@pytest.mark.req("runtime-concurrency")
async def test_node_wide_limit_across_two_providers(edge: FakeEdge, backend: Backend) -> None:
    """[runtime-concurrency] runtime.concurrency=1 with two capacity-1 providers: a run
    on gpu1 is refused while gpu0 runs; per-provider limits alone would admit it."""
    backend.backend.tokens_per_second = 20
    config = node_config(
        edge.url, openai_provider(backend.port, "gpu0"), openai_provider(backend.port, "gpu1"), concurrency=1
    )
    with trio.fail_after(10):
        async with running_node(config) as node:
            conn = await edge.next_connection()
            await conn.send(slow_run("r1", "gpu0"))
            await conn.send(slow_tunnel("t2", "gpu1"))
            assert_concurrency_limit(await conn.receive_for("t2"), "t2")
            await first_started(conn, "r1")
            stats = node.runtime.gate.statistics()
            assert (stats.in_use, stats.global_limit) == ({"gpu0": 1, "gpu1": 0}, 1)
            await finish(conn, backend, "r1")
    assert backend.backend.stats()["peak_in_flight"] == 1


@pytest.mark.req("runtime-concurrency")
async def test_background_runs_take_the_same_gate(edge: FakeEdge) -> None:
    """[runtime-concurrency] A background (node-initiated) run holds a permit: a
    foreground run from the Edge is refused meanwhile, and admitted after it ends."""
    mock = ProviderConfig(id="m0", adapter="mock", latency_ms=60_000)
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, mock)) as node:
            conn = await edge.next_connection()
            async with trio.open_nursery() as nursery:
                background = trio.CancelScope()

                async def warm_up() -> None:
                    with background:
                        await node.runtime.run_background("m0", "chat/completions", {"max_tokens": 1})

                nursery.start_soon(warm_up)
                while node.runtime.gate.statistics().total_in_use == 0:
                    await trio.sleep(0.01)
                await conn.send(Run("fg", "m0", "chat/completions", {"max_tokens": 1}, False))
                assert_concurrency_limit(await conn.receive_for("fg"), "fg")
                background.cancel()
            assert node.runtime.gate.statistics().total_in_use == 0
            await conn.send(Run("fg2", "m0", "chat/completions", {"max_tokens": 1}, False))
            await conn.send(Cancel("fg2"))
            end = await conn.receive_for("fg2")  # admitted this time: it ends as cancelled
            assert isinstance(end, RunEnd) and end.status == "cancelled"


@pytest.mark.req("runtime-concurrency")
async def test_background_run_is_refused_while_the_edge_holds_the_provider(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """[runtime-concurrency] run_background refuses at once (no waiting) when the
    provider is busy, and returns the response when it is free."""
    config = node_config("ws://unused", ProviderConfig(id="m0", adapter="mock", latency_ms=1000))
    async with NodeRuntime.from_config(config) as runtime:
        permit, _ = runtime.admit("m0")
        start = trio.current_time()
        with pytest.raises(ConcurrencyLimitExceeded):
            await runtime.run_background("m0", "chat/completions", {"max_tokens": 2})
        assert trio.current_time() == start
        permit.release()
        response = await runtime.run_background("m0", "chat/completions", {"max_tokens": 2})
        assert trio.current_time() - start == 1.0
        assert response["choices"][0]["message"]["content"] == "tok tok "
        assert runtime.gate.statistics().total_in_use == 0
