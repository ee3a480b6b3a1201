"""Failover before the first byte, ejection and first-token timeout through the Edge's HTTP API.

[failover-before-first-byte] [outlier-ejection] [first-token-timeout]. Two fake
nodes: ``ornith:35b`` prefers ``node-a/gpu0`` (priority 3) and may fall back to
``node-b/gpu1``; ``ornith-fast`` has only ``node-a/gpu0``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from edge.harness import (
    BIG,
    FAST,
    EdgeLayout,
    FakeNode,
    chat_chunk,
    eventually,
    fake_node,
    running_edge,
    sse_events,
    start_chat,
)
from iop_wire import RunEnd

pytestmark = pytest.mark.req("failover-before-first-byte", "outlier-ejection", "first-token-timeout")


async def _metric(edge_http: httpx.AsyncClient, name: str, **labels: str) -> float:
    body = (await edge_http.get("/metrics")).text
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


async def _fail_then_serve(a: FakeNode, b: FakeNode, end: RunEnd) -> None:
    """node-a fails its run with ``end``; node-b serves the retry."""
    run = await a.next_run()
    await a.send(RunEnd(run.run_id, end.status, end.code, end.message, end.upstream_status))
    retry = await b.next_run()
    assert retry.body["model"] == "qwen3:35b-b"
    await b.answer(retry, "from b")


async def test_retry_on_other_candidate_before_first_byte(tmp_path: Path) -> None:
    """[failover-before-first-byte] an upstream 500, 429, unreachable or a node concurrency_limit
    before the first byte: the request is answered 200 by the other candidate, with
    x-iop-attempts 2 and the provider that served it."""
    failures = [
        (RunEnd("x", "error", "upstream_error", "boom", 500), "upstream_5xx"),
        (RunEnd("x", "error", "upstream_error", "slow down", 429), "upstream_429"),
        (RunEnd("x", "error", "upstream_unreachable", "refused"), "upstream_unreachable"),
        (RunEnd("x", "error", "concurrency_limit", "gate full"), "concurrency_limit"),
    ]
    layout = EdgeLayout(outlier="{consecutive_failures: 0}")
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge, "node-b", providers=("gpu1",)) as b:
            async with fake_node(edge) as a:
                for end, reason in failures:
                    results: dict[str, httpx.Response] = {}
                    async with trio.open_nursery() as nursery:
                        start_chat(nursery, edge, results, "r", BIG)
                        await _fail_then_serve(a, b, end)
                    response = results["r"]
                    assert response.status_code == 200, response.text
                    assert response.headers["x-iop-provider"] == "node-b/gpu1"
                    assert response.headers["x-iop-attempts"] == "2"
                    assert response.json()["choices"][0]["message"]["content"] == "from b"
                    assert await _metric(edge.http, "iop_retries_total", model=BIG, reason=reason) == 1
            await edge.assert_drained()


async def test_no_retry_of_a_run_sent_to_a_node_that_went_away(tmp_path: Path) -> None:
    """[failover-before-first-byte] a node whose connection ends after its run was sent may have
    run it (stopped or cut off after its backend answered): the request is answered 502
    ``node_disconnected`` after one attempt and the other candidate never gets the run -- refusing
    beats running twice. The control: the next request goes to the other candidate, as the first
    would have, and node-b's first run is that one."""
    layout = EdgeLayout(outlier="{consecutive_failures: 0}")
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge, "node-b", providers=("gpu1",)) as b:
            results: dict[str, httpx.Response] = {}
            async with fake_node(edge) as a:
                async with trio.open_nursery() as nursery:
                    start_chat(nursery, edge, results, "sent", BIG)
                    await a.next_run()
                    await a.drop()
            assert results["sent"].status_code == 502, results["sent"].text
            assert results["sent"].json()["error"]["code"] == "node_disconnected"
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "after", BIG)
                run = await b.next_run()
                await b.answer(run, "from b")
            assert results["after"].status_code == 200
            assert [r.body["messages"][-1]["content"] for r in b.runs_received] == ["after"]
            await edge.assert_drained()


