"""SIGHUP to a real Edge process under load: [refresh-consistency] end to end."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import attrs
import pytest
import trio

from e2e.harness import (
    BIG,
    FAST,
    Requests,
    Stack,
    drained,
    edge_config,
    node_config,
    open_stack,
    provider,
    write_config,
)
from iop_config import ConfigFileError
from iop_edge.config import load_edge_config

INVALID = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
provider_pool: {max_queue: 64, queue_timeout_ms: 30000}
nodes:
  - id: node-a
    token: e2e-node-token
    providers:
      - {id: gpu0, capacity: 0, long_context_capacity: 3}
models:
  - id: "ornith:35b"
    candidates: [{node: node-a, provider: gpu9}]
"""
"""A file with several rule errors (capacity, long capacity, unknown candidate provider)."""
HANG = 300.0
"""Seconds after which a wait is taken for a hang: a bound, never a budget (a busy machine is slow)."""


def capacity(status: dict[str, object], value: int) -> bool:
    gpu0 = provider(status, "gpu0")  # type: ignore[arg-type]
    return gpu0["capacity"] == value and gpu0["effective_capacity"] == value


@attrs.define(eq=False)
class HeldStream:
    """A long stream (60,000 tokens at 20 a second: far past any bound of the test) that its client
    ends when the test is done with it: the lease it holds outlasts a reload however slow the machine."""

    received: list[bytes] = attrs.field(factory=list)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    status: int | None = None

    async def run(self, stack: Stack) -> None:
        payload = {"model": BIG, "stream": True, "max_tokens": 60_000, "messages": [{"role": "user", "content": "Hi"}]}
        with self.scope:
            async with stack.http.stream("POST", f"{stack.base_url}/v1/chat/completions", json=payload) as response:
                self.status = response.status_code
                async for data in response.aiter_raw():
                    self.received.append(data)


@pytest.mark.req("refresh-consistency")
async def test_sighup_applies_capacity_under_load_and_keeps_leases(tmp_path: Path) -> None:
    """[refresh-consistency] gpu0 capacity 1 -> 2 by SIGHUP while one request runs and
    three wait: /status shows capacity 2, a second request starts at once, no request fails,
    the running stream goes on after the reload (its lease kept), the backend never sees more
    than 2, every counter is 0 afterwards. Then an invalid file on SIGHUP, again with a request
    running: the Edge logs every error, keeps capacity 2, and the running request still succeeds.
    Every wait is for its condition (bounded only against a hang): the running request is a
    stream its client ends once the reload is seen, so a slow reload finds it running."""
    held = HeldStream()
    with trio.fail_after(HANG):
        async with open_stack(tmp_path) as stack, trio.open_nursery() as nursery:
            await stack.start_backend(latency_ms=100, tokens_per_second=20)
            config = edge_config(providers={"gpu0": 1})
            await stack.start_edge(config)
            await stack.start_node(node_config(providers={"gpu0": 2}))
            edge = stack.edge
            assert edge is not None and stack.edge_config_path is not None
            requests = Requests(stack, nursery)
            nursery.start_soon(held.run, stack)
            await stack.wait_status(lambda s: provider(s, "gpu0")["in_flight"] == 1, timeout=HANG)
            for i, model in enumerate((FAST, BIG, FAST)):
                await requests.queued(f"waiter-{i}", model, max_tokens=4, stream=i == 1)

            config["nodes"][0]["providers"][0]["capacity"] = 2
            write_config(stack.edge_config_path, config)
            edge.send_signal(signal.SIGHUP)
            raised = await stack.wait_status(lambda s: capacity(s, 2), timeout=HANG)
            await edge.wait_for_line("config reloaded from", timeout=HANG)
            answers = await requests.answered(timeout=HANG)
            streamed = len(held.received)
            await stack.wait_status(lambda s: len(held.received) > streamed, timeout=HANG)  # still running
            held.scope.cancel()  # its client ends it
            after_raise = await stack.wait_status(drained, timeout=HANG)

            write_config(stack.edge_config_path, INVALID)
            try:
                load_edge_config(stack.edge_config_path)
            except ConfigFileError as exc:
                expected_errors = list(exc.errors)
            await requests.running("during-invalid", FAST, max_tokens=20)
            edge.send_signal(signal.SIGHUP)
            await edge.wait_for_line(re.escape(expected_errors[-1]), timeout=HANG)
            kept = await stack.status()
            answers = await requests.answered(timeout=HANG)
            final = await stack.wait_status(drained, timeout=HANG)
            stats = await stack.backend_stats()
            edge_log = edge.stderr()
    assert held.status == 200
    assert provider(raised, "gpu0")["in_flight"] >= 1
    assert {name: r.status_code for name, r in answers.items()} == dict.fromkeys(answers, 200)
    assert answers["waiter-1"].text.rstrip().endswith("data: [DONE]")
    assert drained(after_raise)
    assert len(expected_errors) >= 3
    for error in expected_errors:
        assert f"config reload rejected: {error}" in edge_log
    assert capacity(kept, 2) and capacity(final, 2)
    assert drained(final)
    assert stats["peak_in_flight"] <= 2
    assert stats["total"] == len(answers) + 1  # and the held stream
