"""[embeddings] Real processes: mock backend, Edge, Node (``openai`` adapter); the official ``openai`` client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio

from e2e.harness import BIG, FAST, drained, edge_config, node_config, open_stack
from iop_mock import embedding as mock_embedding


def embed_both(base_url: str) -> tuple[openai.types.CreateEmbeddingResponse, openai.types.CreateEmbeddingResponse]:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=20.0) as client:
        texts = client.embeddings.create(model=BIG, input=["alpha", "beta"])
        tokens = client.embeddings.create(model=FAST, input=[[1, 2, 3]], dimensions=5, encoding_format="float")
    return texts, tokens


@pytest.mark.req("embeddings")
async def test_embeddings_through_edge_and_node(tmp_path: Path) -> None:
    """[embeddings] both model keys on the capacity-1 gpu0: the mock backend's vectors, one request each."""
    with trio.fail_after(40):
        async with open_stack(tmp_path) as stack:
            await stack.start_backend(latency_ms=0)
            await stack.start_edge(edge_config())
            await stack.start_node(node_config())
            texts, tokens = await trio.to_thread.run_sync(embed_both, f"{stack.base_url}/v1")
            stats = await stack.backend_stats()
            status = await stack.wait_status(drained)
    assert [d.index for d in texts.data] == [0, 1]
    assert texts.data[1].embedding == pytest.approx(mock_embedding.vector("beta"), rel=1e-6)
    assert texts.model == "qwen3:35b"
    assert tokens.data[0].embedding == mock_embedding.vector([1, 2, 3], 5)
    assert tokens.usage.prompt_tokens == 3
    assert stats["total"] == 2 and stats["peak_in_flight"] == 1
    assert drained(status)