async def test_no_retry_for_client_errors_after_first_byte_or_without_candidate(tmp_path: Path) -> None:
    """[failover-before-first-byte] never for the backend's client error (4xx but 429), never after
    a byte went to the client, and the last failure is the answer when no other candidate is left."""
    with trio.fail_after(20):
        async with running_edge(tmp_path) as edge, fake_node(edge, "node-b", providers=("gpu1",)) as b:
            async with fake_node(edge) as a:
                results: dict[str, httpx.Response] = {}
                async with trio.open_nursery() as nursery:
                    start_chat(nursery, edge, results, "400", BIG)
                    run = await a.next_run()
                    await a.send(RunEnd(run.run_id, "error", "upstream_error", "bad field", 400))
                    await eventually(lambda: "400" in results)
                    start_chat(nursery, edge, results, "stream", BIG, stream=True)
                    run = await a.next_run()
                    await a.send_json(run.run_id, chat_chunk("a"))
                    await a.send(RunEnd(run.run_id, "error", "upstream_error", "died", 500))
                    await eventually(lambda: "stream" in results)
                    start_chat(nursery, edge, results, "only", FAST)
                    run = await a.next_run()
                    await a.send(RunEnd(run.run_id, "error", "upstream_error", "boom", 500))
                assert results["400"].headers["x-iop-attempts"] == "1"
                assert results["400"].status_code == 400  # [upstream-error-passthrough]: the backend's status
                assert results["400"].json()["error"]["message"] == "bad field"
                streamed = results["stream"]
                assert streamed.status_code == 200 and streamed.headers["x-iop-attempts"] == "1"
                assert sse_events(streamed.text)[-1]["error"]["code"] == "upstream_error"
                assert results["only"].status_code == 502
                assert results["only"].headers["x-iop-attempts"] == "1"  # FAST has no other candidate
                # The 400 did not count against gpu0; the 500 of FAST did (the stream had its first byte).
                assert edge.provider("node-a", "gpu0")["failures"] == 1
                with trio.move_on_after(0.2):
                    await b.next_run()
                    raise AssertionError("node-b got a run: something was retried")
            await edge.assert_drained()


async def test_ejection_visible_and_avoided(tmp_path: Path) -> None:
    """[outlier-ejection] two 500s in a row eject gpu0: /status shows it ejected with its failure
    count and time left, /metrics counts it, the next request goes to gpu1 in one attempt; the
    single-candidate model is in panic mode and still admitted to gpu0."""
    layout = EdgeLayout(outlier="{consecutive_failures: 2, base_ejection_ms: 60000}")
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge, "node-b", providers=("gpu1",)) as b:
            async with fake_node(edge) as a:
                for _ in range(2):
                    results: dict[str, httpx.Response] = {}
                    async with trio.open_nursery() as nursery:
                        start_chat(nursery, edge, results, "r", BIG)
                        await _fail_then_serve(a, b, RunEnd("x", "error", "upstream_error", "boom", 503))
                    assert results["r"].status_code == 200
                status = await edge.status()
                gpu0 = next(p for p in status["providers"] if p["provider_id"] == "gpu0")
                assert (gpu0["health"], gpu0["failures"], gpu0["ejections"]) == ("ejected", 2, 1)
                assert 0 < gpu0["ejection_left"] <= 60
                assert status["panic"] == [FAST]
                assert await _metric(edge.http, "iop_ejected", node="node-a", provider="gpu0") == 1
                assert await _metric(edge.http, "iop_ejections_total", node="node-a", provider="gpu0") == 1
                assert await _metric(edge.http, "iop_panic_mode", model=FAST) == 1
                assert await _metric(edge.http, "iop_panic_mode", model=BIG) == 0
                results = {}
                async with trio.open_nursery() as nursery:
                    start_chat(nursery, edge, results, "avoid", BIG)
                    await b.answer(await b.next_run(), "b again")
                    await eventually(lambda: "avoid" in results)
                    start_chat(nursery, edge, results, "panic", FAST)
                    await a.answer(await a.next_run(), "a in panic")
                assert results["avoid"].headers["x-iop-attempts"] == "1"
                assert results["avoid"].headers["x-iop-provider"] == "node-b/gpu1"
                assert results["panic"].status_code == 200
                # A success in panic mode restores the provider.
                assert edge.provider("node-a", "gpu0")["health"] == "online"
            await edge.assert_drained()


async def test_first_token_timeout_cancels_and_retries(tmp_path: Path) -> None:
    """[first-token-timeout] no first byte within first_token_timeout_ms: the run is cancelled on
    the node, counted as a provider failure, and retried on the other candidate."""
    layout = EdgeLayout(first_token_timeout_ms=100)
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge, "node-b", providers=("gpu1",)) as b:
            async with fake_node(edge) as a:
                results: dict[str, httpx.Response] = {}
                async with trio.open_nursery() as nursery:
                    start_chat(nursery, edge, results, "slow", BIG, stream=True)
                    run = await a.next_run()
                    cancel = await a.next_cancel()  # the Edge gave up on it
                    assert cancel.run_id == run.run_id
                    await a.send(RunEnd(run.run_id, "cancelled", "cancelled"))
                    retry = await b.next_run()
                    await b.send_json(retry.run_id, chat_chunk("late but here"))
                    await b.send(RunEnd(retry.run_id, "ok"))
                response = results["slow"]
                assert response.status_code == 200
                assert response.headers["x-iop-attempts"] == "2"
                assert sse_events(response.text)[0]["choices"][0]["delta"]["content"] == "late but here"
                assert edge.provider("node-a", "gpu0")["failures"] == 1
                assert await _metric(edge.http, "iop_retries_total", model=BIG, reason="first_token_timeout") == 1
            await edge.assert_drained()
