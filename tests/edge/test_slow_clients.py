"""Slow and stalled peers: request heads trickled byte by byte, a node that stops reading,
and API keys offered in the URL.

Real sockets on 127.0.0.1 port 0; the header timeout is short (300 ms) and every
test is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import h11
import httpx
import pytest
import trio
import trio.testing

from edge.harness import (
    BIG,
    FAST,
    EdgeLayout,
    eventually,
    fake_node,
    mock_provider,
    node_config,
    real_node,
    running_edge,
)
from iop_config import ConfigFileError
from iop_edge.config import load_edge_config
from iop_io import WRITE_BUFFER_LIMIT
from iop_wire import Heartbeat, RunData, encode

HEADER_TIMEOUT_MS = 300
TRICKLE_INTERVAL = 0.05
"""Seconds between two trickled bytes: the head below would take 2-3 s to arrive."""
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
)


@attrs.define(kw_only=True)
class SlowLayout(EdgeLayout):
    """The harness layout plus a short ``header_timeout_ms``."""

    header_timeout_ms: int = HEADER_TIMEOUT_MS

    def yaml(self) -> str:
        return super().yaml() + f"header_timeout_ms: {self.header_timeout_ms}\n"


async def trickle(stream: trio.SocketStream, data: bytes) -> int:
    """Send ``data`` one byte per :data:`TRICKLE_INTERVAL`; return how many bytes went out
    before the server closed the connection (``len(data)`` if it never did)."""
    for sent in range(len(data)):
        try:
            await stream.send_all(data[sent : sent + 1])
        except trio.BrokenResourceError:
            return sent
        with trio.move_on_after(TRICKLE_INTERVAL):
            try:
                if await stream.receive_some() == b"":
                    return sent + 1
            except trio.BrokenResourceError:
                return sent + 1
    return len(data)


@pytest.mark.req("header-timeout")
async def test_trickled_request_head_is_cut_off_and_others_are_served(tmp_path: Path) -> None:
    """[header-timeout] A head trickled 1 byte / 50 ms is disconnected after header_timeout_ms
    (long before it is complete), with no answer; a normal client meanwhile gets 200."""
    with trio.fail_after(15):
        async with running_edge(tmp_path, SlowLayout()) as edge, fake_node(edge) as node:
            answered: list[httpx.Response] = []

            async def normal_client() -> None:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge.http_port}") as http:
                    answered.append(await http.get("/healthz"))

            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream, trio.open_nursery() as nursery:
                start = trio.current_time()
                nursery.start_soon(normal_client)
                sent = await trickle(stream, HEAD)
                elapsed = trio.current_time() - start
            assert sent < len(HEAD) // 2, f"{sent} of {len(HEAD)} bytes went out before the cut"
            assert elapsed >= HEADER_TIMEOUT_MS / 1000
            assert [r.status_code for r in answered] == [200]

            # and the Edge still runs requests end to end
            async def serve_one() -> None:
                await node.answer(await node.next_run())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_one)
                response = await edge.chat(FAST)
            assert response.status_code == 200, response.text


@pytest.mark.req("header-timeout")
async def test_idle_keep_alive_is_not_a_slow_head_but_a_second_trickled_head_is_cut(tmp_path: Path) -> None:
    """[header-timeout] The deadline starts at a head's first byte: a keep-alive connection idle
    for longer than header_timeout_ms serves its next request; after a response the check
    re-arms, so a trickled second head on the same connection is cut off."""
    request = b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n"
    with trio.fail_after(15):
        async with running_edge(tmp_path, SlowLayout()) as edge:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                for _ in range(2):
                    await trio.sleep(2 * HEADER_TIMEOUT_MS / 1000)  # idle: no head in progress
                    await stream.send_all(request)
                    answer = b""
                    while not answer.endswith(b'{"status":"ok"}'):
                        answer += await stream.receive_some()
                    assert answer.startswith(b"HTTP/1.1 200"), answer
                sent = await trickle(stream, request)
            assert sent < len(request)


@pytest.mark.req("disconnect-exclusion")
async def test_node_that_stops_reading_stalls_only_itself(tmp_path: Path) -> None:
    """[disconnect-exclusion] node-a registers and never reads its socket again while 8 runs of
    1 MB each are sent to it: its writer blocks, the frames wait in its own outbox. node-b's
    heartbeats and requests keep flowing for well over 3 heartbeat timeouts; node-a's own
    heartbeats still count (its reader is separate), so neither node is dropped. Afterwards
    every counter returns to 0."""
    layout = EdgeLayout(
        gpu0_capacity=8,
        gpu0_long_capacity=8,
        heartbeat_timeout_ms=600,
        max_body_bytes=2 << 20,
        max_ws_message_bytes=2 << 20,
    )
    big_prompt = "x" * (1 << 20)
    with trio.fail_after(30):
        async with (
            running_edge(tmp_path, layout) as edge,
            real_node(edge, node_config(edge, "node-b", [mock_provider("gpu1")])),
            fake_node(edge, "node-a") as stalled,
            trio.open_nursery() as nursery,
        ):
            admission = edge.service.admission
            generations = (admission.generation("node-a"), admission.generation("node-b"))

            beating = trio.CancelScope()

            async def keep_beating() -> None:
                with beating:
                    while True:
                        await stalled.ws.send_message(encode(Heartbeat(1)))
                        await trio.sleep(0.1)

            nursery.start_soon(keep_beating)
            async with trio.open_nursery() as stuck:
                for _ in range(8):
                    stuck.start_soon(edge.chat, FAST, big_prompt)
                link = edge.service.registry.link("node-a", generations[0])
                await eventually(lambda: edge.provider("node-a", "gpu0")["in_flight"] == 8)
                await eventually(lambda: link.queued_frames > 0)

                start = trio.current_time()
                served = 0
                while trio.current_time() - start < 2.0:  # > 3 x heartbeat_timeout
                    response = await edge.chat(BIG)
                    assert response.status_code == 200, response.text
                    assert response.headers["x-iop-provider"] == "node-b/gpu1"
                    served += 1
                    await trio.sleep(0.1)
                assert served >= 10
                assert (admission.generation("node-a"), admission.generation("node-b")) == generations
                assert admission.is_connected("node-a") and admission.is_connected("node-b")
                assert link.queued_frames > 0  # still stalled
                stuck.cancel_scope.cancel()
            beating.cancel()  # before the drop: a heartbeat sent after it would fail the test
            await stalled.drop()
            await eventually(lambda: not admission.is_connected("node-a"))
            await edge.assert_drained()
            nursery.cancel_scope.cancel()


async def test_api_key_in_query_string_is_not_accepted(tmp_path: Path) -> None:
    """API keys are read from ``Authorization: Bearer`` only: ``?api_key=``/``?key=`` get 401."""
    key = "key-in-url-sentinel"
    with trio.fail_after(15):
        async with running_edge(tmp_path, EdgeLayout(api_keys=(key,))) as edge, fake_node(edge):
            body = {"model": FAST, "messages": [{"role": "user", "content": "hi"}]}
            for query in (f"api_key={key}", f"key={key}", f"authorization=Bearer%20{key}"):
                response = await edge.http.post(f"/v1/chat/completions?{query}", json=body)
                assert response.status_code == 401, response.text
                assert response.json()["error"]["code"] == "invalid_api_key"
                assert key not in response.text
                models = await edge.http.get(f"/v1/models?{query}")
                assert models.status_code == 401
            await edge.assert_drained()


def test_header_timeout_must_be_positive(tmp_path: Path) -> None:
    """``header_timeout_ms`` is checked like every other limit (file:line: key: rule)."""
    path = tmp_path / "edge.yaml"
    path.write_text(SlowLayout(header_timeout_ms=0).yaml())
    with pytest.raises(ConfigFileError) as caught:
        load_edge_config(path)
    assert any("header_timeout_ms" in error and ">= 1" in error for error in caught.value.errors), caught.value.errors


async def test_stream_client_that_stops_reading_is_cut_at_the_bound(tmp_path: Path) -> None:
    """A streaming client that stops reading: the node's data records go on being written to its
    connection without waiting until more than ``WRITE_BUFFER_LIMIT`` bytes wait for it; then
    the run is cancelled on the node (the node link's reader never waited), and the client,
    reading again, gets every byte before the cut and a final ``client_too_slow`` error event."""
    record = b"data: " + b"x" * (32 * 1024 - 8) + b"\n\n"
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            body = json.dumps({"model": FAST, "messages": [{"role": "user", "content": "hi"}], "stream": True})
            client = h11.Connection(h11.CLIENT)
            head = h11.Request(
                method="POST",
                target="/v1/chat/completions",
                headers=[("host", "edge"), ("content-type", "application/json"), ("content-length", str(len(body)))],
            )
            await stream.send_all(client.send(head) + client.send(h11.Data(data=body.encode())))
            run = await node.next_run()
            cancelled = trio.Event()

            async def wait_cancel() -> None:
                assert (await node.next_cancel()).run_id == run.run_id
                cancelled.set()

            sent = 0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_cancel)
                while not cancelled.is_set():
                    assert sent < 2048, "the Edge buffered 64 MB for a client that does not read"
                    await node.send_data(RunData(run.run_id, sent, record))
                    sent += 1
                    await trio.testing.wait_all_tasks_blocked()
            assert sent * len(record) > WRITE_BUFFER_LIMIT
            received = bytearray()
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    assert event.status_code == 200
                elif isinstance(event, h11.Data):
                    received += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            data, _, last = bytes(received).rpartition(b"data: {")
            assert data == record * (len(data) // len(record)) and len(data) // len(record) <= sent
            assert b'"code":"client_too_slow"' in last
            await stream.aclose()
            await edge.assert_drained()
