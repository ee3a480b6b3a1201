"""Real processes: the Node's health watch reaching the Edge's core ([health-probe]).

``ornith:35b`` lists ``node-a/gpu0`` (backend A) then ``node-a/gpu1`` (backend B). Backend A
hangs while its ``/health`` and ``/v1/models`` still answer (``POST /fault {"hang": ...}``), or
says it is loading its model; backend B always serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from e2e.harness import BIG, Stack, drained, edge_config, node_config, open_stack, provider

pytestmark = pytest.mark.req("health-probe")

HEALTH = {"interval_ms": 100, "timeout_ms": 1000, "no_traffic_interval_ms": 100, "stall_ms": 500}


async def _two_backends(stack: Stack, health: dict[str, Any]) -> tuple[int, int]:
    await stack.start_backend(latency_ms=0)
    port_a = stack.backend_port
    await stack.start_backend(latency_ms=0)
    port_b = stack.backend_port
    assert port_a is not None and port_b is not None
    config = edge_config(providers={"gpu0": 1, "gpu1": 1}, models={BIG: ["gpu0", "gpu1"]})
    config["provider_pool"]["outlier"] = {"consecutive_failures": 5, "base_ejection_ms": 60_000}
    await stack.start_edge(config)
    node: dict[str, Any] = node_config(providers={"gpu0": 1, "gpu1": 1})
    for p, port in zip(node["providers"], (port_a, port_b), strict=True):
        p["base_url"] = f"http://127.0.0.1:{port}/v1"
        p["health"] = health
    await stack.start_node(node)
    return port_a, port_b


@pytest.mark.req("failover-before-first-byte")
async def test_a_hung_engine_is_stalled_ejected_and_its_request_served_elsewhere(tmp_path: Path) -> None:
    """[health-probe] [failover-before-first-byte] A hangs (health still 200): the request granted to
    gpu0 is cut by the node's watchdog before any byte and served by gpu1 (200, two attempts); the
    node reports gpu0 stalled and the Edge ejects it (its failures alone would not: 5 needed)."""
    with trio.fail_after(60):
        async with open_stack(tmp_path) as stack:
            port_a, _ = await _two_backends(stack, HEALTH)
            await stack.http.post(f"http://127.0.0.1:{port_a}/fault", json={"hang": "no_answer"})
            answer = await stack.chat(BIG, stream=True)
            assert answer.status_code == 200
            assert (answer.headers["x-iop-provider"], answer.headers["x-iop-attempts"]) == ("node-a/gpu1", "2")
            status = await stack.wait_status(lambda s: provider(s, "gpu0")["health"] == "ejected")
            gpu0 = provider(status, "gpu0")
            assert gpu0["reported"] in ("stalled", "ready")  # the stall ends once its runs are cut
            assert gpu0["failures"] < 5 and gpu0["ejections"] == 1
            assert drained(await stack.wait_status(drained))


async def test_a_loading_backend_is_out_until_it_is_ready(tmp_path: Path) -> None:
    """[health-probe] A says it is loading (llama.cpp's 503): gpu0 not ready, ejected with the reason
    shown, requests go to gpu1; A loaded: ready, gpu0 online again at once (no ejection time)."""
    with trio.fail_after(60):
        async with open_stack(tmp_path) as stack:
            port_a, _ = await _two_backends(stack, {**HEALTH, "probe": "llama_cpp"})
            await stack.http.post(f"http://127.0.0.1:{port_a}/fault", json={"loading": True})
            status = await stack.wait_status(lambda s: provider(s, "gpu0")["reported"] == "not_ready")
            gpu0 = provider(status, "gpu0")
            assert (gpu0["health"], gpu0["report_reason"]) == ("ejected", "loading (Loading model)")
            answer = await stack.chat(BIG, stream=False)
            assert (answer.status_code, answer.headers["x-iop-provider"]) == (200, "node-a/gpu1")
            await stack.http.post(f"http://127.0.0.1:{port_a}/fault", json={})
            status = await stack.wait_status(lambda s: provider(s, "gpu0")["health"] == "online")
            assert provider(status, "gpu0")["reported"] == "ready"
