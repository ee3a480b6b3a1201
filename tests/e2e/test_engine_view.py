"""[token-ledger] Real processes: the engine's own view, read by the Node's readiness probe from the
mock backend (vLLM's ``/metrics``, llama.cpp's ``/slots``), shows in the Edge's ``/status`` beside the
reservations and cuts gpu0's token budget while the engine reports pressure.

gpu0 admits by a budget of 8,192 tokens (a window of 4,096). The backend says 0.75 of its cache is
in use (``POST /fault {"kv_use": 0.75}``: a cache others fill) while nothing is reserved: 6,144
tokens the reservations do not explain, so the effective budget is 2,048; a request reserving 3,014
waits. The backend's cache empties (``{}``): the next report gives the 8,192 back and the request
runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from e2e.harness import FAST, Stack, drained, edge_config, node_config, open_stack, provider

pytestmark = pytest.mark.req("token-ledger")

BUDGET = 8_192
HEALTH = {"interval_ms": 100, "timeout_ms": 1000, "no_traffic_interval_ms": 100}


async def _stack(stack: Stack, probe: str) -> int:
    await stack.start_backend(latency_ms=0)
    port = stack.backend_port
    assert port is not None
    config = edge_config(providers={"gpu0": 8})
    (gpu0,) = config["nodes"][0]["providers"]
    gpu0.update(admit_by="tokens", context_window_tokens=4_096, total_context_tokens=BUDGET)
    await stack.start_edge(config)
    node: dict[str, Any] = node_config(providers={"gpu0": 8})
    node["providers"][0]["health"] = {**HEALTH, "probe": probe}
    await stack.start_node(node)
    return port


@pytest.mark.parametrize("probe", ["vllm", "llama_cpp"])
async def test_the_engines_reported_pressure_shows_and_cuts_the_budget_until_it_goes(
    tmp_path: Path, probe: str
) -> None:
    with trio.fail_after(60):
        async with open_stack(tmp_path) as stack:
            port = await _stack(stack, probe)
            await stack.http.post(f"http://127.0.0.1:{port}/fault", json={"kv_use": 0.75, "preemptions": 2})
            status = await stack.wait_status(lambda s: provider(s, "gpu0")["reported_kv_use"] == 0.75)
            gpu0 = provider(status, "gpu0")
            assert (gpu0["token_budget"], gpu0["effective_token_budget"], gpu0["reserved_tokens"]) == (BUDGET, 2048, 0)
            assert gpu0["reported_preemptions"] == (2 if probe == "vllm" else None)  # /slots has no such count
            metrics = (await stack.http.get(f"{stack.base_url}/metrics")).text
            assert 'iop_effective_token_budget{node="node-a",provider="gpu0"} 2048.0' in metrics
            answers: list[httpx.Response] = []
            async with trio.open_nursery() as nursery:

                async def ask() -> None:  # ceil(8 x 1.25 / 4) = 3 for "Hello", plus 3,011: 3,014 reserved
                    answers.append(await stack.chat(FAST, max_tokens=3_011))

                nursery.start_soon(ask)
                await stack.wait_status(lambda s: s["queue_depth"] == 1)
                await stack.http.post(f"http://127.0.0.1:{port}/fault", json={})
            assert [a.status_code for a in answers] == [200]
            status = await stack.wait_status(lambda s: provider(s, "gpu0")["effective_token_budget"] == BUDGET)
            assert provider(status, "gpu0")["reported_kv_use"] == 0.0
            assert drained(await stack.wait_status(drained))
