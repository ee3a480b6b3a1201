"""``iop-mock-backend``: an OpenAI- and Ollama-compatible fake LLM server that counts concurrency.

Usage::

    iop-mock-backend --port 9100 --latency-ms 200 --tokens-per-second 50 [--host 127.0.0.1]

It serves ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (stream as
SSE and non-stream) and Ollama's ``POST /api/chat`` (NDJSON stream, the default, or one object),
and embeddings: ``POST /v1/embeddings`` (OpenAI's shape) and Ollama's ``POST /api/embed``, with
deterministic vectors (:mod:`iop_mock.embedding`) after ``latency`` seconds; they count in the
stats like generations. Every generation request waits ``latency`` seconds (time to first token), then produces
``max_tokens`` tokens at ``tokens_per_second`` (0: all at once). ``GET /stats`` reports
``{"in_flight", "peak_in_flight", "total", "aborted"}``; ``POST /stats/reset`` starts a new measurement.
``POST /fault`` with ``{"status": 500}`` makes every generation request answer that status
with an OpenAI error body (a failing backend, for failover tests); ``{"status": null}`` heals
it; ``--fail-status`` starts it failing. It also hangs requests (no answer, a head and nothing,
a stream stopping) and makes ``/health`` say "loading"; the backends' own health endpoints
(llama.cpp's ``/health`` and ``/slots``, vLLM's ``/metrics``, Ollama's ``/api/ps``) are served
for the Node's probes (:mod:`iop_mock.faults`).
The capacity smoke reads the backend's peak concurrency from ``/stats``.

Design notes:

- A raw ASGI app (no framework) on a small server of its own (:mod:`iop_mock._server`, HTTP framed by
  :mod:`iop_http` on :mod:`iop_io`'s accept loop and transport):
  the mock stands in for a GPU server, whose tokens cost the host nothing, so its own CPU
  per request and per token must stay small next to the Edge's and the Node's. There is no per-request logging, each response
  object is encoded to JSON once, identical consecutive stream chunks reuse the same bytes,
  a response head goes out with the first body bytes in one ``send()``, and an unthrottled
  stream (``tokens_per_second == 0``) goes out as one body message.
- In-flight accounting: a generation request counts from the moment its body has been read and
  parsed until its response is complete or the client is gone. "Gone" is noticed three ways:
  the server delivers ``http.disconnect`` (a watcher task cancels the response), ``send`` raises,
  or the task is cancelled (server shutdown). The count is released in one ``finally``, so no
  path can leak it.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import time
import typing
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import attrs
import trio

from iop_io import answer_lifespan
from iop_mock.framing import (
    NDJSON_HEADERS,
    SSE_DONE,
    SSE_HEADERS,
    Receive,
    Scope,
    Send,
    encode_json,
    error_body,
    frames,
    ndjson_frame,
    send_json,
    sse_frame,
)
from iop_mock.request_body import (
    BadRequest,
    Generation,
    as_models,
    cancel_on_disconnect,
    parse_embedding,
    parse_generation,
    read_body,
)

from . import completion as mock_completion
from . import faults as mock_faults
from ._pacing import Pacer
from .kv_driver import KvDriver

__all__ = ["MockBackend"]


_Request = typing.TypeVar("_Request")


@typing.final
@attrs.define(eq=False, kw_only=True)
class MockBackend:
    """The fake backend: its settings, its concurrency counters and its ASGI app.

    ``latency`` and ``tokens_per_second`` may be changed at any time; requests that start
    afterwards use the new values.

    Attributes:
        latency: seconds before the first token.
        tokens_per_second: generation speed; 0 produces all tokens at once.
        prompt_chars_per_token: characters of the prompt per ``prompt_tokens`` in the usage
            reported (4: the Edge's estimate; see :func:`iop_mock.completion.prompt_token_count`).
        models: the ids listed by ``GET /v1/models``. Requests may name any model; it is echoed.
        fail_status: when set, every generation request is answered with this HTTP status and an
            OpenAI error body (code ``mock_fault``) instead of a completion.
        track_repeats: count the requests whose body is byte for byte one served before since
            the last reset (``repeated`` in ``/stats``): a test whose every request is unique
            checks that nothing ran twice. Off by default: it keeps a digest per distinct body.
        slots: the parallelism ``/slots`` (llama.cpp's) reports.
        faults: the hangs and the "loading" ``POST /fault`` set (:class:`iop_mock.faults.Faults`).
        kv: the KV budget its generations run in (:mod:`iop_mock.kv_driver`); None (the default):
            generations are only timed, and hold no cache.
    """

    latency: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    tokens_per_second: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    prompt_chars_per_token: float = attrs.field(default=4.0, validator=attrs.validators.gt(0.0))
    models: tuple[str, ...] = attrs.field(default=("mock",), converter=as_models, validator=attrs.validators.min_len(1))
    fail_status: int | None = None
    track_repeats: bool = False
    slots: int = 4
    faults: mock_faults.Faults = attrs.field(factory=mock_faults.Faults)
    kv: KvDriver | None = None
    _seen: set[bytes] = attrs.field(factory=set, init=False)
    _repeated: int = attrs.field(default=0, init=False)
    _in_flight: int = attrs.field(default=0, init=False)
    _peak_in_flight: int = attrs.field(default=0, init=False)
    _total: int = attrs.field(default=0, init=False)
    aborts: list[float] = attrs.field(factory=list, init=False)  # when (trio's clock) each left request let go
    _ids: Iterator[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _models_body: bytes | None = attrs.field(default=None, init=False)  # GET /v1/models, encoded once
    _pacer: Pacer = attrs.field(factory=Pacer, init=False)

    def __repr__(self) -> str:
        return (
            f"<MockBackend latency={self.latency}s tokens_per_second={self.tokens_per_second}"
            f" in_flight={self._in_flight} peak={self._peak_in_flight} total={self._total}>"
        )

    def stats(self) -> dict[str, int]:
        """The counters, as ``GET /stats`` serves them.

        Returns:
            ``{"in_flight", "peak_in_flight", "total", "aborted"}``; ``total`` counts the generation requests
            started since the last :meth:`reset`, ``aborted`` those left by their client. With ``track_repeats``,
            also ``"repeated"``: those of them whose body was served before since the reset. With a KV
            budget, also the pool's ``"kv_used"``, ``"kv_peak"``, ``"kv_total"``, ``"preemptions"`` and
            ``"context_errors"``.
        """
        stats = {
            "in_flight": self._in_flight,
            "peak_in_flight": self._peak_in_flight,
            "total": self._total,
            "aborted": len(self.aborts),
        }
        if self.track_repeats:
            stats["repeated"] = self._repeated
        if self.kv is not None:
            engine = self.kv.engine
            stats |= {"kv_used": engine.used, "kv_peak": engine.peak, "kv_total": engine.total}
            stats |= {"preemptions": engine.preemptions, "context_errors": engine.context_errors}
        return stats

    def reset(self) -> None:
        """Start a new measurement: ``total``, ``aborted``, ``peak_in_flight`` (and ``kv_peak``) restart, ``in_flight`` stays.

        ``peak_in_flight`` restarts at the current ``in_flight`` rather than at 0, so that it stays a true
        maximum of ``in_flight`` since the reset; the two are the same (0) when the backend is idle.
        """
        self._total = 0
        self.aborts.clear()
        self._peak_in_flight = self._in_flight
        self._seen.clear()
        self._repeated = 0
        if self.kv is not None:  # as peak_in_flight: the most held since the reset
            self.kv.engine.peak = self.kv.engine.used

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI 3 application (``http`` and ``lifespan`` scopes).

        Checkpoints. Cancellation ends the response where it is; the request's in-flight count
        is released on every path.
        """
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        # The entry only routes: every handler below holds the settings and the counters.
        path, method = scope["path"], scope["method"]
        route = _ROUTES.get(path)
        if route is None:
            await send_json(send, 404, error_body(f"no route for {method} {path}", "not_found"))
            return
        route_method, handler = route
        if method != route_method:
            await send_json(
                send,
                405,
                error_body(f"{path} accepts {route_method}, not {method}", "method_not_allowed"),
            )
            return
        await handler(self, receive, send)

    async def _models(self, receive: Receive, send: Send) -> None:
        if self._models_body is None:
            created = int(time.time())
            listing = [
                {"id": model, "object": "model", "created": created, "owned_by": "iop-mock"} for model in self.models
            ]
            self._models_body = encode_json({"object": "list", "data": listing}).encode()
        await send_json(send, 200, self._models_body)

    async def _stats(self, receive: Receive, send: Send) -> None:
        await send_json(send, 200, encode_json(self.stats()).encode())

    async def _reset(self, receive: Receive, send: Send) -> None:
        self.reset()
        await send_json(send, 200, encode_json(self.stats()).encode())

    async def _serve_generation(
        self,
        receive: Receive,
        send: Send,
        *,
        ollama: bool,
        respond: Callable[[Send, Generation], Awaitable[None]],
    ) -> None:
        def parse(body: bytes) -> Generation:
            generation = parse_generation(
                body, default_model=self.models[0], ollama=ollama, chars_per_token=self.prompt_chars_per_token
            )
            if self.kv is not None:
                self.kv.check(generation.prompt_tokens, generation.max_tokens)
            return generation

        await self._serve(receive, send, parse, respond)

    async def _serve(
        self,
        receive: Receive,
        send: Send,
        parse: Callable[[bytes], _Request],
        respond: Callable[[Send, _Request], Awaitable[None]],
    ) -> None:
        """Read and ``parse`` the body (a 400 if it cannot be served), then ``respond`` while counted in flight."""
        body = await read_body(receive)
        if body is None:  # the client left before its request was complete
            return
        try:
            request = parse(body)
        except BadRequest as error:
            await send_json(send, 400, error_body(str(error), error.code))
            return
        if self.fail_status is not None:
            kind = "server_error" if self.fail_status >= 500 else "invalid_request_error"
            await send_json(send, self.fail_status, error_body("injected failure (POST /fault)", "mock_fault", kind))
            return
        faults = self.faults
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_disconnect, receive, nursery.cancel_scope)
            # No checkpoint between the increment and the ``try``: the ``finally`` below is the
            # one release, on completion, send failure, disconnect and cancellation alike. It
            # runs as soon as the last byte is handed to the socket, before the watcher exits.
            self._in_flight += 1
            self._total += 1
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
            if self.track_repeats:
                self._note(body)
            try:
                await faults.hold(send, SSE_HEADERS)
                await respond(send, request)
            except BaseException as exc:  # the client is gone: send raised OSError, or its watcher cancelled us
                self.aborts.append(trio.current_time())
                if not isinstance(exc, OSError):  # ASGI: send raises OSError; nothing to tell
                    raise
            finally:
                self._in_flight -= 1
                nursery.cancel_scope.cancel()

    def _note(self, body: bytes) -> None:
        """Count ``body`` as repeated if one like it was served since the last reset."""
        digest = hashlib.blake2b(body, digest_size=16).digest()
        if digest in self._seen:
            self._repeated += 1
        else:
            self._seen.add(digest)

    async def _chat(self, receive: Receive, send: Send) -> None:
        await self._serve_generation(receive, send, ollama=False, respond=self._respond_chat)

    async def _completions(self, receive: Receive, send: Send) -> None:
        await self._serve_generation(receive, send, ollama=False, respond=self._respond_completion)

    async def _ollama_chat(self, receive: Receive, send: Send) -> None:
        await self._serve_generation(receive, send, ollama=True, respond=self._respond_ollama_chat)

    async def _embeddings(self, receive: Receive, send: Send) -> None:
        parse = functools.partial(parse_embedding, default_model=self.models[0], ollama=False)
        await self._serve(receive, send, parse, self._respond_embedding)

    async def _ollama_embed(self, receive: Receive, send: Send) -> None:
        parse = functools.partial(parse_embedding, default_model=self.models[0], ollama=True)
        await self._serve(receive, send, parse, self._respond_embedding)

    async def _respond_embedding(self, send: Send, response: dict[str, Any]) -> None:
        """Wait ``latency``, then send the vectors (computed while parsing)."""
        if self.latency:
            await trio.sleep(self.latency)
        await send_json(send, 200, encode_json(response).encode())

    def _openai_identity(self, prefix: str) -> dict[str, Any]:
        return {"id": f"{prefix}-mock{next(self._ids)}", "created": int(time.time())}

    async def _respond_chat(self, send: Send, generation: Generation) -> None:
        model, n_tokens, prompt = generation.model, generation.n_tokens, generation.prompt_tokens
        identity = self._openai_identity("chatcmpl") | {"finish": generation.finish}
        if generation.stream:
            usage = generation.include_usage
            chunks = mock_completion.chat_chunks(model, n_tokens, include_usage=usage, prompt_tokens=prompt, **identity)
            await self._stream(send, SSE_HEADERS, frames(chunks, sse_frame), generation, head=1)
        else:
            response = mock_completion.chat_response(model, n_tokens, prompt_tokens=prompt, **identity)
            await self._respond_whole(send, generation, response)

    async def _respond_completion(self, send: Send, generation: Generation) -> None:
        model, n_tokens = generation.model, generation.n_tokens
        identity = self._openai_identity("cmpl") | {"finish": generation.finish}
        if generation.stream:
            chunks = mock_completion.completion_chunks(model, n_tokens, **identity)
            await self._stream(send, SSE_HEADERS, frames(chunks, sse_frame), generation)
        else:
            response = mock_completion.completion_response(
                model, n_tokens, prompt_tokens=generation.prompt_tokens, **identity
            )
            await self._respond_whole(send, generation, response)

    async def _respond_ollama_chat(self, send: Send, generation: Generation) -> None:
        model, n_tokens, prompt = generation.model, generation.n_tokens, generation.prompt_tokens
        if generation.stream:
            lines = mock_completion.ollama_chat_lines(
                model, n_tokens, created_at=_created_at(), prompt_tokens=prompt, finish=generation.finish
            )
            frames_out = frames(lines, ndjson_frame)
            await self._stream(send, NDJSON_HEADERS, frames_out, generation, trailer=b"")
        else:
            response = mock_completion.ollama_chat_response(
                model, n_tokens, created_at=_created_at(), prompt_tokens=prompt, finish=generation.finish
            )
            await self._respond_whole(send, generation, response)

    async def _respond_whole(self, send: Send, generation: Generation, response: dict[str, Any]) -> None:
        """Wait the whole generation (latency + ``n_tokens / tokens_per_second``, or the KV engine's run), then reply."""
        tps = self.tokens_per_second
        delay = self.latency + (generation.n_tokens / tps if tps and self.kv is None else 0.0)
        if delay:
            await trio.sleep(delay)
        if self.kv is None or await self.kv.run_whole(send, generation):
            await send_json(send, 200, encode_json(response).encode())

    async def _stream(
        self,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        frames: Iterator[bytes],
        generation: Generation,
        *,
        head: int = 0,
        trailer: bytes = SSE_DONE,
    ) -> None:
        """Send a streamed response: after the latency, paced like a real generation
        (:meth:`Pacer.stream`), or run by the KV engine (:meth:`KvDriver.stream`) with a budget."""
        if self.latency:
            await trio.sleep(self.latency)
        hang_after = self.faults.tokens_before_hang()
        if self.kv is not None:
            await self.kv.stream(send, headers, frames, generation, head=head, trailer=trailer, hang_after=hang_after)
            return
        await self._pacer.stream(
            send,
            headers,
            frames,
            generation.n_tokens,
            head=head,
            trailer=trailer,
            tokens_per_second=self.tokens_per_second,
            hang_after=hang_after,
        )


def _created_at() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_Handler = Callable[[MockBackend, Receive, Send], Awaitable[None]]
_ROUTES: dict[str, tuple[str, _Handler]] = {
    "/v1/models": ("GET", MockBackend._models),
    "/v1/chat/completions": ("POST", MockBackend._chat),
    "/v1/completions": ("POST", MockBackend._completions),
    "/api/chat": ("POST", MockBackend._ollama_chat),
    "/v1/embeddings": ("POST", MockBackend._embeddings),
    "/api/embed": ("POST", MockBackend._ollama_embed),
    "/stats": ("GET", MockBackend._stats),
    "/stats/reset": ("POST", MockBackend._reset),
    "/fault": ("POST", mock_faults.fault),
    "/health": ("GET", mock_faults.health),
    "/slots": ("GET", mock_faults.slots),
    "/metrics": ("GET", mock_faults.metrics),
    "/api/ps": ("GET", mock_faults.ollama_ps),
}
