"""Node process life cycle against a real Edge: SIGTERM, SIGKILL, SIGSTOP, restart.

[disconnect-exclusion] [disconnect-queue-resolution] [offline-snapshot] with real
processes. One node, ``node-a``, with ``gpu0`` serving both ``ornith:35b`` and
``ornith-fast``; the mock backend streams slowly so a long request stays in flight
until the test breaks its node.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from e2e.harness import (
    BIG,
    FAST,
    NODE_REGISTERED,
    Requests,
    Stack,
    drained,
    edge_config,
    error_code,
    node_config,
    open_stack,
    provider,
    sse_error_code,
)

LONG = 400
"""max_tokens of a request that stays in flight (20 s at 20 tokens/s) until the node breaks."""
QUEUE_TIMEOUT_MS = 60_000
"""Far beyond every test's bound: an answer to a waiter is never the queue timeout."""


async def start(stack: Stack, *, capacity: int = 1, heartbeat_timeout_ms: int = 15_000) -> None:
    await stack.start_backend(latency_ms=100, tokens_per_second=20)
    await stack.start_edge(
        edge_config(
            providers={"gpu0": capacity},
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            queue_timeout_ms=QUEUE_TIMEOUT_MS,
        )
    )
    await stack.start_node(node_config(providers={"gpu0": capacity}, heartbeat_interval_ms=200))


def offline(status: dict[str, Any]) -> bool:
    gpu0 = provider(status, "gpu0")
    return gpu0["status"] == "unavailable" and gpu0["health"] == "offline"


@pytest.mark.req("disconnect-exclusion", "disconnect-queue-resolution", "offline-snapshot")
async def test_graceful_sigterm_ends_waiters_with_unavailable_at_once(tmp_path: Path) -> None:
    """[disconnect-exclusion] [disconnect-queue-resolution] [offline-snapshot] SIGTERM to the
    node with one request running and two queued (one per model key): the node closes its
    socket, the Edge excludes gpu0 within 1 s (the heartbeat timeout is 15 s), both waiters
    get 503 unavailable at once (the queue timeout is 60 s), the running one 502
    node_disconnected, and /status keeps gpu0 as offline with every counter 0."""
    with trio.fail_after(30):
        async with open_stack(tmp_path) as stack, trio.open_nursery() as nursery:
            await start(stack)
            requests = Requests(stack, nursery)
            await requests.running("running", BIG, max_tokens=LONG)
            await requests.queued("waiter-big", BIG)
            await requests.queued("waiter-fast", FAST)
            assert stack.node is not None and stack.edge is not None
            stack.node.terminate()
            with trio.fail_after(1.0):
                status = await stack.wait_status(offline)
            answers = await requests.answered(timeout=5.0)
            node_exit = await stack.node.wait()
            after = await stack.chat(FAST)
            models = (await stack.http.get(f"{stack.base_url}/v1/models")).json()
            edge_log = stack.edge.stderr()
    assert node_exit == 0
    assert answers["running"].status_code == 502
    assert error_code(answers["running"]) == "node_disconnected"
    for name in ("waiter-big", "waiter-fast"):
        assert answers[name].status_code == 503, answers[name].text
        assert error_code(answers[name]) == "unavailable"
    assert after.status_code == 503 and error_code(after) == "unavailable"
    gpu0 = provider(status, "gpu0")
    assert gpu0["connected"] is False and gpu0["effective_capacity"] == 0
    assert drained(status)
    assert {m["id"] for m in models["data"]} == {BIG, FAST}
    assert "node node-a generation 1 disconnected (graceful)" in edge_log


