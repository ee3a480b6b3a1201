"""[health-probe] The Edge's side of the node's ``provider_health``: each report goes to the admission
core (which decides: ``stalled`` ejects), shows in ``/status``, is tied to its connection; a node
sends it only on a connection of a version that has it (``iop_wire.speaks``: v6), its ``engine`` only on
one of v7 (``iop_wire.health_for``), and a node of an older version that sends what its version lacks
breaks the protocol."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from trio_websocket import ConnectionClosed

from edge.harness import EdgeLayout, fake_node, running_edge
from iop_edge.nodes.health_reports import apply_report
from iop_wire import CLOSE_PROTOCOL_ERROR, OLDEST_PROTOCOL, EngineView, ProviderHealth, speaks

pytestmark = pytest.mark.req("health-probe")


async def test_a_report_feeds_the_core_and_shows_in_status(tmp_path: Path) -> None:
    """ready with the backend's own 2 slots: gpu0 at capacity 2; stalled: ejected, with the node's
    reason in /status; a report for a provider the node did not register, or from the link of an
    older generation, changes nothing."""
    with trio.fail_after(10):
        async with running_edge(tmp_path, EdgeLayout(gpu0_capacity=4)) as edge, fake_node(edge, "node-a") as node:
            assert node.registered is not None
            (link,) = edge.service.registry.links()
            apply_report(link, ProviderHealth("gpu0", "ready", "", 2))
            assert edge.provider("node-a", "gpu0")["effective_capacity"] == 2
            apply_report(link, ProviderHealth("gpu9", "stalled", "no such provider"))
            apply_report(link, ProviderHealth("gpu0", "stalled", "no byte from the backend for 6.0 s"))
            row = next(p for p in (await edge.status())["providers"] if p["provider_id"] == "gpu0")
            assert (row["health"], row["reported"], row["reported_capacity"]) == ("ejected", "stalled", 2)
            assert row["report_reason"] == "no byte from the backend for 6.0 s"
            assert row["ejection_left"] > 0
            link.generation -= 1  # the link of an older connection
            apply_report(link, ProviderHealth("gpu0", "not_ready", "loading"))
            link.generation += 1
            assert edge.provider("node-a", "gpu0")["reported"] == "stalled"


async def test_a_report_on_the_wire_reaches_the_core(tmp_path: Path) -> None:
    """A v6 node's provider_health frame: the Edge's link applies it (gpu0 ejected, the reason shown)."""
    assert speaks(OLDEST_PROTOCOL, ProviderHealth)
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge, "node-a", protocol=OLDEST_PROTOCOL) as node:
            await node.send(ProviderHealth("gpu0", "not_ready", "loading (Loading model)"))
            while edge.provider("node-a", "gpu0")["reported"] != "not_ready":
                await trio.sleep(0.01)
            row = edge.provider("node-a", "gpu0")
            assert (row["health"], row["report_reason"]) == ("ejected", "loading (Loading model)")
            await node.send(ProviderHealth("gpu0", "ready"))
            while edge.provider("node-a", "gpu0")["health"] != "online":
                await trio.sleep(0.01)


async def test_a_node_below_the_engine_version_that_reports_the_engine_breaks_the_protocol(tmp_path: Path) -> None:
    """On a v6 connection ``provider_health.engine`` does not exist: the Edge closes it with 1002,
    nothing applied (a v6 node's report without it is read: the test above)."""
    assert speaks(OLDEST_PROTOCOL, ProviderHealth)
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge, "node-a", protocol=OLDEST_PROTOCOL) as node:
            await node.send(ProviderHealth("gpu0", "stalled", "hung", engine=EngineView(kv_use=0.5)))
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    await node.receive()
            assert closed.value.reason.code == CLOSE_PROTOCOL_ERROR
            assert edge.provider("node-a", "gpu0")["reported"] == ""
