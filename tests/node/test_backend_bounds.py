"""[upstream-bounds] A backend that sends without end fails its own run only: real Edge and Node processes.

Each test puts a :class:`~node.harness.HostileBackend` (a trio server in this process)
behind a Node process and sends one request through an Edge process: an endless
answer head, a non-stream answer past ``limits.answer_bytes``, an endless chunk
extension, a storm of 1xx answers. The client gets 502 with the bound's code; the
Node closed the connection to the backend early (the backend sent a small part of
what it had), its memory did not follow the backend, and the same Node then serves
two more requests on its one permit (a permit the hostile run kept would refuse the
second) while the Edge's counters go back to 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from e2e.harness import FAST, drained, edge_config, error_code, node_config, open_stack
from node.harness import (
    ENDLESS_HEAD,
    HUGE_BODY,
    HUGE_EXTENSION,
    INFORMATIONAL_STORM,
    HostileBackend,
    Script,
    healthy,
)

MiB = 1024 * 1024
RSS_GROWTH_BOUND = 64 * MiB
"""How much the Node's resident memory may grow over one hostile answer (without the bounds: hundreds of MiB)."""


def resident_bytes(pid: int) -> int:
    """The process's resident set size (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def unprobed_node_config() -> dict[str, Any]:
    """The stack's node config with its provider's readiness probe off: a :class:`HostileBackend`
    answers every request with its script, a probe's too, and these tests count the run's connections."""
    config = node_config()
    for provider in config["providers"]:
        provider["health"] = {"probe": "none"}
    return config


@pytest.mark.req("upstream-bounds")
@pytest.mark.parametrize(
    ("script", "code"),
    [
        pytest.param(ENDLESS_HEAD, "upstream_too_large", id="endless-head"),
        pytest.param(HUGE_BODY, "upstream_too_large", id="huge-non-stream-answer"),
        pytest.param(HUGE_EXTENSION, "upstream_error", id="endless-chunk-extension"),
        pytest.param(INFORMATIONAL_STORM, "upstream_error", id="1xx-storm"),
    ],
)
async def test_a_hostile_answer_fails_its_own_run_only(tmp_path: Path, script: Script, code: str) -> None:
    backend = HostileBackend()
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        with trio.fail_after(90):
            async with open_stack(tmp_path) as stack:
                await stack.start_edge(edge_config())
                stack.backend_port = backend.port
                await stack.start_node(unprobed_node_config())
                assert stack.node is not None
                assert (await stack.chat(FAST)).status_code == 200
                before = resident_bytes(stack.node.pid)
                backend.script = script
                response = await stack.chat(FAST)
                growth = resident_bytes(stack.node.pid) - before
                backend.script = healthy
                assert response.status_code == 502, response.text
                assert error_code(response) == code
                for _ in range(2):  # the node's one permit came back
                    assert (await stack.chat(FAST)).status_code == 200
                await stack.wait_status(drained)
                assert stack.node.running
                assert "Traceback" not in stack.node.stderr()
        nursery.cancel_scope.cancel()
    assert backend.cut == 1  # the hostile answer's connection, closed by the node
    assert max(backend.sent) < 256 * MiB // 4
    assert growth < RSS_GROWTH_BOUND


LARGE_CONTENT = 10 * MiB
"""A legal answer's text: under the Node's ``answer_bytes`` (16 MiB), over the Edge's ``max_ws_message_bytes`` (8 MiB)."""


def large_ollama_answer() -> Iterator[bytes]:
    """A well-formed Ollama ``/api/chat`` answer of :data:`LARGE_CONTENT` characters."""
    message = {"role": "assistant", "content": "x" * LARGE_CONTENT}
    body = json.dumps({"model": "m", "message": message, "done": True, "done_reason": "stop"}).encode()
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    for start in range(0, len(body), 64 * 1024):
        yield body[start : start + 64 * 1024]


@pytest.mark.req("upstream-bounds")
async def test_a_legal_answer_larger_than_one_frame_is_relayed_and_the_link_stays(tmp_path: Path) -> None:
    """An adapter that encodes a whole non-stream answer (``ollama``) hands the Node 10 MiB at once:
    it goes to the Edge as records of at most 64 KiB, not as one frame the Edge would refuse (1009,
    which cut every run of the node's link: the client got 502 ``node_disconnected``)."""
    backend = HostileBackend(script=large_ollama_answer)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        with trio.fail_after(90):
            async with open_stack(tmp_path) as stack:
                await stack.start_edge(edge_config())
                config = node_config()
                config["providers"] = [
                    {"id": "gpu0", "adapter": "ollama", "capacity": 1, "base_url": f"http://127.0.0.1:{backend.port}"}
                ]
                await stack.start_node(config)
                response = await stack.chat(FAST)
                assert response.status_code == 200, response.text[:300]
                assert len(response.json()["choices"][0]["message"]["content"]) == LARGE_CONTENT
                await stack.wait_status(drained)
                assert stack.edge is not None
                assert "disconnected" not in stack.edge.stderr()
        nursery.cancel_scope.cancel()
