"""Tenants at the Edge ([tenant-edge]): keys choose the tenant, quotas refuse with their own 429 codes,
grants follow the weights, token cost is settled with the reported usage, /status, metrics and a reload.

A real Edge on 127.0.0.1 with a :class:`~edge.harness.FakeNode` holding gpu0 (capacity 1): the test
decides when each run ends, so the grant order is exact.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from edge.harness import (
    BIG,
    FAST,
    Edge,
    EdgeLayout,
    FakeNode,
    RunEnd,
    chat_chunk,
    chat_response,
    eventually,
    fake_node,
    mock_provider,
    node_config,
    real_node,
    running_edge,
)
from iop_edge.api.tenant_charge import Charge


def layout(tenants: str, *extra: str, **knobs: Any) -> EdgeLayout:
    """The harness layout with ``tenants: [...]`` (flow style, one line), ``extra`` top-level lines and
    :class:`EdgeLayout`'s ``knobs``."""
    return EdgeLayout(**knobs, extra=(f"tenants: [{tenants}]", *extra))


TWO = "{name: chat, weight: 1, api_keys: [chat-key]}, {name: batch, weight: 2, max_queue: 2, api_keys: [batch-key]}"


def key(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {name}"}


async def post(
    edge: Edge, results: dict[str, httpx.Response], name: str, headers: dict[str, str], **fields: Any
) -> None:
    results[name] = await edge.chat(FAST, name, headers=headers, **fields)


def tenant_rows(edge: Edge) -> dict[str, Any]:
    return {t.name: t for t in edge.service.admission.snapshot(count=0).tenants}


async def answer_next(node: FakeNode, order: list[str], *, usage: int | None = None) -> None:
    run = await node.next_run()
    order.append(run.body["messages"][0]["content"])
    if usage is None:
        await node.answer(run)
    else:
        response = chat_response("ok")
        response["usage"] = {"prompt_tokens": 1, "completion_tokens": usage - 1, "total_tokens": usage}
        await node.send_json(run.run_id, response)
        await node.send(RunEnd(run.run_id, "ok"))


@pytest.mark.req("tenant-edge")
async def test_each_tenant_gets_its_own_429_and_the_others_queue(tmp_path: Path) -> None:
    """A flooding tenant at its max_queue gets 429 tenant_max_queue with its Retry-After; the other
    tenant still queues and is served; /status and /metrics show it per tenant."""
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout(TWO)) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            order: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, edge, results, "c0", key("chat-key"))
                first = await node.next_run()
                for i in range(2):
                    nursery.start_soon(post, edge, results, f"b{i}", key("batch-key"))
                await eventually(lambda: edge.queue_depth == 2)
                refused = await edge.chat(FAST, "b-over", headers=key("batch-key"))
                assert refused.status_code == 429
                error = refused.json()["error"]
                assert (error["code"], error["type"]) == ("tenant_max_queue", "rate_limit_error")
                assert "batch" in error["message"]
                assert int(refused.headers["retry-after"]) >= 1
                nursery.start_soon(post, edge, results, "c1", key("chat-key"))  # chat is not refused
                await eventually(lambda: edge.queue_depth == 3)
                rows = tenant_rows(edge)
                assert (rows["batch"].waiting, rows["chat"].waiting, rows["chat"].in_flight) == (2, 1, 1)
                status = await edge.status()
                by_name = {t["name"]: t for t in status["tenants"]}
                assert by_name["batch"]["waiting"] == 2 and by_name["batch"]["weight"] == 2
                assert by_name["chat"]["in_flight"] == 1
                assert set(by_name) == {"chat", "batch", "default"}
                text = (await edge.http.get("/metrics")).text
                assert 'iop_tenant_rejected_total{code="tenant_max_queue",tenant="batch"} 1.0' in text
                assert 'iop_tenant_waiting{tenant="batch"} 2.0' in text
                assert 'iop_tenant_weight{tenant="batch"} 2.0' in text
                await node.answer(first)
                for _ in range(3):
                    await answer_next(node, order)
            assert {name: r.status_code for name, r in results.items()} == dict.fromkeys(["c0", "b0", "b1", "c1"], 200)
            await edge.assert_drained()


