"""A client that goes away, across real processes: [lease-lifecycle] client cancel."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import trio

from e2e.harness import BIG, FAST, Requests, drained, edge_config, node_config, open_stack, provider


@pytest.mark.req("lease-lifecycle", "cross-group-wakeup")
async def test_client_disconnect_cancels_upstream_and_leaves_queue(tmp_path: Path) -> None:
    """[lease-lifecycle] [cross-group-wakeup] A streaming client hangs up after its first
    event while a client of the other model key waits, and a second waiter hangs up while
    queued: the Edge releases the lease and cancels the run, the node closes its upstream
    request (backend in_flight 0), the hung-up waiter leaves the queue, the remaining waiter
    is served, and every counter returns to 0."""
    with trio.fail_after(30):
        async with open_stack(tmp_path) as stack, trio.open_nursery() as nursery:
            await stack.start_backend(latency_ms=50, tokens_per_second=20)
            await stack.start_edge(edge_config())
            await stack.start_node(node_config())
            requests = Requests(stack, nursery)
            first: list[str] = []
            started, hang_up = trio.Event(), trio.Event()

            def stream_then_hang_up() -> None:
                # The sync client in a thread: a half-read async generator would be
                # finalized (and the stream closed) behind the test's back.
                with (
                    openai.OpenAI(
                        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=10.0
                    ) as client,
                    client.chat.completions.create(
                        model=BIG, stream=True, max_tokens=400, messages=[{"role": "user", "content": "hang up"}]
                    ) as stream,
                ):
                    first.append(next(iter(stream)).id)
                    trio.from_thread.run_sync(started.set)
                    trio.from_thread.run(hang_up.wait)

            nursery.start_soon(trio.to_thread.run_sync, stream_then_hang_up)
            await started.wait()
            await requests.queued("waiter", FAST)
            async with httpx.AsyncClient(timeout=10) as impatient, trio.open_nursery() as inner:
                inner.start_soon(
                    lambda: impatient.post(
                        f"{stack.base_url}/v1/chat/completions",
                        json={"model": FAST, "messages": [{"role": "user", "content": "x"}]},
                    )
                )
                queued = await stack.wait_status(lambda s: s["queue_depth"] == 2)
                inner.cancel_scope.cancel()  # the second waiter hangs up while queued
            left = await stack.wait_status(lambda s: s["queue_depth"] == 1)
            hang_up.set()  # the streaming client hangs up after its first event
            answers = await requests.answered(timeout=10)
            status = await stack.wait_status(drained)
            stats = await stack.backend_stats()
    assert first and first[0]
    assert provider(queued, "gpu0")["queued"] == 2
    assert provider(left, "gpu0")["queued"] == 1
    assert answers["waiter"].status_code == 200
    assert drained(status)
    assert stats["in_flight"] == 0 and stats["peak_in_flight"] == 1
    assert stats["total"] == 2
