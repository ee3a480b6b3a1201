"""[embeddings] The mock's deterministic embeddings: pure builders and the backend's two routes."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import httpx
import openai
import pytest
import trio

from iop_mock import MockBackend, serve_mock_backend
from iop_mock import embedding as mock_embedding

pytestmark = pytest.mark.req("embeddings")

TIMEOUT = 10.0


def test_vectors_are_deterministic_unit_vectors() -> None:
    first = mock_embedding.vector("hello", 16)
    assert first == mock_embedding.vector("hello", 16)
    assert first != mock_embedding.vector("hello!", 16)
    assert mock_embedding.vector([1, 2, 3]) != mock_embedding.vector("[1,2,3]"[1:-1])
    assert len(first) == 16 and math.isclose(sum(v * v for v in first), 1.0)
    assert len(mock_embedding.vector("x", 100)) == 100  # longer than one SHA-256 block


@pytest.mark.parametrize(
    ("value", "items"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_inputs_of_every_openai_shape(value: Any, items: list[Any]) -> None:
    assert mock_embedding.embedding_inputs({"input": value}) == items


@pytest.mark.parametrize("value", [None, [], 5, [True], ["a", 1], [[1], []], {"a": 1}])
def test_other_inputs_are_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="'input' must be"):
        mock_embedding.embedding_inputs({"input": value})


def test_ollama_takes_text_only() -> None:
    with pytest.raises(ValueError, match="a string or a list of strings"):
        mock_embedding.embedding_inputs({"input": [1, 2]}, ollama=True)


def test_response_shape_usage_and_base64() -> None:
    plain = mock_embedding.embedding_response("m", {"input": ["abcdefgh", "x"], "dimensions": 4})
    packed = mock_embedding.embedding_response("m", {"input": [5, 6, 7], "dimensions": 4, "encoding_format": "base64"})
    assert plain["object"] == "list" and plain["model"] == "m"
    assert [d["index"] for d in plain["data"]] == [0, 1]
    assert plain["data"][0]["embedding"] == mock_embedding.vector("abcdefgh", 4)
    assert plain["usage"] == {"prompt_tokens": 2 + 1, "total_tokens": 3}
    assert packed["usage"]["prompt_tokens"] == 3
    decoded = struct.unpack("<4f", base64.b64decode(packed["data"][0]["embedding"]))
    assert decoded == pytest.approx(mock_embedding.vector([5, 6, 7], 4), rel=1e-6)
    with pytest.raises(ValueError, match="dimensions"):
        mock_embedding.embedding_response("m", {"input": "a", "dimensions": 0})
    with pytest.raises(ValueError, match="encoding_format"):
        mock_embedding.embedding_response("m", {"input": "a", "encoding_format": "int8"})


@pytest.fixture
async def backend_url(nursery: trio.Nursery) -> tuple[MockBackend, str]:
    backend = MockBackend()
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(serve_mock_backend, backend)
    return backend, f"http://127.0.0.1:{port}"


async def test_backend_serves_openai_and_ollama_embeddings(backend_url: tuple[MockBackend, str]) -> None:
    """/v1/embeddings through the official client (base64 by default), /api/embed in Ollama's shape,
    a 400 for an input of another shape; both count in /stats."""
    backend, url = backend_url
    with trio.fail_after(TIMEOUT):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            answer = await client.embeddings.create(model="e", input=["one", "two"])
        async with httpx.AsyncClient(base_url=url) as http:
            ollama = (await http.post("/api/embed", json={"model": "e", "input": "one"})).json()
            refused = await http.post("/api/embed", json={"model": "e", "input": [1, 2]})
    assert answer.data[0].embedding == pytest.approx(mock_embedding.vector("one"), rel=1e-6)
    assert answer.data[1].embedding == pytest.approx(mock_embedding.vector("two"), rel=1e-6)
    assert answer.model == "e" and answer.usage.prompt_tokens == 2
    assert ollama["embeddings"] == [mock_embedding.vector("one")] and ollama["model"] == "e"
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_value"
    assert backend.stats()["total"] == 2
