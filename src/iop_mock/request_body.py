"""What the mock backend reads of a request: the body, parsed into a generation or embedding request."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from iop_mock.framing import Receive

from . import completion as mock_completion
from . import embedding as mock_embedding


@attrs.frozen
class Generation:
    """One parsed generation request: what to produce and how to frame it.

    ``n_tokens`` are generated, then the end of sequence; ``max_tokens`` is the request's token
    limit (``n_tokens`` is below it when the ``mock_output_tokens`` hint ends the answer sooner).
    """

    model: str
    n_tokens: int
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_tokens: int

    @property
    def finish(self) -> str:
        """Its ``finish_reason``: ``"stop"`` before the limit, ``"length"`` at it."""
        return mock_completion.finish_reason_of(self.n_tokens, self.max_tokens)


class BadRequest(Exception):
    """The request body cannot be served; ``str(error)`` is the client-facing message."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def as_models(models: Iterable[str]) -> tuple[str, ...]:
    return tuple(models)


def request_of(body: bytes, default_model: str) -> tuple[dict[str, Any], str]:
    """The request object and its model (``default_model`` when unnamed)."""
    try:
        request = json.loads(body)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise BadRequest(f"request body is not valid JSON: {error}", "invalid_json") from None
    if not isinstance(request, dict):
        raise BadRequest("request body must be a JSON object", "invalid_json")
    model = request.get("model", default_model)
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", "invalid_value")
    return request, model


def parse_generation(body: bytes, *, default_model: str, ollama: bool, chars_per_token: float = 4.0) -> Generation:
    request, model = request_of(body, default_model)
    try:
        max_tokens = mock_completion.token_count(request)
        n_tokens = mock_completion.output_token_count(request, max_tokens)
    except ValueError as error:
        raise BadRequest(str(error), "invalid_value") from None
    stream_options = request.get("stream_options")
    include_usage = isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))
    # Ollama streams unless told "stream": false; OpenAI streams only when told "stream": true.
    stream = request.get("stream") is not False if ollama else bool(request.get("stream"))
    prompt_tokens = mock_completion.prompt_token_count(request, chars_per_token)
    return Generation(model, n_tokens, stream, include_usage, prompt_tokens, max_tokens)


def parse_embedding(body: bytes, *, default_model: str, ollama: bool) -> dict[str, Any]:
    """The whole embeddings answer to ``body`` (OpenAI's shape, or Ollama's ``/api/embed``)."""
    request, model = request_of(body, default_model)
    build = mock_embedding.ollama_embed_response if ollama else mock_embedding.embedding_response
    try:
        return build(model, request)
    except ValueError as error:
        raise BadRequest(str(error), "invalid_value") from None


async def read_body(receive: Receive) -> bytes | None:
    """Read the whole request body; ``None`` if the client disconnected first.

    Checkpoints. Cancellation propagates.
    """
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Wait for ``http.disconnect`` and then cancel ``scope`` (the response in progress).

    Checkpoints. Cancelled once the response is complete.
    """
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
