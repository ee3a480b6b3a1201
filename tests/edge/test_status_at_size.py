"""``/status`` filters and per-node metrics, for large fleets.

[status-at-size] ``/status?node=`` and ``/status?model=`` return only that part;
``metrics_per_provider: false`` labels the provider gauges by node only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from edge.harness import BIG, FAST, EdgeLayout, fake_node, running_edge


def _keys(document: dict[str, object]) -> tuple[list[tuple[str, str]], list[str]]:
    providers = document["providers"]
    nodes = document["nodes"]
    assert isinstance(providers, list) and isinstance(nodes, list)
    return [(p["node_id"], p["provider_id"]) for p in providers], [n["node_id"] for n in nodes]


@pytest.mark.req("status-at-size")
async def test_status_filters_by_node_and_by_model(tmp_path: Path) -> None:
    """[status-at-size] ?node= keeps that node and its providers; ?model= the providers the key
    lists and their nodes; both: the intersection; an unknown id: empty lists, 200."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge):

            async def get(query: str) -> tuple[list[tuple[str, str]], list[str]]:
                response = await edge.http.get(f"/status{query}")
                assert response.status_code == 200
                return _keys(response.json())

            assert await get("") == ([("node-a", "gpu0"), ("node-b", "gpu1")], ["node-a", "node-b"])
            assert await get("?node=node-b") == ([("node-b", "gpu1")], ["node-b"])
            assert await get(f"?model={FAST}") == ([("node-a", "gpu0")], ["node-a"])
            assert await get(f"?model={BIG}&node=node-a") == ([("node-a", "gpu0")], ["node-a"])
            assert await get("?model=nope") == ([], [])
            assert await get("?node=nope") == ([], [])
            filtered = (await edge.http.get("/status?node=node-a")).json()
            assert filtered["nodes"][0]["connected"] is True
            assert filtered["queue_depth"] == 0


@pytest.mark.req("status-at-size")
async def test_metrics_per_node_instead_of_per_provider(tmp_path: Path) -> None:
    """[status-at-size] metrics_per_provider: false -> one series per node and gauge."""
    layout = EdgeLayout(extra=("metrics_per_provider: false",))
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge):
            text = (await edge.http.get("/metrics")).text
            assert 'iop_capacity{node="node-a"} 1.0' in text
            assert 'iop_connected{node="node-a"} 1.0' in text
            assert 'iop_connected{node="node-b"} 0.0' in text
            assert 'provider="gpu0"' not in text
        async with running_edge(tmp_path) as edge:
            assert 'iop_capacity{node="node-a",provider="gpu0"} 1.0' in (await edge.http.get("/metrics")).text
