"""Wire v1 and v2 nodes on one Edge: negotiation, data frames relayed unparsed, a mixed fleet."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed

from edge.harness import BIG, FAST, TOKEN_A, EdgeLayout, chat_chunk, fake_node, running_edge, sse_events, start_chat
from iop_wire import CLOSE_PROTOCOL_ERROR, Rejected, RunData, RunEnd, RunEvent

AWKWARD = [
    b": a comment line\r\n",
    b'data: {"choices":[{"delta":{"content":"h\xc3',  # a UTF-8 character split across records
    b'\xa9"}}]}\r\n\r\ndata: {"a":\n',
    b"data: 1}\n\n",
    b"data: [DONE]\n\n",
]


@pytest.mark.req("wire-versioning", "relay-fidelity")
async def test_mixed_fleet_v1_and_v2_nodes_side_by_side(tmp_path: Path) -> None:
    """[wire-versioning] [relay-fidelity] One Edge serves a v1 node (run_event, framed by the Edge, its own [DONE]) and a v2
    node (data records, written to the client byte for byte) at the same time."""
    with trio.fail_after(10):
        async with (
            running_edge(tmp_path) as edge,
            fake_node(edge, "node-a", protocol=1) as old,
            fake_node(edge, "node-b", providers=("gpu1",), protocol=2) as new,
        ):
            links = {link.node_id: link.protocol for link in edge.service.registry.links()}
            assert links == {"node-a": 1, "node-b": 2}
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "one", BIG, stream=True)
                start_chat(nursery, edge, results, "two", BIG, stream=True)
                old_run = await old.next_run()
                new_run = await new.next_run()
                await old.send(RunEvent(old_run.run_id, chat_chunk("v1")))
                for seq, part in enumerate(AWKWARD):
                    await new.send_data(RunData(new_run.run_id, seq, part))
                await old.send(RunEnd(old_run.run_id, "ok"))
                await new.send(RunEnd(new_run.run_id, "ok"))
            by_node = {r.headers["x-iop-provider"]: r for r in results.values()}
            assert by_node["node-b/gpu1"].content == b"".join(AWKWARD)
            assert by_node["node-b/gpu1"].headers["content-type"] == "text/event-stream"
            v1_events = sse_events(by_node["node-a/gpu0"].text)
            assert [e["choices"][0]["delta"]["content"] for e in v1_events[:-1]] == ["v1"]
            assert v1_events[-1] == "[DONE]"
            await edge.assert_drained()


@pytest.mark.req("wire-versioning")
async def test_v2_non_stream_body_goes_out_as_sent_with_the_edge_headers(tmp_path: Path) -> None:
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


async def test_v2_error_after_data_ends_the_stream_with_one_error_event(tmp_path: Path) -> None:
    """A v2 run that fails after output: the bytes so far, then the Edge's error event, no [DONE]."""
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


async def test_v2_frame_with_interleaved_runs_reaches_each_client_in_order(tmp_path: Path) -> None:
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
async def test_v2_record_out_of_order_is_a_protocol_error(tmp_path: Path) -> None:
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
async def test_unknown_protocol_version_is_rejected_naming_the_versions_spoken(tmp_path: Path) -> None:
    """[wire-versioning] register.protocol 6: rejected protocol_mismatch (not retryable), reason lists 1 to 5."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge, register=False, protocol=6) as node:
            answer = await node.register(TOKEN_A, ["gpu0"])
            assert isinstance(answer, Rejected)
            assert (answer.code, answer.retryable) == ("protocol_mismatch", False)
            assert "1, 2, 3, 4, 5" in answer.reason
