"""The ``openai`` adapter: any OpenAI-compatible server (vLLM, llama.cpp, Lemonade, ...).

Runs POST ``{base_url}/chat/completions``, ``{base_url}/completions`` or
``{base_url}/embeddings`` (never a stream; the body goes as sent). A run's
answer (:meth:`OpenAIAdapter.relay`) passes the body bytes on as they arrive,
never parsed. :meth:`OpenAIAdapter.run` (the adapter interface's chunk view)
parses a streamed answer's Server-Sent Events, each ``data:`` event yielded as
one chunk object until ``data: [DONE]``; a non-stream answer is one JSON object. Tunnel
requests go to the server root: ``base_url`` without a
trailing ``/v1``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, final

import attrs
import httpx

from iop_node._errors import UpstreamFailed, UpstreamTooLarge
from iop_node.adapters.interface import check_endpoint
from iop_node.config import ProviderConfig
from iop_node.upstream.http_upstream import (
    BodyStream,
    HttpAdapter,
    HttpUpstream,
    error_message,
    parse_object,
    read_object,
)


def server_root(base_url: str) -> str:
    """Return ``base_url`` without its trailing ``/v1`` (and slash), if it has one."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


@final
@attrs.define(eq=False)
class OpenAIAdapter(HttpAdapter):
    """Adapter for an OpenAI-compatible HTTP server.

    Attributes:
        base_url: the API base, e.g. ``http://127.0.0.1:9100/v1``.
        http: the provider's client and server root.
    """

    base_url: str
    http: HttpUpstream

    @classmethod
    def from_config(
        cls, provider: ProviderConfig, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> OpenAIAdapter:
        """Build the adapter and its pool from a provider's config."""
        assert provider.base_url is not None  # checked by NodeConfig.problems
        base_url = provider.base_url.rstrip("/")
        http = HttpUpstream.for_provider(provider, server_root(base_url), transport=transport)
        return cls(base_url=base_url, http=http)

    async def run(self, endpoint: str, body: dict[str, Any], *, stream: bool) -> AsyncGenerator[dict[str, Any], None]:
        """Yield the chunks (stream) or the one response object (non-stream).

        See :meth:`iop_node.Adapter.run`.
        """
        check_endpoint(endpoint)
        async with self.http.post_json(f"{self.base_url}/{endpoint}", request_body(endpoint, body, stream)) as response:
            if not stream:
                yield await read_object(response, self.http.limits.answer_bytes)
                return
            async with aclosing(iter_sse_objects(response, self.http.limits.answer_bytes)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def relay(
        self, endpoint: str, body: dict[str, Any], *, stream: bool, send: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """Hand the upstream's body bytes to ``send`` as they arrive, unparsed. See :meth:`iop_node.Adapter.relay`."""
        check_endpoint(endpoint)
        url = f"{self.base_url}/{endpoint}"
        await self.http.relay_post(url, request_body(endpoint, body, stream), send, whole=not stream)


def request_body(endpoint: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The body to POST: a completion's with ``stream`` set; an embeddings body as the client sent it."""
    return body if endpoint == "embeddings" else {**body, "stream": stream}


async def iter_sse_objects(response: httpx.Response, max_line: int) -> AsyncGenerator[dict[str, Any], None]:
    """Yield each SSE event's ``data`` as a JSON object, stopping at ``[DONE]``.

    Data lines of one event are joined with newlines (the SSE rule); comments
    and other fields are ignored. An event that is an error object (``{"error":
    ...}`` and no ``choices``) ends the run. Checkpoints while reading. Iterate
    it inside ``aclosing``.

    Raises:
        UpstreamFailed: an event is not a JSON object, or is an error object.
        UpstreamTooLarge: an event (or a line) is larger than ``max_line`` bytes.
    """
    data: list[str] = []
    size = 0
    async with aclosing(BodyStream(response, max_line=max_line)) as body:
        while (line := await body.next_line()) is not None:
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
                size += len(line)
                if size > max_line:
                    raise UpstreamTooLarge("an event of the upstream's stream is larger than limits.answer_bytes")
            elif not line and data:  # a blank line ends the event
                payload = "\n".join(data)
                data.clear()
                size = 0
                if payload.strip() == "[DONE]":
                    return
                yield _chunk_of(payload)
    if data and "\n".join(data).strip() != "[DONE]":
        yield _chunk_of("\n".join(data))


def _chunk_of(payload: str) -> dict[str, Any]:
    chunk = parse_object(payload)
    if "choices" not in chunk:
        message = error_message(chunk)
        if message is not None:
            raise UpstreamFailed(message)
    return chunk
