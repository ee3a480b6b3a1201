"""[capacity-smoke] Real processes: mock backend, Edge, Node; the official ``openai`` client.

Two model keys, ``ornith:35b`` and ``ornith-fast``, share the capacity-1 provider
``node-a/gpu0``. Called at the same time (stream and non-stream), the backend never sees
more than one request at once; afterwards every provider counter and the queue are 0.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio

from e2e.harness import BIG, FAST, Stack, drained, edge_config, node_config, open_stack, provider


def call(client: openai.OpenAI, model: str, *, stream: bool) -> tuple[str, str]:
    """One chat completion in a worker thread; returns (x-iop-provider, generated text)."""
    messages = [{"role": "user", "content": f"hello {model}"}]
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=3,
        stream=stream,  # type: ignore[arg-type]
    )
    served_by = raw.headers["x-iop-provider"]
    if not stream:
        return served_by, raw.parse().choices[0].message.content or ""  # type: ignore[union-attr]
    text = []
    with raw.parse() as chunks:  # type: ignore[union-attr]
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
    return served_by, "".join(text)


async def call_all(stack: Stack, calls: list[tuple[str, bool]]) -> list[tuple[str, str, str]]:
    """Run every (model, stream) call at once, each in its own thread; (model, provider, text)."""
    results: list[tuple[str, str, str]] = []
    with openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=20.0) as client:

        async def one(model: str, stream: bool) -> None:
            served_by, text = await trio.to_thread.run_sync(lambda: call(client, model, stream=stream))
            results.append((model, served_by, text))

        async with trio.open_nursery() as nursery:
            for model, stream in calls:
                nursery.start_soon(one, model, stream)
    return results


CALLS = [(model, stream) for model in (BIG, FAST) for stream in (False, True) for _ in range(2)]
"""Two of each: both model keys, stream and non-stream (8 requests)."""


async def start(stack: Stack, **edge: object) -> None:
    await stack.start_backend(latency_ms=150, tokens_per_second=100)
    await stack.start_edge(edge_config(**edge))  # type: ignore[arg-type]
    await stack.start_node(node_config(providers={"gpu0": 2, "gpu1": 2}))


@pytest.mark.req("capacity-smoke", "provider-state")
async def test_capacity_smoke_two_models_one_provider(tmp_path: Path) -> None:
    """[capacity-smoke] [provider-state] ornith:35b and ornith-fast on the capacity-1 gpu0
    only, 8 concurrent calls: every call succeeds on gpu0, the backend's peak concurrency
    is 1, and afterwards every counter and the queue depth are 0.

    The node would allow 2 at once on gpu0: only the Edge's provider-wide lease keeps it at 1.
    """
    with trio.fail_after(40):
        async with open_stack(tmp_path) as stack:
            await start(stack, providers={"gpu0": 1})
            results = await call_all(stack, CALLS)
            stats = await stack.backend_stats()
            status = await stack.wait_status(drained)
    assert sorted((m, p) for m, p, _ in results) == sorted((m, "node-a/gpu0") for m, _ in CALLS)
    assert all(text for _, _, text in results)
    assert stats["peak_in_flight"] == 1
    assert stats["total"] == len(CALLS)
    assert stats["in_flight"] == 0
    assert drained(status)


@pytest.mark.req("capacity-smoke", "cross-group-wakeup")
async def test_capacity_smoke_with_fallback(tmp_path: Path) -> None:
    """[capacity-smoke] [cross-group-wakeup] ornith:35b may fall back to gpu1 (capacity 1);
    ornith-fast stays on gpu0: the backend never sees more than 2 at once, ornith-fast is
    only ever served by gpu0, a request for ornith:35b while gpu0 is busy goes to gpu1, and
    every counter returns to 0."""
    with trio.fail_after(40):
        async with open_stack(tmp_path) as stack:
            await start(
                stack,
                providers={"gpu0": 1, "gpu1": 1},
                models={BIG: ["gpu0", "gpu1"], FAST: ["gpu0"]},
            )
            # Deterministic fallback: hold gpu0 with a long ornith-fast stream, then ask
            # for ornith:35b.
            async with stack.http.stream(
                "POST",
                f"{stack.base_url}/v1/chat/completions",
                json={
                    "model": FAST,
                    "stream": True,
                    "max_tokens": 150,
                    "messages": [{"role": "user", "content": "hold gpu0"}],
                },
            ) as held:
                assert held.headers["x-iop-provider"] == "node-a/gpu0"
                busy = await stack.status()
                fallback = await stack.chat(BIG)
                tail = [line async for line in held.aiter_lines() if line]
            results = await call_all(stack, CALLS)
            stats = await stack.backend_stats()
            status = await stack.wait_status(drained)
    assert provider(busy, "gpu0")["in_flight"] == 1
    assert fallback.status_code == 200
    assert fallback.headers["x-iop-provider"] == "node-a/gpu1"
    assert tail[-1] == "data: [DONE]"
    assert {p for m, p, _ in results if m == FAST} == {"node-a/gpu0"}
    assert {p for m, p, _ in results if m == BIG} <= {"node-a/gpu0", "node-a/gpu1"}
    assert all(text for _, _, text in results)
    assert 1 <= stats["peak_in_flight"] <= 2
    assert stats["total"] == len(CALLS) + 2
    assert drained(status)
