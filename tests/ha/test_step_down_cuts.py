"""[ha-step-down] A leader cut off from etcd answers its queued and running requests 503 at once: the
queued ones ``not_leader`` (they never ran), the running ones ``leader_stepped_down`` (they may have)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from tests.edge.harness import BIG, FAST, EdgeLayout, fake_node, running_edge, start_chat

from .etcd_server import EtcdServer

pytestmark = pytest.mark.req("ha-step-down")


async def test_stepping_down_answers_queued_and_running_requests_503_at_once(etcd: EtcdServer, tmp_path: Path) -> None:
    ha = f"ha: {{endpoints: [{etcd.url}], advertise: edge-a, ttl_s: 2, poll_interval_ms: 50}}"
    with trio.fail_after(30):
        async with running_edge(tmp_path, EdgeLayout(extra=(ha,))) as edge, fake_node(edge) as node:
            assert edge.service.ha is not None
            while not edge.service.ha.admits():  # bounded by fail_after
                await trio.sleep(0.02)
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "running", BIG)
                await node.next_run()
                start_chat(nursery, edge, results, "queued", FAST)
                while edge.queue_depth != 1:  # bounded by fail_after
                    await trio.sleep(0.01)
                etcd.pause()  # renewals hang: the leader steps down by its own count
            # Both answered when the leader stepped down, long before the queue timeout (20 s).
            assert edge.service.ha.leadership.step_downs == 1
            for name, code in (("running", "leader_stepped_down"), ("queued", "not_leader")):
                assert results[name].status_code == 503, name
                assert results[name].json()["error"]["code"] == code, name
                assert results[name].headers["retry-after"] == "2"
            await edge.assert_drained()
