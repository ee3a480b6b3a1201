"""What the tests of Edges with ``ha:`` on one etcd share: their layout, serving one in its own task,
waiting for a condition, and a leader with a standby beside it."""

from __future__ import annotations

from pathlib import Path

import trio
from tests.edge.harness import Edge, EdgeLayout, running_edge

from .etcd_server import EtcdServer

BOUND_S = 30
"""Seconds a test with Edges on etcd may take (its ``fail_after``)."""


def layout(etcd: EtcdServer, name: str) -> EdgeLayout:
    """An Edge of the HA group on ``etcd``, advertised as ``name`` (TTL 2 s, polled every 50 ms)."""
    return EdgeLayout(extra=(f"ha: {{endpoints: [{etcd.url}], advertise: {name}, ttl_s: 2, poll_interval_ms: 50}}",))


async def until(condition: object) -> None:
    """Poll ``condition`` every 20 ms until it holds (bounded by the caller's ``fail_after``)."""
    assert callable(condition)
    while not condition():
        await trio.sleep(0.02)


def leads(edge: Edge) -> bool:
    """Whether ``edge`` leads its group (and admits)."""
    return edge.service.ha is not None and edge.service.ha.admits()


async def serve(
    path: Path, edge_layout: EdgeLayout, *, task_status: trio.TaskStatus[tuple[Edge, trio.CancelScope]]
) -> None:
    """Serve an Edge in its own task until the reported scope is cancelled."""
    with trio.CancelScope() as scope:
        async with running_edge(path, edge_layout) as edge:
            task_status.started((edge, scope))
            await trio.sleep_forever()


async def leader_and_standby(
    nursery: trio.Nursery, etcd: EtcdServer, tmp_path: Path
) -> tuple[Edge, trio.CancelScope, Edge, trio.CancelScope]:
    """``edge-a``, once it leads, and ``edge-b`` beside it (each in a folder of its own under
    ``tmp_path``), with the scopes that stop them."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, stop_a = await nursery.start(serve, tmp_path / "a", layout(etcd, "edge-a"))
    await until(lambda: leads(a))
    b, stop_b = await nursery.start(serve, tmp_path / "b", layout(etcd, "edge-b"))
    return a, stop_a, b, stop_b
