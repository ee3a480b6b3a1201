"""[upstream-bounds] The Edge's memory for non-stream answers is bounded: real Edge and Node processes.

A backend in this process answers with well-formed non-stream answers; the Node's own
bound (``limits.answer_bytes``) is raised past them, so only the Edge's bounds act:
``max_answer_bytes`` (one answer: 502 ``upstream_too_large``, the run cancelled on the node
as soon as the Edge holds that much) and ``answer_budget_bytes`` (all answers held at once:
503 ``overloaded``, reason ``answer_budget``). After each case the Edge's
``iop_answer_bytes_held`` is back to 0, the node's permits came back (the next requests
are served) and no lease is left.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import h11
import pytest
import trio

from e2e.harness import FAST, Stack, drained, edge_config, error_code, node_config, open_stack
from node.harness import HostileBackend, read_request
from node.test_backend_bounds import resident_bytes

MiB = 1024 * 1024
PIECE = 64 * 1024
HELD = re.compile(rb"^iop_answer_bytes_held (\S+)$", re.MULTILINE)


def answer_pieces(size: int) -> Iterator[bytes]:
    """A chat completion whose content is about ``size`` bytes of ``x``: its head, then pieces of 64 KiB."""
    prefix = b'{"id":"c","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":'
    prefix += b'{"role":"assistant","content":"'
    suffix = b'"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'
    body = prefix + b"x" * size + suffix
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    for start in range(0, len(body), PIECE):
        yield body[start : start + PIECE]


@attrs.define(eq=False)
class GatedBackend(HostileBackend):
    """Answers each request with an answer of :attr:`size` bytes (:attr:`size` 0: the healthy one); one of
    more than :attr:`early` bytes waits, after its first :attr:`early`, until :attr:`gate` is set."""

    size: int = 0
    early: int = 0
    gate: trio.Event = attrs.field(factory=trio.Event)

    async def _connection(self, stream: trio.SocketStream) -> None:
        if not self.size:
            await super()._connection(stream)  # its script: the healthy answer
            return
        sent = 0
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):  # the Node closed it
            async with stream:
                if not await read_request(stream, h11.Connection(h11.SERVER)):
                    return
                for piece in answer_pieces(self.size):
                    if self.early and sent >= self.early:
                        await self.gate.wait()
                    await stream.send_all(piece)
                    sent += len(piece)


def raised_node_config(capacity: int) -> dict[str, Any]:
    """The stack's node config, one provider of ``capacity`` whose own answer bound (64 MiB) is past
    every answer here, and no readiness probe (the backend answers a probe like a request)."""
    config = node_config(providers={"gpu0": capacity})
    for provider in config["providers"]:
        provider["health"] = {"probe": "none"}
        provider["limits"] = {"answer_bytes": 64 * MiB}
    return config


async def answer_bytes_held(stack: Stack) -> int:
    """The Edge's ``iop_answer_bytes_held`` (``/metrics``)."""
    response = await stack.http.get(f"{stack.base_url}/metrics")
    found = HELD.search(response.content)
    assert found is not None, "iop_answer_bytes_held not in /metrics"
    return int(float(found.group(1)))


async def served_and_drained(stack: Stack, backend: GatedBackend, times: int) -> None:
    """The next ``times`` requests get the healthy answer; then no lease, no answer byte held."""
    backend.size = 0
    for _ in range(times):
        response = await stack.chat(FAST)
        assert response.status_code == 200, response.text[:300]
    await stack.wait_status(drained)
    assert await answer_bytes_held(stack) == 0
    assert stack.edge is not None and stack.edge.running
    assert "Traceback" not in stack.edge.stderr()


