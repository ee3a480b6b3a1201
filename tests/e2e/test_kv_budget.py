"""[token-ledger] Real processes: a mock backend whose KV pool really runs out (``--kv-tokens``), once
overcommitted directly and once behind an Edge whose provider's token budget is that pool.

The pool holds 2,048 tokens. Ten streams at once, each a prompt of 400 characters (100 tokens to the
mock) and ``max_tokens`` 300, need 4,000 at their end: sent straight to the mock they all start
(1,000) and run out at their 105th step, so the mock preempts (mode ``preempt``) or fails (mode
``fail``); they would not only if their arrivals spread over more than 216 steps (a second at 200
tokens/s): on a box that busy the direct burst is sent again, up to five times. The same ten through the Edge (``admit_by: tokens``, ``total_context_tokens`` 2,048) each
reserve 715 (the prompt's 400 bytes and the message's overhead, plus 300): two run at once, the
others wait in the ledger, and the mock neither preempts nor fails. Meanwhile the Edge's ``/status``
shows the engine's reported KV use (the Node's probe of ``/metrics`` or ``/slots``) beside the
reservations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from e2e.harness import FAST, Stack, drained, edge_config, node_config, open_stack, provider

pytestmark = pytest.mark.req("token-ledger")

POOL = 2_048
STREAMS = 10
DIRECT_BURSTS = 5
MAX_TOKENS = 300
CONTENT = "k" * 400
HEALTH = {"interval_ms": 100, "timeout_ms": 1000, "no_traffic_interval_ms": 100}


def body() -> dict[str, Any]:
    return {
        "model": FAST,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": CONTENT}],
    }


async def burst(http: httpx.AsyncClient, url: str) -> list[tuple[int, int, bool]]:
    """``STREAMS`` streams at once; for each: its status, the tokens it carried, whether it ended whole."""
    results: list[tuple[int, int, bool]] = []

    async def one() -> None:
        async with http.stream("POST", url, json=body()) as response:
            data = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        tokens = content_tokens(data)
        whole = bool(data) and data[-1] == "[DONE]" and not any('"error"' in item for item in data)
        results.append((response.status_code, tokens, whole))

    async with trio.open_nursery() as nursery:
        for _ in range(STREAMS):
            nursery.start_soon(one)
    return results


def content_tokens(data: list[str]) -> int:
    return sum(
        1
        for item in data
        if item.startswith("{") and any(c.get("delta", {}).get("content") for c in json.loads(item).get("choices", ()))
    )


async def start(stack: Stack, mode: str, probe: str) -> str:
    await stack.start_backend(
        latency_ms=0, tokens_per_second=200, options=["--kv-tokens", str(POOL), "--kv-mode", mode]
    )
    config = edge_config(providers={"gpu0": 8})
    (gpu0,) = config["nodes"][0]["providers"]
    gpu0.update(admit_by="tokens", context_window_tokens=POOL, total_context_tokens=POOL)
    await stack.start_edge(config)
    node: dict[str, Any] = node_config(providers={"gpu0": 8})
    node["providers"][0]["health"] = {**HEALTH, "probe": probe}
    await stack.start_node(node)
    return f"http://127.0.0.1:{stack.backend_port}"


@pytest.mark.parametrize(("mode", "probe"), [("preempt", "vllm"), ("fail", "llama_cpp")])
async def test_a_burst_that_overcommits_the_mock_runs_whole_through_the_ledger(
    tmp_path: Path, mode: str, probe: str
) -> None:
    with trio.fail_after(240):  # generous: a busy box
        async with open_stack(tmp_path) as stack:
            backend = await start(stack, mode, probe)
            for _ in range(DIRECT_BURSTS):  # a box too busy to start ten streams within a second: again
                direct = await burst(stack.http, f"{backend}/v1/chat/completions")
                before = (await stack.http.post(f"{backend}/stats/reset")).json()
                harm = before["preemptions"] if mode == "preempt" else before["context_errors"]
                if mode == "preempt":
                    assert direct == [(200, MAX_TOKENS, True)] * STREAMS  # slowed down, recomputed, whole
                if harm:
                    break
            assert harm > 0, before
            if mode == "fail":
                assert sum(whole for _, _, whole in direct) < STREAMS  # some failed

            # The engine's view after the direct burst: an idle pool, and no cut left (a preemption's
            # cut lasts until a report without a new one).
            idle = await stack.wait_status(
                lambda s: (
                    provider(s, "gpu0")["reported_kv_use"] == 0.0
                    and provider(s, "gpu0")["effective_token_budget"] == POOL
                )
            )
            assert provider(idle, "gpu0")["reported_preemptions"] == (harm if probe == "vllm" else None)
            seen: list[dict[str, Any]] = []
            async with trio.open_nursery() as nursery:

                async def through_the_edge() -> None:
                    seen.append({"results": await burst(stack.http, f"{stack.base_url}/v1/chat/completions")})

                nursery.start_soon(through_the_edge)
                both = await stack.wait_status(
                    lambda s: (
                        bool(provider(s, "gpu0")["reported_kv_use"]) and provider(s, "gpu0")["reserved_tokens"] > 0
                    ),
                    timeout=60,
                )
            after = await stack.backend_stats()
            status = await stack.wait_status(drained)
    assert seen[0]["results"] == [(200, MAX_TOKENS, True)] * STREAMS
    assert (after["preemptions"], after["context_errors"]) == (before["preemptions"], before["context_errors"])
    assert after["kv_used"] == 0 and after["total"] == STREAMS
    # Two reservations of 715 fit, a third only once one settled (its run over): at most two of the
    # mock's sequences, 400 tokens each at their end, ever held the pool at once.
    assert before["kv_peak"] == 0 and after["kv_peak"] <= 2 * (100 + MAX_TOKENS)
    gpu0 = provider(both, "gpu0")
    assert gpu0["token_budget"] == POOL and 0 < gpu0["reported_kv_use"] <= 1
    assert 715 <= gpu0["reserved_tokens"] <= POOL
    assert provider(status, "gpu0")["reserved_tokens"] == 0
