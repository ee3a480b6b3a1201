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

from pathlib import Path

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
                await stack.start_node(node_config())
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
