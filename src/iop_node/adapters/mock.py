"""The ``mock`` adapter: an in-process fake backend, no HTTP.

It emits ``max_tokens`` (default 16) tokens built by
:mod:`iop_mock.completion`, after ``latency_ms`` and at
``tokens_per_second`` (0: no delay). ``fail_after_chunks`` is a fault knob for
simulations: after that many chunks the run fails with ``upstream_error``.
An ``embeddings`` run answers deterministic vectors (:mod:`iop_mock.embedding`)
after ``latency_ms``.
Tunnel requests are answered in-process too: ``POST /v1/chat/completions``,
``POST /v1/completions`` (SSE or JSON) and ``GET /v1/models``; anything else is
a 404. A body the mock cannot serve (``max_tokens`` out of range) fails like the
mock backend answers it: ``upstream_error`` with status 400 and an OpenAI error body.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar, final

import attrs
import trio

from iop_mock import completion as mock_completion
from iop_mock import embedding as mock_embedding
from iop_node._errors import UpstreamFailed
from iop_node.adapters.interface import TunnelHead, check_endpoint, relay_encoded
from iop_node.config import ProviderConfig

_ids = itertools.count(1)
_T = TypeVar("_T")
_JSON = (("content-type", "application/json"),)
_SSE = (("content-type", "text/event-stream"), ("cache-control", "no-cache"))


@final
@attrs.frozen
class MockAdapter:
    """In-process fake backend.

    Attributes:
        latency: seconds before the first chunk.
        tokens_per_second: streaming rate; 0 means no delay between chunks.
        fail_after_chunks: fail with ``upstream_error`` after this many chunks.
    """

    latency: float = 0.0
    tokens_per_second: float = 0.0
    fail_after_chunks: int | None = None

    @classmethod
    def from_config(cls, provider: ProviderConfig) -> MockAdapter:
        """Build the adapter from a provider's ``latency_ms``, ``tokens_per_second`` and ``fail_after_chunks``."""
        return cls(
            latency=provider.latency_ms / 1000,
            tokens_per_second=provider.tokens_per_second,
            fail_after_chunks=provider.fail_after_chunks,
        )

    async def relay(
        self, endpoint: str, body: dict[str, Any], *, stream: bool, send: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """:meth:`run`'s objects as the client's bytes. See :meth:`iop_node.Adapter.relay`."""
        await relay_encoded(self.run(endpoint, body, stream=stream), stream=stream, send=send)

    async def run(self, endpoint: str, body: dict[str, Any], *, stream: bool) -> AsyncGenerator[dict[str, Any], None]:
        """Yield fake chunks (stream) or one fake response (non-stream).

        Sleeps ``latency`` first; a non-stream run then sleeps the whole
        generation time. See :meth:`iop_node.Adapter.run`.
        """
        check_endpoint(endpoint)
        model = str(body.get("model") or "mock")
        if endpoint == "embeddings":
            yield await self._embed(model, body)
            return
        n_tokens = _or_400(mock_completion.token_count, body)
        chat = endpoint == "chat/completions"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-mock-{next(_ids)}"
        created = int(time.time())
        await trio.sleep(self.latency)
        if not stream:
            if self.fail_after_chunks is not None:
                raise UpstreamFailed("mock fault: fail_after_chunks is set", status=500)
            if self.tokens_per_second:
                await trio.sleep(n_tokens / self.tokens_per_second)
            build = mock_completion.chat_response if chat else mock_completion.completion_response
            yield build(model, n_tokens, id=ident, created=created)
            return
        build_chunks = mock_completion.chat_chunks if chat else mock_completion.completion_chunks
        for index, chunk in enumerate(build_chunks(model, n_tokens, id=ident, created=created)):
            if index == self.fail_after_chunks:
                raise UpstreamFailed(f"mock fault after {index} chunks", status=500)
            if index and self.tokens_per_second:
                await trio.sleep(1 / self.tokens_per_second)
            yield chunk

    async def _embed(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """Deterministic vectors (``iop_mock.embedding``) after ``latency``. Checkpoints."""
        response = _or_400(mock_embedding.embedding_response, model, body)
        await trio.sleep(self.latency)
        if self.fail_after_chunks is not None:
            raise UpstreamFailed("mock fault: fail_after_chunks is set", status=500)
        return response

    async def tunnel(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> AsyncGenerator[TunnelHead | bytes, None]:
        """Answer a raw OpenAI-style request in-process. See :meth:`iop_node.Adapter.tunnel`."""
        route = (method.upper(), path.partition("?")[0])
        if route == ("GET", "/v1/models"):
            models = {"object": "list", "data": [{"id": "mock", "object": "model", "created": 0, "owned_by": "iop"}]}
            yield TunnelHead(200, _JSON)
            yield json.dumps(models).encode()
            return
        endpoint = {("POST", "/v1/chat/completions"): "chat/completions", ("POST", "/v1/completions"): "completions"}
        if route not in endpoint:
            yield TunnelHead(404, _JSON)
            yield _error_body(f"no route {route[0]} {route[1]}")
            return
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            yield TunnelHead(400, _JSON)
            yield _error_body(f"bad JSON body: {exc}")
            return
        stream = bool(request.get("stream"))
        yield TunnelHead(200, _SSE if stream else _JSON)
        async with aclosing(self.run(endpoint[route], request, stream=stream)) as events:
            async for data in events:
                yield b"data: %s\n\n" % json.dumps(data).encode() if stream else json.dumps(data).encode()
        if stream:
            yield b"data: [DONE]\n\n"

    async def aclose(self) -> None:
        """Nothing to release. Checkpoints."""
        await trio.lowlevel.checkpoint()


def _or_400(build: Callable[..., _T], *args: Any) -> _T:
    """``build(*args)``; its ``ValueError`` fails the run as the mock backend answers it: a 400."""
    try:
        return build(*args)
    except ValueError as exc:
        raise UpstreamFailed(str(exc), status=400, body=_error_body(str(exc), "invalid_value").decode()) from None


def _error_body(message: str, code: str | None = None) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()
