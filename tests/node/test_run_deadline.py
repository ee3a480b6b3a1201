"""A run's deadline and a stalled stream on the Node ([deadline] [error-classes] [cancel-upstream]):
a fake Edge, a real Node and the mock backend on loopback sockets."""

from __future__ import annotations

import pytest
import trio

from iop_wire import PROTOCOL_VERSIONS, Run, RunData, RunEnd
from node.harness import Backend, FakeEdge, node_config, openai_provider, running_node

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
pytestmark = pytest.mark.req("deadline", "cancel-upstream", "error-classes")


def _run(run_id: str, *, stream: bool, deadline_ms: int | None = None) -> Run:
    body = {**CHAT, "max_tokens": 1000, "stream": stream}
    return Run(run_id, "gpu0", "chat/completions", body, stream, deadline_ms=deadline_ms)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_run_deadline_closes_the_upstream_request(edge: FakeEdge, backend: Backend, stream: bool) -> None:
    """[deadline] [cancel-upstream] a run whose deadline passes while the backend has sent nothing:
    the Node closes the backend request (the backend counts it aborted), returns the permit and
    ends the run ``deadline_exceeded``, on its own (no cancel from the Edge)."""
    backend.backend.latency = 60.0
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, openai_provider(backend.port))) as node:
            conn = await edge.next_connection()
            await conn.send(_run("r1", stream=stream, deadline_ms=300))
            (end,) = await conn.receive_until_end("r1")
            assert isinstance(end, RunEnd)
            assert (end.status, end.code) == ("error", "deadline_exceeded")
            assert "300 ms" in (end.message or "")
            assert node.runtime.gate.statistics().total_in_use == 0
            await backend.wait_idle()
    assert backend.backend.stats()["aborted"] == 1


@pytest.mark.parametrize("protocol", PROTOCOL_VERSIONS)
async def test_stream_stalled_after_its_first_bytes(edge: FakeEdge, backend: Backend, protocol: int) -> None:
    """[error-classes] a backend that sends its first bytes, then nothing for the provider's timeout_ms:
    the run ends ``stream_stalled`` on a connection of either version (v6 added the code), and the
    backend request is closed."""
    edge.protocols = (protocol,)
    backend.backend.tokens_per_second = 0.01  # the role chunk at once, the first token after 100 s
    provider = openai_provider(backend.port, timeout_ms=300)
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, provider)):
            conn = await edge.next_connection()
            await conn.send(_run("r1", stream=True))
            *output, end = await conn.receive_until_end("r1")
            await backend.wait_idle()
    assert output and all(isinstance(m, RunData) for m in output)
    assert isinstance(end, RunEnd) and end.status == "error"
    assert end.code == "stream_stalled"
    assert backend.backend.stats()["aborted"] == 1


async def test_silence_before_the_first_byte_is_not_a_stall(edge: FakeEdge, backend: Backend) -> None:
    """A backend silent from the start is unreachable (retried elsewhere by the Edge), not stalled."""
    backend.backend.latency = 60.0
    with trio.fail_after(10):
        async with running_node(node_config(edge.url, openai_provider(backend.port, timeout_ms=300))):
            conn = await edge.next_connection()
            await conn.send(_run("r1", stream=True))
            (end,) = await conn.receive_until_end("r1")
    assert isinstance(end, RunEnd) and end.code == "upstream_unreachable"
