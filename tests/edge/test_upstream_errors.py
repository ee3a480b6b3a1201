"""[upstream-error-passthrough] A backend's refusal reaches the client as the backend said it.

A fake node ends runs with exact ``run_end`` frames (status and body of the
backend); a real in-process node with the ``mock`` adapter shows the whole path
with the official ``openai`` client, which must not retry a 400.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from edge.harness import (
    BIG,
    Edge,
    eventually,
    fake_node,
    mock_provider,
    node_config,
    real_node,
    running_edge,
    start_chat,
)
from iop_wire import RunEnd

pytestmark = pytest.mark.req("upstream-error-passthrough")

OPENAI_400 = json.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 2048 tokens",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
)


async def fail_one_run(edge: Edge, end: dict[str, Any], **fields: Any) -> httpx.Response:
    """Send one chat; the fake node ends its run with ``RunEnd(**end)``."""
    results: dict[str, httpx.Response] = {}
    async with fake_node(edge) as node, trio.open_nursery() as nursery:
        start_chat(nursery, edge, results, "x", BIG, **fields)
        run = await node.next_run()
        await node.send(RunEnd(run.run_id, "error", **end))
    return results["x"]


def lease_endings(edge: Edge) -> dict[str, float]:
    body, _ = edge.service.metrics.render()
    for family in text_string_to_metric_families(body.decode()):
        if family.name == "iop_lease_endings":
            return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}
    raise AssertionError("no iop_lease_endings_total")


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_400_keeps_status_and_openai_error(tmp_path: Path, stream: bool) -> None:
    """A backend 400 with an OpenAI body: our 400, message/type/param/code kept, x-iop-provider set."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            end = {"code": "upstream_error", "message": "ctx", "upstream_status": 400, "upstream_body": OPENAI_400}
            response = await fail_one_run(edge, end, stream=stream)
            assert response.status_code == 400
            assert response.headers["content-type"] == "application/json"
            assert response.json() == json.loads(OPENAI_400)
            assert response.headers["x-iop-provider"] == "node-a/gpu0"
            assert response.headers["x-iop-reject-reason"] == "upstream_client_error"
            assert "retry-after" not in response.headers
            await eventually(lambda: lease_endings(edge)["client_error"] == 1)
            assert lease_endings(edge)["error"] == 0
            await edge.assert_drained()


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (  # Ollama's shape
            404,
            '{"error":"model \'qwen3:35b\' not found"}',
            {"message": "model 'qwen3:35b' not found", "type": "not_found_error", "param": None, "code": None},
        ),
        (  # FastAPI's validation answer
            422,
            '{"detail":[{"loc":["body","messages"],"msg":"field required"}]}',
            {
                "message": '[{"loc": ["body", "messages"], "msg": "field required"}]',
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        ),
        (  # not JSON: wrapped
            413,
            "<html>413 Request Entity Too Large</html>",
            {
                "message": "<html>413 Request Entity Too Large</html>",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        ),
        (  # no body at all: the node's message
            400,
            None,
            {"message": "Bad Request", "type": "invalid_request_error", "param": None, "code": None},
        ),
    ],
)
async def test_backend_client_errors_of_any_shape_are_openai_shaped(
    tmp_path: Path, status: int, body: str | None, error: dict[str, Any]
) -> None:
    """404, 413, 422 and bodies that are not OpenAI's: the backend's status, a wrapped error object."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            end = {"code": "upstream_error", "message": "Bad Request", "upstream_status": status, "upstream_body": body}
            response = await fail_one_run(edge, end)
            assert response.status_code == status
            assert response.json() == {"error": error}
            assert response.headers["x-iop-provider"] == "node-a/gpu0"
            await edge.assert_drained()


async def test_backend_429_is_our_429_with_retry_after(tmp_path: Path) -> None:
    """A backend 429 becomes our 429 with Retry-After; its error object is kept."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            body = '{"error":{"message":"slow down","type":"rate_limit_error","code":"rate_limit_exceeded"}}'
            end = {"code": "upstream_error", "message": "slow down", "upstream_status": 429, "upstream_body": body}
            response = await fail_one_run(edge, end)
            assert response.status_code == 429
            assert response.headers["retry-after"] == "1"
            assert response.headers["x-iop-reject-reason"] == "upstream_rate_limited"
            assert response.headers["x-iop-provider"] == "node-a/gpu0"
            assert response.json()["error"] == {
                "message": "slow down",
                "type": "rate_limit_error",
                "param": None,
                "code": "rate_limit_exceeded",
            }
            await edge.assert_drained()


@pytest.mark.parametrize(
    "end",
    [
        {"code": "upstream_error", "message": "oom", "upstream_status": 500, "upstream_body": '{"error":"oom"}'},
        {"code": "upstream_error", "message": "bad key", "upstream_status": 401, "upstream_body": "denied"},
        {"code": "upstream_error", "message": "cut off mid-stream"},
        {"code": "upstream_unreachable", "message": "upstream timed out (ReadTimeout)"},
    ],
)
async def test_provider_failures_stay_502(tmp_path: Path, end: dict[str, Any]) -> None:
    """A backend 5xx (or 401), a broken answer, a timeout: 502 upstream_error, the backend's body not shown."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            response = await fail_one_run(edge, end)
            assert response.status_code == 502
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("upstream_error", "upstream_error")
            assert response.headers["x-iop-reject-reason"] == end["code"]
            assert response.headers["x-iop-provider"] == "node-a/gpu0"
            await eventually(lambda: lease_endings(edge)["error"] == 1)
            await edge.assert_drained()


async def test_openai_client_gets_bad_request_once(tmp_path: Path) -> None:
    """The official client (default retries on) gets BadRequestError from one run: a 400 is not retried."""
    with trio.fail_after(20):
        async with running_edge(tmp_path) as edge:
            async with real_node(edge, node_config(edge, "node-a", [mock_provider("gpu0")])):
                async with edge.openai_client(max_retries=2) as client:
                    with pytest.raises(openai.BadRequestError) as caught:
                        await client.chat.completions.create(
                            model=BIG, messages=[{"role": "user", "content": "hi"}], max_tokens=100_000
                        )
                assert caught.value.status_code == 400
                assert caught.value.code == "invalid_value"
                assert "maximum" in caught.value.message
                assert caught.value.response.headers["x-iop-provider"] == "node-a/gpu0"
                await eventually(lambda: lease_endings(edge)["client_error"] == 1)  # one lease: one attempt
                assert sum(lease_endings(edge).values()) == 1
                await edge.assert_drained()