@pytest.mark.req("tenant-edge")
async def test_grants_follow_the_weights_and_keys_choose_the_tenant(tmp_path: Path) -> None:
    """Both tenants backlogged, weights 1:2: of 6 grants, batch gets 4 and chat 2; a request without a key
    under API keys is refused 401, a top-level key charges the default tenant."""
    tenants = "{name: chat, weight: 1, api_keys: [chat-key]}, {name: batch, weight: 2, api_keys: [batch-key]}"
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout(tenants, "api_keys: [plain-key]", max_queue=16)) as edge:
            assert (await edge.chat(FAST, "nokey")).status_code == 401
            async with fake_node(edge) as node:
                results: dict[str, httpx.Response] = {}
                order: list[str] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(post, edge, results, "hold", key("plain-key"))
                    hold = await node.next_run()
                    for i in range(12):  # one at a time: the arrival order is known
                        name, owner = (f"c{i // 2}", "chat-key") if i % 2 == 0 else (f"b{i // 2}", "batch-key")
                        nursery.start_soon(post, edge, results, name, key(owner))
                        await eventually(lambda i=i: edge.queue_depth == i + 1)
                    assert tenant_rows(edge)["default"].in_flight == 1
                    await node.answer(hold)
                    for _ in range(12):
                        await answer_next(node, order)
            first_six = order[:6]
            assert sum(name.startswith("b") for name in first_six) == 4, order
            assert [n for n in order if n.startswith("c")] == [f"c{i}" for i in range(6)]  # FIFO within a tenant
            assert all(r.status_code == 200 for r in results.values())
            rows = tenant_rows(edge)
            assert (rows["chat"].grants, rows["batch"].grants, rows["default"].grants) == (6, 6, 1)


@pytest.mark.req("tenant-edge")
async def test_a_sheddable_band_is_refused_first_when_the_queue_is_full(tmp_path: Path) -> None:
    """Queue full (max_queue 1): a chat newcomer evicts the waiting batch request (band -1): 429 tenant_shed."""
    tenants = "{name: chat, api_keys: [chat-key]}, {name: batch, priority: -1, api_keys: [batch-key]}"
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout(tenants, max_queue=1)) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            order: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, edge, results, "c0", key("chat-key"))
                first = await node.next_run()
                nursery.start_soon(post, edge, results, "b0", key("batch-key"))
                await eventually(lambda: edge.queue_depth == 1)
                nursery.start_soon(post, edge, results, "c1", key("chat-key"))
                await eventually(lambda: "b0" in results)
                await node.answer(first)
                await answer_next(node, order)
            assert results["b0"].status_code == 429
            assert results["b0"].json()["error"]["code"] == "tenant_shed"
            assert "retry-after" in results["b0"].headers
            assert (results["c0"].status_code, results["c1"].status_code, order) == (200, 200, ["c1"])


@pytest.mark.req("tenant-edge")
async def test_token_cost_is_reserved_then_settled_with_the_reported_usage(tmp_path: Path) -> None:
    """tenant_cost: tokens: the reserve is prompt/4 + max_tokens; after the run the tenant is charged
    the backend's usage.total_tokens (whole and streamed answers)."""
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout(TWO, "tenant_cost: tokens")) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            order: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(post, edge, results, "c" * 40, key("chat-key"), max_tokens=90))
                run = await node.next_run()
                await eventually(lambda: tenant_rows(edge)["chat"].in_flight == 1)
                leases = [t for t in edge.service.admission.snapshot(count=0).tenants if t.name == "chat"]
                assert leases[0].cost_charged == 100  # 40 chars / 4 + 90: the reserve
                order.append(run.body["messages"][0]["content"])
                response = chat_response("ok")
                response["usage"] = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
                await node.send_json(run.run_id, response)
                await node.send(RunEnd(run.run_id, "ok"))
            await eventually(lambda: tenant_rows(edge)["chat"].in_flight == 0)
            assert tenant_rows(edge)["chat"].cost_charged == 7
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, edge, results, "b", key("batch-key"))
                await answer_next(node, order, usage=11)
            assert results["b"].status_code == 200
            await eventually(lambda: tenant_rows(edge)["batch"].in_flight == 0)
            assert tenant_rows(edge)["batch"].cost_charged == 11


@pytest.mark.req("tenant-edge")
async def test_the_tenant_header_is_honoured_only_when_configured(tmp_path: Path) -> None:
    async with running_edge(tmp_path, layout(TWO, "tenant_header: x-iop-tenant")) as edge, fake_node(edge) as node:
        with trio.fail_after(20):
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, edge, results, "h", {**key("chat-key"), "x-iop-tenant": "batch"})
                await answer_next(node, [])
            assert tenant_rows(edge)["batch"].grants == 1 and tenant_rows(edge)["chat"].grants == 0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, edge, results, "u", {**key("chat-key"), "x-iop-tenant": "made-up"})
                await answer_next(node, [])
            rows = tenant_rows(edge)
            assert "made-up" not in rows and rows["default"].grants == 1  # never made up from input


