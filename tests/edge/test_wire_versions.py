"""Nodes of both wire versions on one Edge: negotiation, a refused older node, data frames relayed unparsed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed

from edge.harness import BIG, FAST, TOKEN_A, EdgeLayout, fake_node, running_edge, sse_events, start_chat
from iop_wire import CLOSE_POLICY, CLOSE_PROTOCOL_ERROR, OLDEST_PROTOCOL, PROTOCOL_VERSION, Rejected, RunData, RunEnd

AWKWARD = [
    b": a comment line\r\n",
    b'data: {"choices":[{"delta":{"content":"h\xc3',  # a UTF-8 character split across records
    b'\xa9"}}]}\r\n\r\ndata: {"a":\n',
    b"data: 1}\n\n",
    b"data: [DONE]\n\n",
]


@pytest.mark.req("wire-versioning", "relay-fidelity")
async def test_rolling_upgrade_nodes_of_both_versions_side_by_side(tmp_path: Path) -> None:
    """[wire-versioning] [relay-fidelity] An upgraded Edge serves a node of the previous version and
    one of the current at once: both get the client's body as sent with the upstream model beside
    it and what is left of the request's deadline (v7 adds nothing to a run: the link says the run
    the API built to both as it is); both answer in data records, written to the client byte for
    byte."""
    with trio.fail_after(10):
        async with (
            running_edge(tmp_path) as edge,
            fake_node(edge, "node-a", protocol=OLDEST_PROTOCOL) as old,
            fake_node(edge, "node-b", providers=("gpu1",), protocol=PROTOCOL_VERSION) as new,
        ):
            links = {link.node_id: link.protocol for link in edge.service.registry.links()}
            assert links == {"node-a": OLDEST_PROTOCOL, "node-b": PROTOCOL_VERSION}
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "one", BIG, stream=True, headers={"X-Request-Timeout": "30"})
                start_chat(nursery, edge, results, "two", BIG, stream=True, headers={"X-Request-Timeout": "30"})
                old_run = await old.next_run()
                new_run = await new.next_run()
                (old_sent,) = old.runs_received
                (new_sent,) = new.runs_received
                assert old_sent.model == old_run.body["model"] and old_sent.body["model"] == BIG
                assert new_sent.model == new_run.body["model"] and new_sent.body["model"] == BIG
                for sent in (old_sent, new_sent):
                    assert sent.deadline_ms is not None and 0 < sent.deadline_ms <= 30_000
                for node, run in ((old, old_run), (new, new_run)):
                    for seq, part in enumerate(AWKWARD):
                        await node.send_data(RunData(run.run_id, seq, part))
                    await node.send(RunEnd(run.run_id, "ok"))
            assert [r.content for r in results.values()] == [b"".join(AWKWARD)] * 2
            assert {r.headers["x-iop-provider"] for r in results.values()} == {"node-a/gpu0", "node-b/gpu1"}
            await edge.assert_drained()


@pytest.mark.req("wire-versioning")
async def test_non_stream_body_goes_out_as_sent_with_the_edge_headers(tmp_path: Path) -> None:
    """[wire-versioning] A non-stream answer in several records reaches the client as those bytes, with
    content-type and content-length set by the Edge."""
    body = b'{"object":"chat.completion","choices":[{"message":{"content":"\xe2\x82\xac"}}]}'
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "x", FAST)
                run = await node.next_run()
                await node.send_data(RunData(run.run_id, 0, body[:40]), RunData(run.run_id, 1, body[40:]))
                await node.send(RunEnd(run.run_id, "ok"))
            response = results["x"]
            assert response.status_code == 200
            assert response.content == body
            assert response.headers["content-type"] == "application/json"
            assert response.headers["content-length"] == str(len(body))
            assert response.headers["x-iop-provider"] == "node-a/gpu0"


async def test_error_after_data_ends_the_stream_with_one_error_event(tmp_path: Path) -> None:
    """A run that fails after output: the bytes so far, then the Edge's error event, no [DONE]."""
    first = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "s", FAST, stream=True)
                run = await node.next_run()
                await node.send_data(RunData(run.run_id, 0, first))
                await node.send(RunEnd(run.run_id, "error", "upstream_error", "backend died", 500))
            response = results["s"]
            assert response.content.startswith(first)
            events = sse_events(response.text)
            assert events[1]["error"]["code"] == "upstream_error"
            assert len(events) == 2
            await edge.assert_drained()


async def test_frame_with_interleaved_runs_reaches_each_client_in_order(tmp_path: Path) -> None:
    """One data frame carrying several records of two runs, interleaved: each client gets its
    run's bytes in order (a run's records in one frame go out as one write)."""
    with trio.fail_after(10):
        async with running_edge(tmp_path, EdgeLayout(gpu0_capacity=2)) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                for name in ("a", "b"):
                    start_chat(nursery, edge, results, name, FAST, stream=True)
                runs = [await node.next_run(), await node.next_run()]
                records = [
                    RunData(run.run_id, seq, f"data: {run.run_id}-{seq}\n\n".encode())
                    for seq in range(3)
                    for run in runs
                ]
                await node.send_data(*records)
                for run in runs:
                    await node.send(RunEnd(run.run_id, "ok"))
            for run in runs:
                expected = b"".join(f"data: {run.run_id}-{seq}\n\n".encode() for seq in range(3))
                assert expected in {response.content for response in results.values()}
            await edge.assert_drained()


@pytest.mark.req("wire-versioning")
async def test_record_out_of_order_is_a_protocol_error(tmp_path: Path) -> None:
    """A data record whose seq skips one: close 1002, the run's client gets node_disconnected."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "s", FAST)
                run = await node.next_run()
                await node.send_data(RunData(run.run_id, 1, b"{}"))
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        await node.receive()
                assert closed.value.reason.code == CLOSE_PROTOCOL_ERROR
            assert results["s"].status_code == 502
            assert results["s"].json()["error"]["code"] == "node_disconnected"


@pytest.mark.req("wire-versioning")
@pytest.mark.parametrize(
    ("offered", "upgrade"), [(OLDEST_PROTOCOL - 1, "upgrade the node"), (PROTOCOL_VERSION + 1, "upgrade this edge")]
)
async def test_a_version_outside_the_pair_is_refused_with_a_clear_reason(
    tmp_path: Path, offered: int, upgrade: str
) -> None:
    """[wire-versioning] A node of the version before the pair (a v3 node), or after it: ``rejected``
    ``protocol_mismatch``, not retryable, the reason naming the versions spoken and what to upgrade;
    then a close 1008. Nothing is registered."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge, register=False, protocol=offered) as node:
            answer = await node.register(TOKEN_A, ["gpu0"])
            assert isinstance(answer, Rejected)
            assert (answer.code, answer.retryable) == ("protocol_mismatch", False)
            spoken = f"{OLDEST_PROTOCOL} and {PROTOCOL_VERSION}"
            assert answer.reason == f"wire v{offered} is not spoken here (this edge speaks {spoken}): {upgrade}"
            with pytest.raises(ConnectionClosed) as closed:
                await node.receive()
            assert closed.value.reason.code == CLOSE_POLICY
            assert edge.service.registry.links() == ()
