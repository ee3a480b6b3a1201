"""SIGHUP to a real Edge process under load: [refresh-consistency] end to end."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import trio

from e2e.harness import (
    BIG,
    FAST,
    Requests,
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


def capacity(status: dict[str, object], value: int) -> bool:
    gpu0 = provider(status, "gpu0")  # type: ignore[arg-type]
    return gpu0["capacity"] == value and gpu0["effective_capacity"] == value


@pytest.mark.req("refresh-consistency")
async def test_sighup_applies_capacity_under_load_and_keeps_leases(tmp_path: Path) -> None:
    """[refresh-consistency] gpu0 capacity 1 -> 2 by SIGHUP while one request runs and
    three wait: /status shows capacity 2, a second request starts at once, no request fails,
    the backend never sees more than 2, every counter is 0 afterwards. Then an invalid file
    on SIGHUP, again with a request running: the Edge logs every error, keeps capacity 2,
    and the running request still succeeds."""
    with trio.fail_after(40):
        async with open_stack(tmp_path) as stack, trio.open_nursery() as nursery:
            await stack.start_backend(latency_ms=100, tokens_per_second=20)
            config = edge_config(providers={"gpu0": 1})
            await stack.start_edge(config)
            await stack.start_node(node_config(providers={"gpu0": 2}))
            edge = stack.edge
            assert edge is not None and stack.edge_config_path is not None
            requests = Requests(stack, nursery)
            await requests.running("running", BIG, max_tokens=30)  # 1.5 s: outlasts the queueing
            for i, model in enumerate((FAST, BIG, FAST)):
                await requests.queued(f"waiter-{i}", model, max_tokens=4, stream=i == 1)

            config["nodes"][0]["providers"][0]["capacity"] = 2
            write_config(stack.edge_config_path, config)
            edge.send_signal(signal.SIGHUP)
            raised = await stack.wait_status(lambda s: capacity(s, 2))
            await edge.wait_for_line("config reloaded from")
            answers = await requests.answered(timeout=15)
            after_raise = await stack.wait_status(drained)

            write_config(stack.edge_config_path, INVALID)
            try:
                load_edge_config(stack.edge_config_path)
            except ConfigFileError as exc:
                expected_errors = list(exc.errors)
            await requests.running("during-invalid", FAST, max_tokens=20)
            edge.send_signal(signal.SIGHUP)
            await edge.wait_for_line(re.escape(expected_errors[-1]))
            kept = await stack.status()
            answers = await requests.answered(timeout=15)
            final = await stack.wait_status(drained)
            stats = await stack.backend_stats()
            edge_log = edge.stderr()
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
    assert stats["total"] == len(answers)