@pytest.mark.req("disconnect-exclusion", "lease-lifecycle")
async def test_sigkill_ends_in_flight_requests_with_node_disconnected(tmp_path: Path) -> None:
    """[disconnect-exclusion] [lease-lifecycle] SIGKILL of the node (no WebSocket close) with
    a stream and a non-stream request running and one queued: the Edge excludes gpu0 within
    the 1 s heartbeat timeout (the kernel's FIN usually tells it sooner), the non-stream
    request gets 502 node_disconnected, the stream ends with a final node_disconnected error
    event (no [DONE]), the waiter 503 unavailable; nothing hangs and every counter is 0."""
    with trio.fail_after(30):
        async with open_stack(tmp_path) as stack, trio.open_nursery() as nursery:
            await start(stack, capacity=2, heartbeat_timeout_ms=1_000)
            requests = Requests(stack, nursery)
            await requests.running("plain", BIG, max_tokens=LONG)
            await requests.streaming("stream", FAST, max_tokens=LONG)
            await requests.queued("waiter", BIG)
            assert stack.node is not None
            stack.node.kill()
            with trio.fail_after(3.0):  # the 1 s heartbeat timeout, with room for a busy box
                status = await stack.wait_status(offline)
            answers = await requests.answered(timeout=5.0)
            node_exit = await stack.node.wait()
    assert node_exit == -signal.SIGKILL
    assert answers["plain"].status_code == 502 and error_code(answers["plain"]) == "node_disconnected"
    assert answers["stream"].status_code == 200
    assert sse_error_code(answers["stream"]) == "node_disconnected"
    assert answers["waiter"].status_code == 503 and error_code(answers["waiter"]) == "unavailable"
    assert drained(status)


@pytest.mark.req("disconnect-exclusion")
async def test_sigstop_excluded_by_heartbeat_timeout_then_reconnects(tmp_path: Path) -> None:
    """[disconnect-exclusion] A frozen node (SIGSTOP: socket open, nothing sent) is excluded
    by the heartbeat timeout (cause heartbeat_timeout in the Edge log); its running request
    gets 502 node_disconnected. After SIGCONT the same process reconnects: new generation,
    gpu0 available again, requests succeed."""
    with trio.fail_after(30):
        async with open_stack(tmp_path) as stack, trio.open_nursery() as nursery:
            await start(stack, heartbeat_timeout_ms=1_000)
            requests = Requests(stack, nursery)
            await requests.running("running", BIG, max_tokens=LONG)
            node, edge = stack.node, stack.edge
            assert node is not None and edge is not None
            node.sigstop()
            with trio.fail_after(5.0):
                status = await stack.wait_status(offline)
            answers = await requests.answered(timeout=5.0)
            node.sigcont()
            registered = await node.wait_for_line(NODE_REGISTERED, count=2)
            back = await stack.wait_status(lambda s: provider(s, "gpu0")["status"] == "available")
            ok = await stack.chat(FAST)
            edge_log = edge.stderr()
    assert answers["running"].status_code == 502
    assert error_code(answers["running"]) == "node_disconnected"
    assert drained(status)
    assert "node node-a generation 1 disconnected (heartbeat_timeout)" in edge_log
    assert int(registered[2]) == 2
    assert provider(back, "gpu0")["generation"] == 2
    assert ok.status_code == 200, ok.text


@pytest.mark.req("offline-snapshot", "disconnect-exclusion")
async def test_restart_after_crash_same_provider_new_generation(tmp_path: Path) -> None:
    """[offline-snapshot] [disconnect-exclusion] Kill the node process and start a new one:
    gpu0 keeps its identity (node-a/gpu0) and comes back available with a new generation;
    both model keys work again and every counter is 0 afterwards."""
    with trio.fail_after(30):
        async with open_stack(tmp_path) as stack:
            await start(stack, heartbeat_timeout_ms=1_000)
            first = await stack.chat(BIG)
            before = await stack.status()
            assert stack.node is not None
            stack.node.kill()
            await stack.node.wait()
            down = await stack.wait_status(offline)
            await stack.start_node(node_config(providers={"gpu0": 1}, heartbeat_interval_ms=200))
            up = await stack.wait_status(lambda s: provider(s, "gpu0")["status"] == "available")
            again = [await stack.chat(BIG), await stack.chat(FAST, stream=True)]
            status = await stack.wait_status(drained)
    keys = lambda s: [(p["node_id"], p["provider_id"]) for p in s["providers"]]  # noqa: E731
    assert first.status_code == 200
    assert keys(before) == keys(down) == keys(up) == [("node-a", "gpu0")]
    assert provider(down, "gpu0")["connected"] is False
    assert provider(up, "gpu0")["generation"] > provider(before, "gpu0")["generation"]
    assert provider(up, "gpu0")["health"] == "online" and provider(up, "gpu0")["effective_capacity"] == 1
    assert [r.status_code for r in again] == [200, 200]
    assert again[0].headers["x-iop-provider"] == again[1].headers["x-iop-provider"] == "node-a/gpu0"
    assert again[1].text.rstrip().endswith("data: [DONE]")
    assert drained(status)
