"""The token ledger at the Edge ([token-ledger]): a request reserves its prompt's bound (UTF-8 bytes
and the template's tokens) plus ``max_tokens`` on a provider that admits by tokens, bounded by the window; ``/status``
and the metrics show what is reserved; a request whose tokens do not fit waits for one that ends.

A real Edge on 127.0.0.1 with a :class:`~edge.harness.FakeNode` holding gpu0 (capacity 2, window
8,192, ``admit_by: both``: its 8,192 tokens are a budget): the test decides when each run ends.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from rich.console import Console

from edge.harness import FAST, EdgeLayout, RunEnd, chat_chunk, eventually, fake_node, running_edge, start_chat
from iop_admission import ProviderKey
from iop_edge import status_cli
from iop_edge.api.request_body import UNBOUNDED_OUTPUT, context_tokens
from iop_edge.status import parse_status
from iop_edge.ui.view import build_view
from iop_wire import EngineView, ProviderHealth

pytestmark = pytest.mark.req("token-ledger")

GPU0 = ProviderKey("node-a", "gpu0")


def test_the_reservation_is_the_prompt_bound_plus_max_tokens() -> None:
    chat = {"messages": [{"role": "user", "content": "c" * 40}], "max_tokens": 90}
    assert context_tokens("chat/completions", chat) == 55 + 90  # 40 bytes + 1, "user" 4 + 1, 4 + 5 template tokens
    assert context_tokens("completions", {"prompt": "p" * 8}) == 11 + UNBOUNDED_OUTPUT  # no max_tokens: the window
    assert context_tokens("embeddings", {"input": ["e" * 16, "f" * 16]}) == 38  # 2 x (16 + 1 + 2)


async def test_reserved_tokens_show_in_status_and_metrics_and_a_big_request_waits(tmp_path: Path) -> None:
    layout = EdgeLayout(gpu0_capacity=2, gpu0_admit_by="both")
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "c" * 40, FAST, max_tokens=90)
                first = await node.next_run()
                await eventually(lambda: edge.provider("node-a", "gpu0")["reserved_tokens"] == 145)
                (gpu0,) = [p for p in (await edge.status())["providers"] if p["provider_id"] == "gpu0"]
                assert (gpu0["token_budget"], gpu0["reserved_tokens"], gpu0["token_headroom"]) == (8192, 145, 0)
                metrics = (await edge.http.get("/metrics")).text
                assert 'iop_reserved_tokens{node="node-a",provider="gpu0"} 145.0' in metrics
                assert 'iop_token_budget{node="node-a",provider="gpu0"} 8192.0' in metrics
                # No max_tokens: the whole window, which does not fit beside the 103: it waits.
                start_chat(nursery, edge, results, "big", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                assert edge.provider("node-a", "gpu0")["in_flight"] == 1  # a slot is free, the tokens are not
                await node.answer(first)
                second = await node.next_run()
                await eventually(lambda: edge.provider("node-a", "gpu0")["reserved_tokens"] == 8192)
                await node.answer(second)
            assert [r.status_code for r in results.values()] == [200, 200]
            await edge.assert_drained()
            assert edge.provider("node-a", "gpu0")["reserved_tokens"] == 0


async def test_the_usage_an_answer_reports_settles_the_reservation_before_the_run_ends(tmp_path: Path) -> None:
    """The stream's usage chunk lowers the reservation at once (the lease still held: the run has not
    ended); it is back to 0 after the release."""
    layout = EdgeLayout(gpu0_capacity=2, gpu0_admit_by="both")
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "s" * 40, FAST, max_tokens=90, stream=True)
                streamed = await node.next_run()
                await eventually(lambda: edge.provider("node-a", "gpu0")["reserved_tokens"] == 145)
                last = chat_chunk("done")
                last["usage"] = {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}
                await node.send_json(streamed.run_id, chat_chunk("he"))
                await node.send_json(streamed.run_id, last)
                await eventually(lambda: edge.provider("node-a", "gpu0")["reserved_tokens"] == 20)
                assert edge.provider("node-a", "gpu0")["in_flight"] == 1  # settled, not released
                await node.send(RunEnd(streamed.run_id, "ok"))
            answer = results["s" * 40]
            assert answer.status_code == 200 and "done" in answer.text
            await edge.assert_drained()
            assert edge.provider("node-a", "gpu0")["reserved_tokens"] == 0


async def test_the_engines_view_shows_beside_the_reservations_and_cuts_the_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A v7 node's ready report with its engine's view: /status, the metrics, the page's rows and
    `iop status` show the engine's KV use and preemptions beside the reservations; the use the
    reservations do not explain (0.5 of 8,192 = 4,096 tokens held, none reserved) cuts the budget to
    4,096 (a WARNING line in the Edge's log), so a request of the whole window waits; the engine's
    next report (0.0) gives it back (an INFO line) and the request runs."""
    caplog.set_level(logging.INFO, "iop_edge.nodes")
    layout = EdgeLayout(gpu0_capacity=2, gpu0_admit_by="both")
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge) as node:
            await node.send(ProviderHealth("gpu0", "ready", engine=EngineView(kv_use=0.5, preemptions=2, running=1)))
            await eventually(lambda: edge.provider("node-a", "gpu0")["effective_token_budget"] == 4096)
            (gpu0,) = [p for p in (await edge.status())["providers"] if p["provider_id"] == "gpu0"]
            assert (gpu0["reported_kv_use"], gpu0["reported_preemptions"], gpu0["reserved_tokens"]) == (0.5, 2, 0)
            metrics = (await edge.http.get("/metrics")).text
            assert 'iop_effective_token_budget{node="node-a",provider="gpu0"} 4096.0' in metrics
            assert 'iop_engine_kv_tokens{node="node-a",provider="gpu0"} 4096.0' in metrics
            assert 'iop_engine_preemptions{node="node-a",provider="gpu0"} 2.0' in metrics
            assert "0/4096 of 8192 kv 50% pre 2" in _rendered(await edge.status())
            page = _page_row(edge)
            assert (page["effective_token_budget"], page["kv_use"], page["preemptions"]) == (4096, 0.5, 2)
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "big", FAST)  # no max_tokens: the window, 8,192
                await eventually(lambda: edge.queue_depth == 1)
                await node.send(ProviderHealth("gpu0", "ready", engine=EngineView(kv_use=0.0, preemptions=2)))
                await node.answer(await node.next_run())
            assert [r.status_code for r in results.values()] == [200]
            assert edge.provider("node-a", "gpu0")["effective_token_budget"] == 8192
            await edge.assert_drained()
    budget_lines = [(r.levelname, r.getMessage()) for r in caplog.records if "token budget" in r.getMessage()]
    assert budget_lines == [
        (
            "WARNING",
            f"provider {GPU0}: token budget cut to 4096 of 8192 tokens by the engine's report "
            "(its cache holds more than was reserved, or it preempted)",
        ),
        ("INFO", f"provider {GPU0}: token budget back to 8192 tokens (the engine reports no pressure)"),
    ]


def _rendered(document: dict[str, Any]) -> str:
    """`iop status`'s output for a /status ``document``, as text."""
    console = Console(width=200, record=True)
    console.print(status_cli.render_status(parse_status(document)))
    return console.export_text()


def _page_row(edge: Any) -> dict[str, Any]:
    """gpu0's row of the page's view (what the page's capacity cell and its tooltip read)."""
    admission = edge.service.admission
    rows = build_view(admission.snapshot(), (), admission.config.models)["providers"]["rows"]
    (row,) = [r for r in rows if r["provider"] == "gpu0"]
    return row
