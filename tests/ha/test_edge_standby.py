"""[ha-election] Two Edges with ``ha:`` on one etcd: the standby refuses, says who leads, and takes over."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import trio
from rich.console import Console
from tests.edge.harness import BIG, Edge, EdgeLayout, running_edge

from iop_edge.status import EdgeStatus, parse_status
from iop_edge.status_cli import render_status

from .etcd_server import EtcdServer

pytestmark = pytest.mark.req("ha-election")

BOUND_S = 30


def layout(etcd: EtcdServer, name: str) -> EdgeLayout:
    return EdgeLayout(extra=(f"ha: {{endpoints: [{etcd.url}], advertise: {name}, ttl_s: 2, poll_interval_ms: 50}}",))


async def until(condition: object) -> None:
    assert callable(condition)
    while not condition():  # bounded by the caller's fail_after
        await trio.sleep(0.02)


def rendered(status: EdgeStatus) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_status(status))
    return console.export_text()


def leads(edge: Edge) -> bool:
    return edge.service.ha is not None and edge.service.ha.admits()


async def serve(
    path: Path, edge_layout: EdgeLayout, *, task_status: trio.TaskStatus[tuple[Edge, trio.CancelScope]]
) -> None:
    """Serve an Edge in its own task until the reported scope is cancelled."""
    with trio.CancelScope() as scope:
        async with running_edge(path, edge_layout) as edge:
            task_status.started((edge, scope))
            await trio.sleep_forever()


async def test_the_standby_refuses_with_retry_after_and_the_leader_then_takes_over(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            (tmp_path / "a").mkdir()
            (tmp_path / "b").mkdir()
            a, stop_a = await nursery.start(serve, tmp_path / "a", layout(etcd, "edge-a"))
            await until(lambda: leads(a))
            b, stop_b = await nursery.start(serve, tmp_path / "b", layout(etcd, "edge-b"))
            assert b.service.ha is not None
            await until(lambda: b.service.ha is not None and b.service.ha.leadership.leader == "edge-a")
            epoch = b.service.ha.leadership.epoch

            refused = await b.chat(BIG)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "not_leader"
            assert refused.headers["retry-after"] == "2"
            assert refused.headers["x-iop-leader"] == "edge-a"
            ready = await b.http.get("/readyz")
            assert (ready.status_code, ready.json()["status"], ready.json()["leader"]) == (503, "not leader", "edge-a")
            assert (await a.http.get("/readyz")).status_code == 200

            # /status, iop status and /metrics say who leads, at which epoch.
            status = parse_status((await b.http.get("/status")).json())
            assert status.ha is not None
            assert (status.ha.role, status.ha.leader, status.ha.epoch) == ("standby", "edge-a", epoch)
            assert f"HA: this Edge stands by, leader edge-a, epoch {epoch}" in rendered(status)
            metrics = (await a.http.get("/metrics")).text
            assert "iop_ha_leader 1.0" in metrics
            assert f"iop_ha_epoch {float(epoch)}" in metrics
            assert "iop_ha_elections_won_total 1.0" in metrics

            stop_a.cancel()  # a stops: it revokes its lease, b wins without waiting out the TTL
            await until(lambda: leads(b))
            assert b.service.ha.leadership.epoch > epoch
            assert (await b.http.get("/readyz")).status_code == 200
            stop_b.cancel()
