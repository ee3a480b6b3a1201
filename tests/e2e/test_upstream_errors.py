"""[upstream-error-passthrough] Real processes: mock backend, Edge, Node; the official ``openai`` client.

The mock backend refuses ``max_tokens`` above 65,536 with a 400 and an OpenAI error
body. Through the Node and the Edge the client gets that 400 (``BadRequestError``
with the backend's message and code), and, though the client retries 5xx and 429
by default, the Edge admits the request exactly once.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness import BIG, drained, edge_config, node_config, open_stack


def refused_call(base_url: str) -> openai.BadRequestError:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=2, timeout=20.0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=BIG, messages=[{"role": "user", "content": "hi"}], max_tokens=100_000, stream=True
            )
    return caught.value


@pytest.mark.req("upstream-error-passthrough")
async def test_backend_400_reaches_the_openai_client_once(tmp_path: Path) -> None:
    """[upstream-error-passthrough] a backend 400 is the client's 400, with the backend's body, not retried."""
    with trio.fail_after(40):
        async with open_stack(tmp_path) as stack:
            await stack.start_backend(latency_ms=0)
            await stack.start_edge(edge_config())
            await stack.start_node(node_config())
            error = await trio.to_thread.run_sync(refused_call, f"{stack.base_url}/v1")
            status = await stack.wait_status(drained)
            metrics = (await stack.http.get(f"{stack.base_url}/metrics")).text
    assert error.status_code == 400
    assert error.code == "invalid_value"
    assert "maximum of 65536" in error.message
    assert error.response.headers["x-iop-provider"] == "node-a/gpu0"
    assert error.response.headers["x-iop-reject-reason"] == "upstream_client_error"
    samples = {
        (s.name, s.labels.get("outcome")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name in ("iop_admitted_total", "iop_lease_endings_total")
    }
    assert samples[("iop_admitted_total", None)] == 1  # one lease: the client did not retry
    assert samples[("iop_lease_endings_total", "client_error")] == 1
    assert drained(status)
