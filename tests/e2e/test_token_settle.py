"""[token-ledger] Real processes: the Edge settles a run's context-token reservation with the usage the
mock backend reports, and every reservation comes back.

gpu0 admits by tokens (a budget of 8,192, a window of 4,096). A request of 400 characters and
``max_tokens`` 20 reserves at the Edge its 400 bytes and its role's 4 (each text's bytes plus one), the
template's 9 tokens, plus 20: 435; the mock counts its prompt as 400 / 4 = 100 tokens and generates 20, so its usage is 120. The moment of the settlement
(the usage relayed, the lease still held) is shown with a scripted node in
``tests/edge/test_token_ledger.py``; here the run's end follows its usage chunk within a read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from e2e.harness import FAST, Stack, drained, edge_config, node_config, open_stack, provider

pytestmark = pytest.mark.req("token-ledger")

BUDGET = 8_192
CONTENT = "t" * 400
RESERVE = 401 + 5 + 4 + 5 + 20
USAGE = 100 + 20


def budgeted_edge() -> dict[str, Any]:
    """One provider gpu0, capacity 8, admitting by a token budget."""
    config = edge_config(providers={"gpu0": 8})
    (gpu0,) = config["nodes"][0]["providers"]
    gpu0.update(admit_by="tokens", context_window_tokens=4_096, total_context_tokens=BUDGET)
    return config


def body(stream: bool) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": FAST,
        "stream": stream,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": CONTENT}],
    }
    if stream:
        request["stream_options"] = {"include_usage": True}
    return request


async def reserved(stack: Stack) -> int:
    value = provider(await stack.status(), "gpu0")["reserved_tokens"]
    assert isinstance(value, int)
    return value


async def test_a_streams_usage_settles_its_reservation_and_every_reservation_returns(tmp_path: Path) -> None:
    """A stream holds its estimate until its usage chunk; once the usage passed through the Edge the
    reservation is the usage (the lease still held) or 0 (released), never the estimate; 12 streams and
    whole answers at once, /status polled meanwhile: never negative, never above the budget, 0 at the end."""
    with trio.fail_after(60):
        async with open_stack(tmp_path) as stack:
            await stack.start_backend(latency_ms=50, tokens_per_second=40)
            await stack.start_edge(budgeted_edge())
            await stack.start_node(node_config(providers={"gpu0": 8}))
            url = f"{stack.base_url}/v1/chat/completions"

            async with stack.http.stream("POST", url, json=body(True)) as response:
                lines = response.aiter_lines()
                async for line in lines:
                    if '"content"' in line:
                        break
                assert await reserved(stack) == RESERVE  # the first token came; no usage yet
                async for line in lines:
                    if '"total_tokens"' in line:
                        assert f'"total_tokens":{USAGE}' in line.replace(" ", "")
                        break
                assert await reserved(stack) in (USAGE, 0)
                tail = [line async for line in lines if line]
            assert tail[-1] == "data: [DONE]"

            seen: list[int] = []
            statuses: list[int] = []

            async def one(stream: bool) -> None:
                statuses.append((await stack.http.post(url, json=body(stream))).status_code)

            async with trio.open_nursery() as nursery:
                for i in range(12):
                    nursery.start_soon(one, i % 2 == 0)
                while len(statuses) < 12:
                    seen.append(await reserved(stack))
                    await trio.sleep(0.01)
            status = await stack.wait_status(drained)
    assert statuses == [200] * 12
    assert max(seen) > 0 and all(0 <= value <= BUDGET for value in seen)
    assert provider(status, "gpu0")["reserved_tokens"] == 0
