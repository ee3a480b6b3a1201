"""[ha-election] Two Edges with ``ha:`` on one etcd: the standby refuses, says who leads, and takes over."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import trio
from rich.console import Console
from tests.edge.harness import BIG

from iop_edge.status import EdgeStatus, parse_status
from iop_edge.status_cli import render_status

from .etcd_server import EtcdServer
from .harness import BOUND_S, leader_and_standby, leads, until

pytestmark = pytest.mark.req("ha-election")


def rendered(status: EdgeStatus) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_status(status))
    return console.export_text()


async def test_the_standby_refuses_with_retry_after_and_the_leader_then_takes_over(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            a, stop_a, b, stop_b = await leader_and_standby(nursery, etcd, tmp_path)
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