@pytest.mark.req("upstream-bounds")
async def test_an_answer_past_max_answer_bytes_is_502_and_the_edge_holds_no_more(tmp_path: Path) -> None:
    """A 48 MiB answer against ``max_answer_bytes`` 4 MiB: 502 ``upstream_too_large``, the run cancelled
    (the node's one permit serves the next two requests) and the Edge's memory nowhere near the answer's
    (the records that still come for the cancelled run are dropped as they arrive)."""
    backend = GatedBackend(size=48 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        with trio.fail_after(90):
            async with open_stack(tmp_path) as stack:
                await stack.start_edge(edge_config(max_answer_bytes=4 * MiB))
                stack.backend_port = backend.port
                await stack.start_node(raised_node_config(1))
                assert stack.edge is not None
                before = resident_bytes(stack.edge.pid)
                response = await stack.chat(FAST)
                growth = resident_bytes(stack.edge.pid) - before
                assert response.status_code == 502, response.text[:300]
                assert error_code(response) == "upstream_too_large"
                assert "max_answer_bytes" in response.json()["error"]["message"]
                await served_and_drained(stack, backend, 2)
        nursery.cancel_scope.cancel()
    assert growth < 32 * MiB, growth


@pytest.mark.req("upstream-bounds")
async def test_answers_past_the_budget_are_503_one_at_a_time_and_the_rest_is_served(tmp_path: Path) -> None:
    """Two answers of 3 MiB in flight at once, each holding 2 MiB, against ``answer_budget_bytes`` 5 MiB:
    the one whose next piece would pass it is answered 503 ``overloaded`` (reason ``answer_budget``),
    the other reaches its client whole, and the budget is back to 0."""
    backend = GatedBackend(size=3 * MiB, early=2 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        with trio.fail_after(90):
            async with open_stack(tmp_path) as stack:
                config = edge_config(providers={"gpu0": 2}, max_answer_bytes=4 * MiB, answer_budget_bytes=5 * MiB)
                await stack.start_edge(config)
                stack.backend_port = backend.port
                await stack.start_node(raised_node_config(2))
                answers: list[Any] = []

                async def ask() -> None:
                    answers.append(await stack.chat(FAST))

                async with trio.open_nursery() as clients:
                    clients.start_soon(ask)
                    clients.start_soon(ask)
                    while await answer_bytes_held(stack) < 4 * MiB:  # both hold their first 2 MiB
                        await trio.sleep(0.02)
                    backend.gate.set()
                statuses = sorted(response.status_code for response in answers)
                assert statuses == [200, 503], [response.text[:200] for response in answers]
                whole, refused = sorted(answers, key=lambda response: response.status_code)
                assert len(whole.json()["choices"][0]["message"]["content"]) == 3 * MiB
                assert refused.json()["error"]["code"] == "overloaded"
                assert refused.headers["x-iop-reject-reason"] == "answer_budget"
                assert refused.headers["retry-after"] == "1"
                assert "answer_budget_bytes" in refused.json()["error"]["message"]
                await served_and_drained(stack, backend, 2)
        nursery.cancel_scope.cancel()


@pytest.mark.req("upstream-bounds")
async def test_a_whole_answer_is_relayed_in_pieces_with_its_usage_read(tmp_path: Path) -> None:
    """An answer of 12 MiB within the bounds reaches its client byte for byte (one ``content-length``,
    its pieces never joined), and token cost settles with the ``usage`` at its end."""
    backend = GatedBackend(size=12 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        with trio.fail_after(90):
            async with open_stack(tmp_path) as stack:
                config = edge_config(
                    tenants=[{"name": "default", "max_in_flight": 1}], tenant_cost="tokens", max_answer_bytes=16 * MiB
                )
                await stack.start_edge(config)
                stack.backend_port = backend.port
                await stack.start_node(raised_node_config(1))
                response = await stack.chat(FAST)
                assert response.status_code == 200, response.text[:300]
                assert int(response.headers["content-length"]) == len(response.content)
                answer = json.loads(response.content)
                assert answer["choices"][0]["message"]["content"] == "x" * (12 * MiB)
                assert answer["usage"]["total_tokens"] == 3
                await served_and_drained(stack, backend, 1)
        nursery.cancel_scope.cancel()
