"""Fake embeddings, for the mock backend and the mock adapter: deterministic vectors.

Pure functions: no I/O, no clock, no randomness. The vector of an input depends only on the
input and the dimension count: the SHA-256 stream of the input's canonical JSON text, read as
signed bytes and scaled to unit length. So the same text always gets the same vector, two
different texts (almost surely) different ones, and a test can compare an answer with
:func:`vector` directly.

Inputs follow OpenAI's ``/v1/embeddings``: ``input`` is a string, a list of strings, a list of
token ids or a list of token-id lists. Ollama's ``/api/embed`` takes a string or a list of
strings.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from typing import Any

__all__ = [
    "DEFAULT_DIMENSIONS",
    "MAX_DIMENSIONS",
    "EmbeddingInput",
    "dimensions_of",
    "embedding_inputs",
    "embedding_response",
    "input_tokens",
    "ollama_embed_response",
    "vector",
]

DEFAULT_DIMENSIONS = 8
"""Vector length when the request names no ``dimensions``."""

MAX_DIMENSIONS = 4096
"""The largest ``dimensions`` the mock accepts."""

EmbeddingInput = str | list[int]
"""One item to embed: a text or a list of token ids."""


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def embedding_inputs(body: dict[str, Any], *, ollama: bool = False) -> list[EmbeddingInput]:
    """The items of a request's ``input``, in order.

    Raises:
        ValueError: ``input`` is missing, empty, or not one of the accepted shapes (Ollama:
            a string or a list of strings).
    """
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if not ollama and _is_token_list(value):
            return [value]
        if not ollama and all(_is_token_list(item) and item for item in value):
            return list(value)
    shapes = "a string or a list of strings" if ollama else "a string, a list of strings or token lists"
    raise ValueError(f"'input' must be {shapes}")


def dimensions_of(body: dict[str, Any]) -> int:
    """The requested vector length (``dimensions``), or :data:`DEFAULT_DIMENSIONS`.

    Raises:
        ValueError: ``dimensions`` is not an integer from 1 to :data:`MAX_DIMENSIONS`.
    """
    value = body.get("dimensions")
    if value is None:
        return DEFAULT_DIMENSIONS
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIMENSIONS:
        raise ValueError(f"'dimensions' must be an integer from 1 to {MAX_DIMENSIONS}")
    return value


def input_tokens(item: EmbeddingInput) -> int:
    """The tokens an item counts for in ``usage``: its token ids, or one per 4 characters (at least 1)."""
    if isinstance(item, str):
        return max(1, len(item) // 4)
    return len(item)


def vector(item: EmbeddingInput, dimensions: int = DEFAULT_DIMENSIONS) -> list[float]:
    """The deterministic unit vector of ``item``."""
    seed = json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode()
    raw = b""
    block = 0
    while len(raw) < dimensions:
        raw += hashlib.sha256(seed + block.to_bytes(4, "big")).digest()
        block += 1
    values = [(byte - 127.5) for byte in raw[:dimensions]]
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def _encoded(values: list[float], encoding_format: object) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def embedding_response(model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``/v1/embeddings`` answer to ``body``.

    Honours ``dimensions`` and ``encoding_format`` (``float``, the default, or ``base64``).

    Raises:
        ValueError: the body's ``input``, ``dimensions`` or ``encoding_format`` is not accepted.
    """
    items = embedding_inputs(body)
    dimensions = dimensions_of(body)
    encoding_format = body.get("encoding_format", "float")
    if encoding_format not in ("float", "base64", None):
        raise ValueError("'encoding_format' must be 'float' or 'base64'")
    tokens = sum(input_tokens(item) for item in items)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": _encoded(vector(item, dimensions), encoding_format)}
            for index, item in enumerate(items)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def ollama_embed_response(model: str, body: dict[str, Any]) -> dict[str, Any]:
    """Ollama's ``/api/embed`` answer to ``body`` (``embeddings``: one float list per input).

    Raises:
        ValueError: the body's ``input`` or ``dimensions`` is not accepted.
    """
    items = embedding_inputs(body, ollama=True)
    dimensions = dimensions_of(body)
    return {
        "model": model,
        "embeddings": [vector(item, dimensions) for item in items],
        "total_duration": 0,
        "load_duration": 0,
        "prompt_eval_count": sum(input_tokens(item) for item in items),
    }
