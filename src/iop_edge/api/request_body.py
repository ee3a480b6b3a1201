"""What the Edge reads of a request body: JSON decoding, the fields it checks, the token estimate.

The Edge reads only what it decides on (the model, ``stream``, the token estimate for the
long-request classification and tenant cost); the rest of the body is the backend's.
"""

from __future__ import annotations

import json
import math
from typing import Any

from iop_edge.api.rejections import RequestRejected

CHARS_PER_TOKEN = 4
"""Prompt characters per estimated token, for the long-request classification."""


def checked_stream(endpoint: str, body: dict[str, Any]) -> bool:
    """Check the fields the Edge reads for ``endpoint``; return whether the answer streams.

    Raises:
        RequestRejected: 400 ``bad_request`` naming the field.
    """
    if endpoint == "embeddings":
        if not is_embedding_input(body.get("input")):
            raise RequestRejected(
                400,
                "bad_request",
                "'input' is required: a non-empty string, a list of strings, a token list or a list of token lists",
            )
        return False  # never a stream
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestRejected(400, "bad_request", "'messages' is required and must be a non-empty list")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list):
            raise RequestRejected(400, "bad_request", "'prompt' is required and must be a string or a list")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestRejected(400, "bad_request", "'stream' must be true or false")
    return stream


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def is_embedding_input(value: object) -> bool:
    """``input`` of an embeddings request: a non-empty string, or a non-empty list of non-empty
    strings, a token list (integers), or a non-empty list of non-empty token lists."""
    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not value:
        return False
    return (
        all(isinstance(item, str) and item for item in value)
        or _is_token_list(value)
        or all(_is_token_list(item) for item in value)
    )


def embedding_tokens(value: object) -> int:
    """Estimated tokens of an embeddings ``input``: characters / 4, plus one per token id given."""
    if isinstance(value, str):
        return len(value) // CHARS_PER_TOKEN
    if _is_token_list(value):
        return len(value)  # type: ignore[arg-type]
    if not isinstance(value, list):
        return 0
    chars = sum(len(item) for item in value if isinstance(item, str))
    return chars // CHARS_PER_TOKEN + sum(len(item) for item in value if isinstance(item, list))


def estimate_tokens(endpoint: str, body: dict[str, Any]) -> int:
    """Estimated context of a request: prompt characters / 4 plus the output budget.

    For embeddings: the input's characters / 4 plus its token ids (:func:`embedding_tokens`).
    """
    if endpoint == "embeddings":
        return embedding_tokens(body.get("input"))
    chars = 0
    if endpoint == "chat/completions":
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            chars += len(prompt)
        elif isinstance(prompt, list):
            chars += sum(len(p) for p in prompt if isinstance(p, str))
    budget = body.get("max_tokens") or body.get("max_completion_tokens") or 0
    if not isinstance(budget, int) or isinstance(budget, bool):
        budget = 0
    return chars // CHARS_PER_TOKEN + budget


def _reject_constant(name: str) -> None:
    # The stdlib reads NaN/Infinity; the node link (strict JSON) could not carry them.
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise ValueError(f"number {text[:30]} is out of range")
    return value


BODY_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
"""The request body's decoder, built once (``json.loads`` with hooks builds one per call)."""
