"""Fake OpenAI- and Ollama-shaped completion objects, for the mock backend and the mock adapter.

Pure functions: no I/O, no clock, no randomness. The caller passes the identity (``id``,
``created``, ``created_at``) so that output is deterministic and the caller decides how ids and
timestamps are made. Every generated token is the text ``"tok "``; a reply of ``n`` tokens is
``"tok " * n``. It ends because the token limit was reached (``finish_reason="length"``,
Ollama ``done_reason="length"``), which is what a real server reports when it stops at
``max_tokens`` / ``num_predict``, unless the request's ``mock_output_tokens`` hint ends it
sooner at its own end of sequence (``"stop"``, :func:`output_token_count`).

The shapes follow the public APIs closely enough for the official ``openai`` Python client to
parse them (``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``) and for an Ollama client
to read ``/api/chat`` replies. Each call returns fresh dicts, so callers may mutate them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_TOKENS_LIMIT",
    "OUTPUT_HINT",
    "TOKEN_TEXT",
    "chat_chunks",
    "chat_response",
    "completion_chunks",
    "completion_response",
    "finish_reason_of",
    "ollama_chat_lines",
    "ollama_chat_response",
    "output_token_count",
    "prompt_token_count",
    "token_count",
]

TOKEN_TEXT = "tok "
"""The text of every generated token."""

DEFAULT_MAX_TOKENS = 16
"""Tokens generated when a request sets no limit (the OpenAI completions default)."""

MAX_TOKENS_LIMIT = 65_536
"""The largest token limit the mock accepts. A bigger one is refused (``ValueError``) rather
than served: building ``"tok " * n`` for a huge ``n`` would hold the process (and the GIL) in
one allocation for seconds, or exhaust memory, on a single request."""

OUTPUT_HINT = "mock_output_tokens"
"""The request body's field (a mock-only extension) naming the tokens generated before the end of sequence."""

_FINISH_REASON = "length"


def token_count(body: dict[str, Any]) -> int:
    """How many tokens to generate for a request body.

    Reads ``max_tokens``, then ``max_completion_tokens``, then Ollama's ``options.num_predict``;
    a missing, null or zero value falls through to the next one and finally to
    :data:`DEFAULT_MAX_TOKENS`. Negative values (Ollama's ``-1`` means "unlimited") count as 0.

    Args:
        body: the decoded JSON request body.

    Returns:
        The number of tokens, ``>= 0``.

    Raises:
        ValueError: the limit is not an integer (a bool, a string, a float with a fraction,
            infinity or NaN) or is above :data:`MAX_TOKENS_LIMIT`.
    """
    options = body.get("options")
    num_predict = options.get("num_predict") if isinstance(options, dict) else None
    value = body.get("max_tokens") or body.get("max_completion_tokens") or num_predict or DEFAULT_MAX_TOKENS
    _need_integer(value, "token limit")
    if value > MAX_TOKENS_LIMIT:
        raise ValueError(f"token limit is above the mock's maximum of {MAX_TOKENS_LIMIT}")
    return max(0, int(value))


def output_token_count(body: dict[str, Any], limit: int) -> int:
    """How many tokens the mock generates before its end of sequence: the body's
    :data:`OUTPUT_HINT` (``mock_output_tokens``), at most ``limit`` (the request's token limit,
    :func:`token_count`); absent or null, ``limit`` (the generation runs to its limit).

    Raises:
        ValueError: the hint is not an integer (a bool, a string, a float with a fraction,
            infinity or NaN), is negative, or is above :data:`MAX_TOKENS_LIMIT`.
    """
    value = body.get(OUTPUT_HINT)
    if value is None:
        return limit
    _need_integer(value, f"'{OUTPUT_HINT}'")
    if not 0 <= value <= MAX_TOKENS_LIMIT:
        raise ValueError(f"'{OUTPUT_HINT}' must be between 0 and {MAX_TOKENS_LIMIT}, got {int(value)}")
    return min(int(value), limit)


def finish_reason_of(n_tokens: int, limit: int) -> str:
    """``"stop"`` for a generation that ended before its token limit, else ``"length"``."""
    return "stop" if n_tokens < limit else _FINISH_REASON


