"""Real processes: one model on two providers, each with its own mock backend.

[failover-before-first-byte] [outlier-ejection]. ``ornith:35b`` lists ``node-a/gpu0``
(backend A) then ``node-a/gpu1`` (backend B), equal priority, so a request tries
gpu0 first while it is admitting. Backend A is killed, or answers 500 (``POST
/fault``), or refuses a request with 400; backend B always serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from e2e.harness import BIG, Stack, drained, edge_config, node_config, open_stack, provider

pytestmark = pytest.mark.req("failover-before-first-byte", "outlier-ejection")

BASE_EJECTION_MS = 1000


async def _two_backends(stack: Stack, *, fail_status: int | None = None) -> tuple[int, int]:
    """Backend A (optionally failing) and backend B, an Edge and a node with gpu0 -> A, gpu1 -> B."""
    await stack.start_backend(latency_ms=0)
    port_a = stack.backend_port
    assert port_a is not None
    if fail_status is not None:
        await stack.http.post(f"http://127.0.0.1:{port_a}/fault", json={"status": fail_status})
    await stack.start_backend(latency_ms=0)
    port_b = stack.backend_port
    assert port_b is not None
    config = edge_config(providers={"gpu0": 1, "gpu1": 1}, models={BIG: ["gpu0", "gpu1"]})
    config["provider_pool"]["outlier"] = {"consecutive_failures": 2, "base_ejection_ms": BASE_EJECTION_MS}
    await stack.start_edge(config)
    node: dict[str, Any] = node_config(providers={"gpu0": 1, "gpu1": 1})
    for p, port in zip(node["providers"], (port_a, port_b), strict=True):
        p["base_url"] = f"http://127.0.0.1:{port}/v1"
    await stack.start_node(node)
    return port_a, port_b


async def _ask(stack: Stack, n: int) -> list[httpx.Response]:
    """``n`` requests one after another (non-stream and stream alternately)."""
    return [await stack.chat(BIG, stream=bool(i % 2)) for i in range(n)]


async def test_killed_backend_fails_over_and_is_ejected(tmp_path: Path) -> None:
    """[failover-before-first-byte] [outlier-ejection] backend A killed: every request is answered
    200 by gpu1; the first two after two attempts each, then gpu0 is ejected in /status and the
    rest take one attempt."""
    with trio.fail_after(60):
        async with open_stack(tmp_path) as stack:
            await _two_backends(stack)
            before = await _ask(stack, 2)
            assert [r.headers["x-iop-provider"] for r in before] == ["node-a/gpu0", "node-a/gpu0"]
            first_backend = stack.daemons[0]
            first_backend.kill()
            await first_backend.wait()
            after = await _ask(stack, 6)
            assert [r.status_code for r in after] == [200] * 6
            assert {r.headers["x-iop-provider"] for r in after} == {"node-a/gpu1"}
            assert [r.headers["x-iop-attempts"] for r in after] == ["2", "2", "1", "1", "1", "1"]
            status = await stack.status()
            gpu0 = provider(status, "gpu0")
            assert (gpu0["health"], gpu0["failures"], gpu0["ejections"]) == ("ejected", 2, 1)
            assert provider(status, "gpu1")["health"] == "online"
            assert status["panic"] == []
            assert drained(await stack.wait_status(drained))


async def test_backend_500_fails_over_then_recovers_after_ejection(tmp_path: Path) -> None:
    """[failover-before-first-byte] [outlier-ejection] backend A answers 500: every request 200 from
    gpu1, gpu0 ejected; A healed: after the ejection time the probe goes to gpu0, it serves again
    and /status shows it online."""
    with trio.fail_after(60):
        async with open_stack(tmp_path) as stack:
            port_a, _ = await _two_backends(stack, fail_status=500)
            answers = await _ask(stack, 4)
            assert [r.status_code for r in answers] == [200] * 4
            assert {r.headers["x-iop-provider"] for r in answers} == {"node-a/gpu1"}
            assert [r.headers["x-iop-attempts"] for r in answers] == ["2", "2", "1", "1"]
            assert provider(await stack.status(), "gpu0")["health"] == "ejected"
            await stack.http.post(f"http://127.0.0.1:{port_a}/fault", json={"status": None})
            await stack.wait_status(lambda s: provider(s, "gpu0")["ejection_left"] == 0)
            served_by_a = None
            for _ in range(20):  # the probe: the next request that picks gpu0
                response = await stack.chat(BIG)
                assert response.status_code == 200
                if response.headers["x-iop-provider"] == "node-a/gpu0":
                    served_by_a = response
                    break
            assert served_by_a is not None and served_by_a.headers["x-iop-attempts"] == "1"
            gpu0 = provider(await stack.status(), "gpu0")
            assert (gpu0["health"], gpu0["failures"], gpu0["probes"]) == ("online", 0, 1)
            assert drained(await stack.wait_status(drained))


async def test_backend_400_is_passed_through_not_retried_no_ejection(tmp_path: Path) -> None:
    """[failover-before-first-byte] a backend's 400 (max_tokens above the mock's limit) is the
    client's error: one attempt, backend B never asked, no failure counted against gpu0."""
    with trio.fail_after(60):
        async with open_stack(tmp_path) as stack:
            _, port_b = await _two_backends(stack)
            for _ in range(3):
                response = await stack.chat(BIG, max_tokens=100_000)
                assert response.status_code == 400, response.text  # passed through [upstream-error-passthrough]
                assert response.headers["x-iop-reject-reason"] == "upstream_client_error"
                assert response.headers["x-iop-attempts"] == "1"
            stats_b = (await stack.http.get(f"http://127.0.0.1:{port_b}/stats")).json()
            assert stats_b["total"] == 0
            gpu0 = provider(await stack.status(), "gpu0")
            assert (gpu0["health"], gpu0["failures"], gpu0["ejections"]) == ("online", 0, 0)
            assert drained(await stack.wait_status(drained))