@pytest.mark.req("tenant-edge")
async def test_a_reload_changes_weights_and_keys_keeping_leases_and_waiters(tmp_path: Path) -> None:
    """Reload while one lease runs and a waiter queues: both are served; the new weight, quota and key
    map are in force (the chat key now belongs to batch)."""
    # The fake node sends no heartbeats, and the waiter must outlast the reader:
    quiet = {"heartbeat_timeout_ms": 600_000, "queue_timeout_ms": 600_000}
    # The reader child runs at idle priority: on a loaded box it may take long (bounded here).
    with trio.fail_after(240):
        async with running_edge(tmp_path, layout(TWO, **quiet)) as edge, fake_node(edge) as node:
            edge.http.timeout = httpx.Timeout(240)  # the requests wait out the reload
            results: dict[str, httpx.Response] = {}
            order: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, edge, results, "c0", key("chat-key"))
                first = await node.next_run()
                nursery.start_soon(post, edge, results, "c1", key("chat-key"))
                await eventually(lambda: edge.queue_depth == 1)
                moved = "{name: chat, weight: 3, api_keys: [other-key]}, {name: batch, max_queue: 1, api_keys: [batch-key, chat-key]}"
                edge.rewrite(layout(moved, **quiet))
                assert await edge.service.reload() == []  # what SIGHUP and POST /admin/reload run
                rows = tenant_rows(edge)
                assert (rows["chat"].weight, rows["chat"].in_flight, rows["chat"].waiting) == (3, 1, 1)
                assert rows["batch"].max_queue == 1
                nursery.start_soon(post, edge, results, "now-batch", key("chat-key"))
                await eventually(lambda: tenant_rows(edge)["batch"].waiting == 1)
                over = await edge.chat(FAST, "over", headers=key("chat-key"))
                assert over.json()["error"]["code"] == "tenant_max_queue"
                await node.answer(first)
                await answer_next(node, order)
                await answer_next(node, order)
            assert sorted(order) == ["c1", "now-batch"]
            assert {results[n].status_code for n in ("c0", "c1", "now-batch")} == {200}
            await edge.assert_drained()


@pytest.mark.req("tenant-edge")
async def test_a_stream_is_settled_with_the_usage_its_last_chunk_reports(tmp_path: Path) -> None:
    """Token cost on a stream: the relay reads the chunks for ``usage`` (e.g. include_usage); a failed
    attempt before any byte would settle 0, an answer without usage keeps its reserve."""
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout(TWO, "tenant_cost: tokens")) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(post, edge, results, "s", key("chat-key"), stream=True, max_tokens=9)
                )
                run = await node.next_run()
                assert run.stream
                last = chat_chunk("done")
                last["usage"] = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
                await node.send_json(run.run_id, chat_chunk("he"))
                await node.send_json(run.run_id, last)
                await node.send(RunEnd(run.run_id, "ok"))
            assert results["s"].status_code == 200 and "done" in results["s"].text
            await eventually(lambda: tenant_rows(edge)["chat"].in_flight == 0)
            assert tenant_rows(edge)["chat"].cost_charged == 5
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(post, edge, results, "n", key("batch-key"), stream=True, max_tokens=9)
                )
                await answer_next(node, [])  # no usage in the answer
            await eventually(lambda: tenant_rows(edge)["batch"].in_flight == 0)
            assert tenant_rows(edge)["batch"].cost_charged == 9  # "n" is 1 char (0 tokens) + max_tokens 9


@pytest.mark.req("tenant-edge")
async def test_through_a_real_node_each_tenant_key_gets_its_own_code_and_grants(tmp_path: Path) -> None:
    """Edge + an in-process Node (EdgeClient, NodeRuntime, the mock adapter at 200 ms a run): batch's key at
    its max_queue gets 429 tenant_max_queue while chat's requests queue and run; the grants per tenant add up."""
    with trio.fail_after(30):
        async with running_edge(tmp_path, layout(TWO)) as edge:
            config = node_config(edge, "node-a", [mock_provider("gpu0", latency_ms=200)])
            async with real_node(edge, config):
                results: dict[str, httpx.Response] = {}
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(post, edge, results, "c0", key("chat-key"))
                    await eventually(lambda: tenant_rows(edge)["chat"].in_flight == 1)
                    for i, (name, owner) in enumerate([("b0", "batch-key"), ("b1", "batch-key"), ("c1", "chat-key")]):
                        nursery.start_soon(post, edge, results, name, key(owner))
                        await eventually(lambda i=i: edge.queue_depth == i + 1)
                    refused = await edge.chat(FAST, "b2", headers=key("batch-key"))
                    nursery.start_soon(post, edge, results, "c2", key("chat-key"))
                assert refused.status_code == 429
                assert refused.json()["error"]["code"] == "tenant_max_queue"
                assert {name: r.status_code for name, r in results.items()} == dict.fromkeys(
                    ["c0", "b0", "b1", "c1", "c2"], 200
                )
                rows = tenant_rows(edge)
                assert (rows["chat"].grants, rows["batch"].grants) == (3, 2)
                await edge.assert_drained()