def _need_integer(value: object, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``value`` is a whole number (not a bool, not a
    float with a fraction, infinity or NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not _is_integral(value):
        raise ValueError(f"{what} must be an integer, got {value!r}")


def _is_integral(value: int | float) -> bool:
    return isinstance(value, int) or (math.isfinite(value) and value == int(value))


def _text_chars(content: object) -> int:
    """Characters of a message's ``content``: a string, or the ``text`` of a list of parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def prompt_token_count(body: dict[str, Any], chars_per_token: float = 4.0) -> int:
    """How many prompt tokens a request body counts for in ``usage``: its characters / ``chars_per_token``.

    The characters are those of every ``messages[].content`` (a string, or the ``text`` of
    its parts) or of ``prompt`` (a string or a list of strings), rounded down: with the
    default 4 this is the Edge's own estimate of a prompt, so a request's reported
    ``total_tokens`` (prompt + generated) equals its reserve under ``tenant_cost: tokens``;
    another ratio stands for a tokenizer the estimate misjudges.

    Args:
        body: the decoded JSON request body.
        chars_per_token: characters per prompt token, ``> 0``.

    Returns:
        The number of prompt tokens, ``>= 0``.
    """
    chars = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        chars += sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) for p in prompt if isinstance(p, str))
    return int(chars / chars_per_token)


def _usage(n_tokens: int, prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens, "total_tokens": prompt_tokens + n_tokens}


def _chat_chunk(
    model: str,
    *,
    id: str,
    created: int,
    delta: dict[str, str],
    finish_reason: str | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunks(
    model: str,
    n_tokens: int,
    *,
    id: str,
    created: int,
    include_usage: bool = False,
    prompt_tokens: int = 0,
    finish: str = _FINISH_REASON,
) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of one streamed chat completion.

    First a chunk whose delta is ``{"role": "assistant"}``, then one chunk per token with delta
    ``{"content": "tok "}``, then a chunk with an empty delta and ``finish_reason`` ``finish`` (``"length"``).

    Args:
        model: echoed in every chunk.
        n_tokens: number of content chunks.
        id: the completion id shared by all chunks (``chatcmpl-...``).
        created: Unix time in seconds shared by all chunks.
        include_usage: as OpenAI's ``stream_options.include_usage``: every chunk carries
            ``"usage": null`` and one last chunk with no choices carries the usage.
        prompt_tokens: the usage's ``prompt_tokens`` (:func:`prompt_token_count`).
        finish: the ``finish_reason`` (:func:`finish_reason_of`).

    Yields:
        Fresh chunk dicts, ``n_tokens + 2`` of them (``+ 3`` with ``include_usage``).
    """
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    yield _chat_chunk(model, id=id, created=created, delta={"role": "assistant"}) | extra
    for _ in range(n_tokens):
        yield _chat_chunk(model, id=id, created=created, delta={"content": TOKEN_TEXT}) | extra
    yield _chat_chunk(model, id=id, created=created, delta={}, finish_reason=finish) | extra
    if include_usage:
        usage_chunk = _chat_chunk(model, id=id, created=created, delta={})
        usage_chunk["choices"] = []
        usage_chunk["usage"] = _usage(n_tokens, prompt_tokens)
        yield usage_chunk


def chat_response(
    model: str, n_tokens: int, *, id: str, created: int, prompt_tokens: int = 0, finish: str = _FINISH_REASON
) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` object with ``usage``.

    Args:
        model: echoed in the response.
        n_tokens: number of tokens in the message content.
        id: the completion id (``chatcmpl-...``).
        created: Unix time in seconds.
        prompt_tokens: the usage's ``prompt_tokens`` (:func:`prompt_token_count`).
        finish: the ``finish_reason`` (:func:`finish_reason_of`).

    Returns:
        A fresh dict.
    """
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": TOKEN_TEXT * n_tokens, "refusal": None},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": _usage(n_tokens, prompt_tokens),
    }


def _completion(model: str, text: str, *, id: str, created: int, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def completion_chunks(
    model: str, n_tokens: int, *, id: str, created: int, finish: str = _FINISH_REASON
) -> Iterator[dict[str, Any]]:
    """The ``text_completion`` chunks of one streamed legacy completion.

    One chunk per token with text ``"tok "``, then one with empty text and
    ``finish_reason`` ``finish`` (``"length"``).

    Args:
        model: echoed in every chunk.
        n_tokens: number of text chunks.
        id: the completion id shared by all chunks (``cmpl-...``).
        created: Unix time in seconds shared by all chunks.
        finish: the last chunk's ``finish_reason`` (:func:`finish_reason_of`).

    Yields:
        Fresh chunk dicts, ``n_tokens + 1`` of them.
    """
    for _ in range(n_tokens):
        yield _completion(model, TOKEN_TEXT, id=id, created=created, finish_reason=None)
    yield _completion(model, "", id=id, created=created, finish_reason=finish)


def completion_response(
    model: str, n_tokens: int, *, id: str, created: int, prompt_tokens: int = 0, finish: str = _FINISH_REASON
) -> dict[str, Any]:
    """A non-streamed ``text_completion`` object with ``usage``.

    Args:
        model: echoed in the response.
        n_tokens: number of tokens in the text.
        id: the completion id (``cmpl-...``).
        created: Unix time in seconds.
        prompt_tokens: the usage's ``prompt_tokens`` (:func:`prompt_token_count`).
        finish: the ``finish_reason`` (:func:`finish_reason_of`).

    Returns:
        A fresh dict.
    """
    response = _completion(model, TOKEN_TEXT * n_tokens, id=id, created=created, finish_reason=finish)
    response["usage"] = _usage(n_tokens, prompt_tokens)
    return response


def _ollama_message(model: str, content: str, *, created_at: str) -> dict[str, Any]:
    return {
        "model": model,
        "created_at": created_at,
        "message": {"role": "assistant", "content": content},
        "done": False,
    }


def _ollama_done(message: dict[str, Any], n_tokens: int, prompt_tokens: int, finish: str) -> dict[str, Any]:
    # The mock has no clock: the durations (nanoseconds in Ollama) are reported as 0.
    message.update(
        done=True,
        done_reason=finish,
        total_duration=0,
        load_duration=0,
        prompt_eval_count=prompt_tokens,
        prompt_eval_duration=0,
        eval_count=n_tokens,
        eval_duration=0,
    )
    return message


def ollama_chat_lines(
    model: str, n_tokens: int, *, created_at: str, prompt_tokens: int = 0, finish: str = _FINISH_REASON
) -> Iterator[dict[str, Any]]:
    """The NDJSON objects of one streamed Ollama ``/api/chat`` reply.

    One object per token (``done: false``, message content ``"tok "``), then a last object with
    empty content, ``done: true``, ``done_reason`` ``finish`` (``"length"``) and the eval counters.

    Args:
        model: echoed in every object.
        n_tokens: number of content objects.
        created_at: RFC 3339 timestamp shared by all objects (``2024-01-01T00:00:00.000000Z``).
        prompt_tokens: the last object's ``prompt_eval_count`` (:func:`prompt_token_count`).
        finish: its ``done_reason`` (:func:`finish_reason_of`).

    Yields:
        Fresh dicts, ``n_tokens + 1`` of them.
    """
    for _ in range(n_tokens):
        yield _ollama_message(model, TOKEN_TEXT, created_at=created_at)
    yield _ollama_done(_ollama_message(model, "", created_at=created_at), n_tokens, prompt_tokens, finish)


def ollama_chat_response(
    model: str, n_tokens: int, *, created_at: str, prompt_tokens: int = 0, finish: str = _FINISH_REASON
) -> dict[str, Any]:
    """A non-streamed Ollama ``/api/chat`` reply (``done: true``, the whole message).

    Args:
        model: echoed in the reply.
        n_tokens: number of tokens in the message content.
        created_at: RFC 3339 timestamp.
        prompt_tokens: its ``prompt_eval_count`` (:func:`prompt_token_count`).
        finish: its ``done_reason`` (:func:`finish_reason_of`).

    Returns:
        A fresh dict.
    """
    message = _ollama_message(model, TOKEN_TEXT * n_tokens, created_at=created_at)
    return _ollama_done(message, n_tokens, prompt_tokens, finish)
