"""The ``ollama`` adapter: Ollama's native ``/api/chat``, answered in OpenAI shapes.

A normalized ``chat/completions`` run becomes POST ``{base_url}/api/chat``; the
OpenAI sampling fields are moved into Ollama ``options``. The NDJSON stream is
mapped line by line to ``chat.completion.chunk`` objects (the first carries the
assistant role, the last the finish reason and usage); a non-stream answer
becomes one ``chat.completion`` object. An ``embeddings`` run becomes POST
``{base_url}/api/embed`` and its answer an OpenAI embeddings list (``float`` or
``base64`` as the request's ``encoding_format`` asks). Legacy ``completions``
runs are refused with ``bad_request``: use the tunnel for ``/api/generate``.
Tunnel requests go to ``base_url`` itself, the server root.
"""

from __future__ import annotations

import base64
import itertools
import json
import struct
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, final

import attrs
import httpx

from iop_node._errors import BadRunRequest, UpstreamFailed
from iop_node.adapters.interface import check_endpoint, relay_encoded
from iop_node.config import ProviderConfig
from iop_node.upstream.http_upstream import (
    BodyStream,
    HttpAdapter,
    HttpUpstream,
    error_message,
    parse_object,
    read_object,
)

# OpenAI body field -> Ollama options field.
_OPTION_FIELDS = {
    "max_tokens": "num_predict",
    "max_completion_tokens": "num_predict",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_ids = itertools.count(1)


@final
@attrs.define(eq=False)
class OllamaAdapter(HttpAdapter):
    """Adapter for an Ollama server.

    Attributes:
        http: the provider's client; its root is the Ollama server root.
    """

    http: HttpUpstream

    @classmethod
    def from_config(
        cls, provider: ProviderConfig, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> OllamaAdapter:
        """Build the adapter and its pool from a provider's config."""
        assert provider.base_url is not None  # checked by NodeConfig.problems
        return cls(http=HttpUpstream.for_provider(provider, provider.base_url, transport=transport))

    async def relay(
        self, endpoint: str, body: dict[str, Any], *, stream: bool, send: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """:meth:`run`'s objects as the client's bytes. See :meth:`iop_node.Adapter.relay`."""
        await relay_encoded(self.run(endpoint, body, stream=stream), stream=stream, send=send)

    async def run(self, endpoint: str, body: dict[str, Any], *, stream: bool) -> AsyncGenerator[dict[str, Any], None]:
        """Yield OpenAI chunks (stream) or one ``chat.completion`` (non-stream).

        See :meth:`iop_node.Adapter.run`.
        """
        check_endpoint(endpoint)
        if endpoint == "embeddings":
            yield await self._embed(body)
            return
        if endpoint != "chat/completions":
            raise BadRunRequest("the ollama adapter serves chat/completions only; tunnel /api/generate instead")
        request = ollama_chat_request(body, stream=stream)
        completion_id = f"chatcmpl-ollama-{next(_ids)}"
        created = int(time.time())
        async with self.http.post_json(f"{self.http.root}/api/chat", request) as response:
            if not stream:
                reply = await read_object(response, self.http.limits.answer_bytes)
                yield chat_completion_of(_checked(reply), completion_id, created)
                return
            first = True
            async with aclosing(BodyStream(response, max_line=self.http.limits.answer_bytes)) as lines:
                while (line := await lines.next_line()) is not None:
                    if line.strip():
                        yield chat_chunk_of(_checked(parse_object(line)), completion_id, created, first=first)
                        first = False

    async def _embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``/api/embed``; return the answer in OpenAI's shape. Checkpoints."""
        request = ollama_embed_request(body)
        async with self.http.post_json(f"{self.http.root}/api/embed", request) as response:
            reply = _checked(await read_object(response, self.http.limits.answer_bytes))
        return embeddings_of(reply, body)


def ollama_embed_request(body: dict[str, Any]) -> dict[str, Any]:
    """Map an OpenAI embeddings body to an Ollama ``/api/embed`` body.

    Raises:
        UpstreamFailed: ``input`` is token ids, which Ollama does not take; as a 400
            with an OpenAI error body, since it is the request that cannot be served.
    """
    value = body.get("input")
    if not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        message = "this provider (Ollama) embeds text only: 'input' must be a string or a list of strings"
        error = {"message": message, "type": "invalid_request_error", "param": "input", "code": "unsupported_input"}
        raise UpstreamFailed(message, status=400, body=json.dumps({"error": error}))
    request: dict[str, Any] = {"model": body.get("model"), "input": value}
    if body.get("dimensions") is not None:
        request["dimensions"] = body["dimensions"]
    return request


def embeddings_of(reply: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """Map an Ollama ``/api/embed`` reply to an OpenAI embeddings list.

    Raises:
        UpstreamFailed: the reply has no ``embeddings`` list of number lists.
    """
    vectors = reply.get("embeddings")
    if not isinstance(vectors, list) or not all(isinstance(v, list) for v in vectors):
        raise UpstreamFailed("ollama answered /api/embed without an 'embeddings' list")
    as_base64 = body.get("encoding_format") == "base64"
    tokens = int(reply.get("prompt_eval_count") or 0)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _base64_float32(v) if as_base64 else v}
            for i, v in enumerate(vectors)
        ],
        "model": reply.get("model", body.get("model", "")),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _base64_float32(values: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32 values, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def ollama_chat_request(body: dict[str, Any], *, stream: bool) -> dict[str, Any]:
    """Map an OpenAI chat request body to an Ollama ``/api/chat`` body.

    Raises:
        BadRunRequest: ``messages`` is missing or not a list.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRunRequest("chat run body needs a 'messages' list")
    request: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": stream}
    options = {target: body[source] for source, target in _OPTION_FIELDS.items() if body.get(source) is not None}
    if options:
        request["options"] = options
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        request["format"] = "json"
    if body.get("tools") is not None:
        request["tools"] = body["tools"]
    return request


def chat_chunk_of(line: dict[str, Any], completion_id: str, created: int, *, first: bool) -> dict[str, Any]:
    """Map one Ollama ``/api/chat`` stream line to a ``chat.completion.chunk``."""
    message = line.get("message") or {}
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    content = message.get("content")
    if content:
        delta["content"] = content
    done = bool(line.get("done"))
    chunk: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": line.get("model", ""),
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": _finish_reason(line) if done else None,
            }
        ],
    }
    if done:
        chunk["usage"] = _usage(line)
    return chunk


def chat_completion_of(reply: dict[str, Any], completion_id: str, created: int) -> dict[str, Any]:
    """Map a non-stream Ollama ``/api/chat`` reply to a ``chat.completion``."""
    message = reply.get("message") or {}
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": reply.get("model", ""),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": message.get("content", "")},
                "logprobs": None,
                "finish_reason": _finish_reason(reply),
            }
        ],
        "usage": _usage(reply),
    }


def _checked(line: dict[str, Any]) -> dict[str, Any]:
    message = error_message(line)
    if message is not None:
        raise UpstreamFailed(message)
    return line


def _finish_reason(line: dict[str, Any]) -> str:
    return "length" if line.get("done_reason") == "length" else "stop"


def _usage(line: dict[str, Any]) -> dict[str, int]:
    prompt = int(line.get("prompt_eval_count") or 0)
    completion = int(line.get("eval_count") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