@pytest.mark.req("tenant-edge")
async def test_events_carry_the_tenant(tmp_path: Path) -> None:
    """Lease events name the tenant the lease is charged to; a tenant's refusal names it too."""
    one = "{name: batch, max_queue: 1, api_keys: [batch-key]}"
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout(one)) as edge, fake_node(edge) as node:
            async with edge.service.admission.subscribe() as events:
                results: dict[str, httpx.Response] = {}
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(post, edge, results, "b0", key("batch-key"))
                    first = await node.next_run()
                    nursery.start_soon(post, edge, results, "b1", key("batch-key"))
                    await eventually(lambda: edge.queue_depth == 1)
                    assert (await edge.chat(FAST, "b2", headers=key("batch-key"))).status_code == 429
                    await node.answer(first)
                    await answer_next(node, [])
                seen = []
                while True:
                    try:
                        event = events.receive_nowait()
                    except trio.WouldBlock:
                        break
                    seen.append((event.kind, event.tenant))
            assert ("granted", "batch") in seen and ("released", "batch") in seen
            assert ("rejected", "batch") in seen and ("queued", "batch") in seen


@pytest.mark.req("tenant-edge")
async def test_a_retry_is_reserved_anew_after_its_failed_attempt_settled_at_zero(tmp_path: Path) -> None:
    """Token cost and failover: node-a fails before any byte (the attempt settles at 0), the retry on
    node-b holds the request's reserve while it runs, then settles at the reported usage."""
    with trio.fail_after(20):
        async with (
            running_edge(
                tmp_path, EdgeLayout(retry="{max_attempts: 2}", extra=(f"tenants: [{TWO}]", "tenant_cost: tokens"))
            ) as edge,
            fake_node(edge, "node-a") as a,
            fake_node(edge, "node-b", providers=("gpu1",)) as b,
        ):
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                body = {"model": BIG, "messages": [{"role": "user", "content": "x" * 8}], "max_tokens": 20}

                async def ask() -> None:
                    results["r"] = await edge.http.post("/v1/chat/completions", json=body, headers=key("chat-key"))

                nursery.start_soon(ask)
                run = await a.next_run()
                await a.send(RunEnd(run.run_id, "error", "upstream_error", "boom", 500))
                retry = await b.next_run()
                await eventually(lambda: tenant_rows(edge)["chat"].in_flight == 1)
                assert tenant_rows(edge)["chat"].cost_charged == 22  # 8 chars / 4 + 20: the reserve, once
                response = chat_response("ok")
                response["usage"] = {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
                await b.send_json(retry.run_id, response)
                await b.send(RunEnd(retry.run_id, "ok"))
            assert results["r"].status_code == 200 and results["r"].headers["x-iop-attempts"] == "2"
            await eventually(lambda: tenant_rows(edge)["chat"].in_flight == 0)
            assert tenant_rows(edge)["chat"].cost_charged == 6


WHOLE_ANSWER = b'{"choices":[{"text":"usage x"}],"usage":{"prompt_tokens":2,"total_tokens":1234}}'
"""A whole answer with its usage last; the word ``usage`` in its text too."""


@pytest.mark.req("tenant-edge")
@pytest.mark.parametrize("usage_first", [False, True], ids=["usage-last", "usage-first"])
def test_usage_is_read_from_the_pieces_of_a_whole_answer_wherever_they_are_cut(usage_first: bool) -> None:
    """A whole answer is relayed as the pieces its records brought, never joined: the reported total is
    found whatever two cuts split it, a cut inside ``"usage"`` or inside the number included."""
    whole = b'{"usage":{"total_tokens":1234},"text":"xyz"}' if usage_first else WHOLE_ANSWER
    reference = Charge(None, 1.0, tokens=True)
    reference.scan(whole)
    assert reference.used == 1234
    for first in range(len(whole) + 1):
        for second in range(first, len(whole) + 1):
            charge = Charge(None, 1.0, tokens=True)
            charge.scan_parts([whole[:first], whole[first:second], whole[second:]])
            assert charge.used == 1234, (first, second)
