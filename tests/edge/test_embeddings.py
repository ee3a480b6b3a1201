"""[embeddings] ``POST /v1/embeddings`` under admission, like any request.

A fake node shows exactly what the Edge sends (one ``run``, endpoint ``embeddings``, the body
as sent but the model) and that the long classification counts the input; a real in-process
node answers the official ``openai`` client with the mock's deterministic vectors (``mock``
adapter, and the ``ollama`` adapter in front of the mock backend's ``/api/embed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from edge.harness import (
    BIG,
    FAST,
    LONG_THRESHOLD,
    Edge,
    eventually,
    fake_node,
    mock_provider,
    node_config,
    real_node,
    running_edge,
)
from iop_mock import MockBackend, serve_mock_backend
from iop_mock import embedding as mock_embedding
from iop_node import ProviderConfig
from iop_wire import RunEnd

pytestmark = pytest.mark.req("embeddings")

ANSWER = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [1.0]}], "model": "x"}


async def embed(edge: Edge, results: dict[str, httpx.Response], name: str, **body: Any) -> None:
    results[name] = await edge.http.post("/v1/embeddings", json=body)


async def test_one_run_with_the_body_as_sent(tmp_path: Path) -> None:
    """One lease, one ``run`` (endpoint embeddings, not a stream, no stream key added), the answer as is."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: embed(edge, results, "e", model=FAST, input=["a", "b"], encoding_format="base64")
                )
                run = await node.next_run()
                assert (run.endpoint, run.stream) == ("embeddings", False)
                assert run.body == {"model": "qwen3:35b-fast", "input": ["a", "b"], "encoding_format": "base64"}
                assert edge.provider("node-a", "gpu0")["in_flight"] == 1
                await node.send_json(run.run_id, ANSWER)
                await node.send(RunEnd(run.run_id, "ok"))
            response = results["e"]
            assert response.status_code == 200
            assert response.json() == ANSWER
            assert response.headers["x-iop-provider"] == "node-a/gpu0"
            await edge.assert_drained()


@pytest.mark.parametrize(
    ("value", "long"),
    [
        ("x" * (LONG_THRESHOLD * 4), False),  # exactly the threshold: not above it
        ("x" * (LONG_THRESHOLD * 4 + 4), True),
        (["x" * (LONG_THRESHOLD * 2), "y" * (LONG_THRESHOLD * 2 + 4)], True),
        (list(range(LONG_THRESHOLD + 1)), True),
        ([[1] * 60, [2] * 41], True),
        ([[1] * 60, [2] * 40], False),
    ],
)
async def test_long_classification_counts_the_input(tmp_path: Path, value: Any, long: bool) -> None:
    """Characters / 4 plus token ids against the model key's long threshold: a long request holds a long slot."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: embed(edge, results, "e", model=BIG, input=value))
                run = await node.next_run()
                assert edge.provider("node-a", "gpu0")["long_in_flight"] == int(long)
                assert run.long is long  # [held-elsewhere] the node knows which runs are long
                await node.send_json(run.run_id, ANSWER)
                await node.send(RunEnd(run.run_id, "ok"))
            assert results["e"].status_code == 200
            await edge.assert_drained()


@pytest.mark.parametrize(
    "body", [{"model": BIG}, {"model": BIG, "input": []}, {"model": BIG, "input": [1, "a"]}, {"input": "a"}]
)
async def test_bad_input_is_400_before_admission(tmp_path: Path, body: dict[str, Any]) -> None:
    """No input, an empty one, a mixed list, no model: 400 bad_request, no lease, no queue entry."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            response = await edge.http.post("/v1/embeddings", json=body)
            assert response.status_code == 400
            assert response.json()["error"]["code"] == "bad_request"
            await edge.assert_drained()


async def test_embeddings_share_the_providers_capacity_with_chat(tmp_path: Path) -> None:
    """A chat holds the capacity-1 gpu0: an embeddings request for the other key waits for it (one lease each)."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: edge.chat(FAST))
                chat = await node.next_run()
                nursery.start_soon(lambda: embed(edge, results, "e", model=FAST, input="a"))
                await eventually(lambda: edge.queue_depth == 1)
                await node.answer(chat)
                run = await node.next_run()
                assert run.endpoint == "embeddings"
                await node.send_json(run.run_id, ANSWER)
                await node.send(RunEnd(run.run_id, "ok"))
            assert results["e"].status_code == 200
            await edge.assert_drained()


async def test_openai_client_every_input_shape(tmp_path: Path) -> None:
    """The official client (base64 on the wire by default) gets the mock's vectors for every input shape."""
    with trio.fail_after(20):
        async with running_edge(tmp_path) as edge:
            async with real_node(edge, node_config(edge, "node-a", [mock_provider("gpu0")])):
                async with edge.openai_client() as client:
                    one = await client.embeddings.create(model=BIG, input="hello")
                    many = await client.embeddings.create(model=FAST, input=["a", "b"], encoding_format="float")
                    tokens = await client.embeddings.create(model=BIG, input=[1, 2, 3])
                    token_lists = await client.embeddings.create(model=BIG, input=[[1, 2], [3]], dimensions=3)
                await edge.assert_drained()
    assert one.data[0].embedding == pytest.approx(mock_embedding.vector("hello"), rel=1e-6)
    assert [d.embedding for d in many.data] == [mock_embedding.vector("a"), mock_embedding.vector("b")]
    assert tokens.data[0].embedding == pytest.approx(mock_embedding.vector([1, 2, 3]), rel=1e-6)
    assert [len(d.embedding) for d in token_lists.data] == [3, 3]
    assert tokens.usage.prompt_tokens == 3


async def test_ollama_provider_answers_in_openai_shape(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The ollama adapter calls the backend's /api/embed; the client gets an OpenAI embeddings list."""
    backend = MockBackend()
    port = await nursery.start(serve_mock_backend, backend)
    provider = ProviderConfig(id="gpu0", adapter="ollama", base_url=f"http://127.0.0.1:{port}", capacity=1)
    with trio.fail_after(20):
        async with running_edge(tmp_path) as edge:
            async with real_node(edge, node_config(edge, "node-a", [provider])):
                async with edge.openai_client() as client:
                    answer = await client.embeddings.create(model=BIG, input=["x", "y"])
                    with pytest.raises(openai.BadRequestError) as refused:
                        await client.embeddings.create(model=BIG, input=[1, 2])
                await edge.assert_drained()
    assert answer.data[1].embedding == pytest.approx(mock_embedding.vector("y"), rel=1e-6)
    assert answer.model == "qwen3:35b"
    assert refused.value.code == "unsupported_input"
    assert backend.stats()["total"] == 1
