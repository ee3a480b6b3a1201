"""[epoch-fencing] The Edge side of epoch fencing: a leader stamps its epoch, announces it, and maps ``stale_epoch``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from tests.edge.harness import BIG, TOKEN_A, TOKEN_B, fake_node, start_chat

from iop_edge.ha import EdgeHa
from iop_wire import OLDEST_PROTOCOL, InFlight, Leader, RunEnd

from .etcd_server import EtcdServer
from .harness import BOUND_S, layout, leads, serve, until

pytestmark = pytest.mark.req("epoch-fencing", "held-elsewhere")


async def test_the_leader_announces_its_epoch_stamps_runs_and_answers_a_stale_refusal_503(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    results: dict[str, httpx.Response] = {}
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            edge, stop = await nursery.start(serve, tmp_path, layout(etcd, "edge-a"))
            await until(lambda: leads(edge))
            assert edge.service.ha is not None
            epoch = edge.service.ha.leadership.epoch
            async with fake_node(edge, "node-b", register=False) as node:
                await node.register(TOKEN_B, ["gpu1"])
                assert await node.receive() == Leader(epoch)  # right after registered, while it leads
                await node.send(InFlight(epoch, (("gpu1", 1),)))  # the previous term's load
                await until(lambda: edge.service.registry.fence.inherited_runs == 1)
                metrics = (await edge.http.get("/metrics")).text
                assert "iop_ha_inherited_runs 1.0" in metrics

                # [held-elsewhere] gpu1 (capacity 1) is busy with a run of the previous term:
                # the new leader queues rather than sending the node a run it would refuse.
                admission = edge.service.admission
                assert admission.snapshot().provider("node-b", "gpu1").in_flight == 1
                start_chat(nursery, edge, results, "served", BIG)
                await until(lambda: admission.queue_depth == 1)
                await node.send(InFlight(epoch, ()))  # that run ended
                run = await node.next_run()
                assert edge.service.registry.fence.inherited_runs == 0
                assert run.epoch == epoch
                await node.answer(run)
                await until(lambda: "served" in results)
                assert results["served"].status_code == 200

                start_chat(nursery, edge, results, "fenced", BIG)
                run = await node.next_run()
                await node.send(RunEnd(run.run_id, "error", "stale_epoch", f"this node has seen epoch {epoch + 9}"))
                await until(lambda: "fenced" in results)
                refused = results["fenced"]
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "not_leader"
                assert refused.headers["retry-after"] == "1"
                metrics = (await edge.http.get("/metrics")).text
                assert "iop_ha_stale_epoch_refused_total 1.0" in metrics

            # A node of the previous wire version is fenced alike: the leader message, the epoch on its runs.
            async with fake_node(edge, "node-a", register=False, protocol=OLDEST_PROTOCOL) as old:
                await old.register(TOKEN_A, ["gpu0"])
                start_chat(nursery, edge, results, "previous", BIG)
                run = await old.next_run()
                assert old.leaders == [Leader(epoch)]
                assert run.epoch == epoch
                await old.answer(run)
                await until(lambda: "previous" in results)
                assert results["previous"].status_code == 200
            stop.cancel()


@pytest.mark.req("ha-step-down")
async def test_a_retry_refused_stale_epoch_after_an_attempt_ran_is_leader_stepped_down_not_not_leader(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """``not_leader`` promises the request never ran. node-a's run fails with an upstream 500 (it
    reached the backend: it may have run), the retry goes to node-b, which refuses it as
    ``stale_epoch``: the client is told ``leader_stepped_down``. The control: the same refusal of
    a first attempt is ``not_leader``."""
    results: dict[str, httpx.Response] = {}
    layout_a = layout(etcd, "edge-a")
    layout_a.outlier = "{consecutive_failures: 0}"
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            edge, stop = await nursery.start(serve, tmp_path, layout_a)
            await until(lambda: leads(edge))
            async with fake_node(edge, "node-b", providers=("gpu1",)) as b, fake_node(edge) as a:
                start_chat(nursery, edge, results, "retried", BIG)
                run = await a.next_run()
                await a.send(RunEnd(run.run_id, "error", "upstream_error", "boom", 500))
                retry = await b.next_run()
                await b.send(RunEnd(retry.run_id, "error", "stale_epoch", "this node has seen a newer epoch"))
                await until(lambda: "retried" in results)
                refused = results["retried"]
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "leader_stepped_down"
                assert refused.headers["x-iop-reject-reason"] == "leader_stepped_down"
                assert refused.headers["x-iop-attempts"] == "2"

                start_chat(nursery, edge, results, "first", BIG)
                run = await a.next_run()
                await a.send(RunEnd(run.run_id, "error", "stale_epoch", "this node has seen a newer epoch"))
                await until(lambda: "first" in results)
                assert results["first"].status_code == 503
                assert results["first"].json()["error"]["code"] == "not_leader"
                await until(lambda: edge.service.admission.snapshot().provider("node-a", "gpu0").in_flight == 0)
            stop.cancel()


@pytest.mark.req("ha-step-down")
async def test_a_run_whose_node_went_away_while_the_edge_could_not_prove_it_leads_is_leader_stepped_down(
    etcd: EtcdServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[ha-step-down] A woken leader's run its node dropped during the pause: the run was sent (it may
    have run) and the Edge can no longer prove it leads, so the client is told ``503
    leader_stepped_down``, not retried and not ``502 node_disconnected``; node-b gets nothing. (Woken
    past its deadline: ``admits()`` made false, as a pause makes it before the election task runs.)"""
    results: dict[str, httpx.Response] = {}
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            edge, stop = await nursery.start(serve, tmp_path, layout(etcd, "edge-a"))
            await until(lambda: leads(edge))
            async with fake_node(edge, "node-b", providers=("gpu1",)) as b, fake_node(edge) as a:
                start_chat(nursery, edge, results, "woken", BIG)
                await a.next_run()
                monkeypatch.setattr(EdgeHa, "admits", lambda self: False)
                await a.drop()
                await until(lambda: "woken" in results)
                refused = results["woken"]
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "leader_stepped_down"
                assert b.runs_received == []
            stop.cancel()
