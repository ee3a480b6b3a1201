"""``deploy/grafana/iop-edge.json`` cannot drift from the code: every metric it queries is served.

A live Edge (with a real in-process node that served a request, was refused one and then left,
so that the labelled series exist) is scraped on ``GET /metrics``. Every metric name in every
panel's PromQL must be a series of that scrape, and every label a panel groups by must be a
label of the series it groups.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from edge.harness import BIG, eventually, mock_provider, node_config, real_node, running_edge

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "iop-edge.json"
METRIC = re.compile(r"\biop_[a-z0-9_]+\b")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))  # a collapsed row keeps its panels inside
    return [p for p in found if p["type"] != "row"]


def test_dashboard_is_importable_json() -> None:
    """Unique panel ids, a datasource variable, every panel with a grid position and a PromQL target."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] == "iop-edge" and dashboard["title"]
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]


def scraped_series(text: str) -> dict[str, set[str]]:
    """Series name -> the label names seen on it (histograms and counters by their sample names)."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


async def test_every_dashboard_metric_is_served(tmp_path: Path) -> None:
    """Each metric in each panel's PromQL is in a live Edge's /metrics, with the labels it groups by."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    with trio.fail_after(20):
        async with running_edge(tmp_path) as edge:
            async with real_node(edge, node_config(edge, "node-a", [mock_provider("gpu0")])):
                assert (await edge.chat(BIG, max_tokens=2)).status_code == 200
                assert (await edge.chat("no-such-model")).status_code == 404
            await eventually(lambda: not edge.service.admission.is_connected("node-a"))
            text = (await edge.http.get("/metrics")).text
    series = scraped_series(text)
    checked = 0
    for panel in panels(dashboard):
        for target in panel["targets"]:
            names = METRIC.findall(target["expr"])
            assert names, (panel["title"], target["expr"])
            for name in names:
                assert name in series, f"{panel['title']}: {name} is not served by /metrics"
                checked += 1
            for group in GROUPING.findall(target["expr"]):
                for label in filter(None, (part.strip() for part in group.split(","))):
                    assert any(label in series[name] for name in names), f"{panel['title']}: no label {label!r}"
    assert checked >= 20
