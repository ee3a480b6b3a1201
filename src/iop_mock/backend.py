"""``iop-mock-backend``: an OpenAI- and Ollama-compatible fake LLM server that counts concurrency.

Usage::

    iop-mock-backend --port 9100 --latency-ms 200 --tokens-per-second 50 [--host 127.0.0.1]

It serves ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (stream as
SSE and non-stream) and Ollama's ``POST /api/chat`` (NDJSON stream, the default, or one object),
and embeddings: ``POST /v1/embeddings`` (OpenAI's shape) and Ollama's ``POST /api/embed``, with
deterministic vectors (:mod:`iop_mock.embedding`) after ``latency`` seconds; they count in the
stats like generations. Every generation request waits ``latency`` seconds (time to first token), then produces
``max_tokens`` tokens at ``tokens_per_second`` (0: all at once). ``GET /stats`` reports
``{"in_flight", "peak_in_flight", "total"}``; ``POST /stats/reset`` starts a new measurement.
``POST /fault`` with ``{"status": 500}`` makes every generation request answer that status
with an OpenAI error body (a failing backend, for failover tests); ``{"status": null}`` heals
it; ``--fail-status`` starts it failing.
The capacity smoke reads the backend's peak concurrency from ``/stats``.

Design notes:

- A raw ASGI app (no framework) on a small server of its own (:mod:`iop_mock._server`, HTTP framed by
  :mod:`iop_http` on :mod:`iop_io`'s accept loop and transport):
  the mock stands in for a GPU server, whose tokens cost the host nothing, so its own CPU
  per request and per token must stay small next to the Edge's and the Node's (with hypercorn
  it was ~0.15-0.18 ms per streamed token). There is no per-request logging, each response
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

import argparse
import datetime
import functools
import hashlib
import itertools
import json
import logging
import signal
import sys
import time
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import trio

from . import completion as mock_completion
from . import embedding as mock_embedding
from ._pacing import Pacer
from ._server import serve_asgi

__all__ = ["MockBackend", "main", "serve_mock_backend"]

# ASGI servers pass TypedDicts; a raw ASGI app reads them as mappings and sends plain dicts.
Scope = Mapping[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Any], Awaitable[None]]

_encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson")]
_SSE_DONE = b"data: [DONE]\n\n"


def _sse_frame(chunk: dict[str, Any]) -> bytes:
    return b"data: " + _encode(chunk).encode() + b"\n\n"


def _ndjson_frame(line: dict[str, Any]) -> bytes:
    return _encode(line).encode() + b"\n"


def _frames(objects: Iterable[dict[str, Any]], frame: Callable[[dict[str, Any]], bytes]) -> Iterator[bytes]:
    """Encode each object once; an object equal to the previous one reuses its bytes."""
    previous: dict[str, Any] | None = None
    encoded = b""
    for obj in objects:
        if obj != previous:
            previous, encoded = obj, frame(obj)
        yield encoded


def _error_body(message: str, code: str, error_type: str = "invalid_request_error") -> bytes:
    return _encode({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode()


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


@attrs.frozen
class _Generation:
    """One parsed generation request: what to produce and how to frame it."""

    model: str
    n_tokens: int
    stream: bool
    include_usage: bool
    prompt_tokens: int


_Request = typing.TypeVar("_Request")


class _BadRequest(Exception):
    """The request body cannot be served; ``str(error)`` is the client-facing message."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _as_models(models: Iterable[str]) -> tuple[str, ...]:
    return tuple(models)


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
    """

    latency: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    tokens_per_second: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    prompt_chars_per_token: float = attrs.field(default=4.0, validator=attrs.validators.gt(0.0))
    models: tuple[str, ...] = attrs.field(
        default=("mock",), converter=_as_models, validator=attrs.validators.min_len(1)
    )
    fail_status: int | None = None
    track_repeats: bool = False
    _seen: set[bytes] = attrs.field(factory=set, init=False)
    _repeated: int = attrs.field(default=0, init=False)
    _in_flight: int = attrs.field(default=0, init=False)
    _peak_in_flight: int = attrs.field(default=0, init=False)
    _total: int = attrs.field(default=0, init=False)
    _ids: Iterator[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _models_body: bytes = attrs.field(init=False)
    _pacer: Pacer = attrs.field(factory=Pacer, init=False)

    def __attrs_post_init__(self) -> None:
        created = int(time.time())
        self._models_body = _encode(
            {
                "object": "list",
                "data": [
                    {"id": model, "object": "model", "created": created, "owned_by": "iop-mock"}
                    for model in self.models
                ],
            }
        ).encode()

    def __repr__(self) -> str:
        return (
            f"<MockBackend latency={self.latency}s tokens_per_second={self.tokens_per_second}"
            f" in_flight={self._in_flight} peak={self._peak_in_flight} total={self._total}>"
        )

    def stats(self) -> dict[str, int]:
        """The counters, as ``GET /stats`` serves them.

        Returns:
            ``{"in_flight": n, "peak_in_flight": n, "total": n}``; ``total`` counts the
            generation requests started since the last :meth:`reset`. With ``track_repeats``,
            also ``"repeated"``: those of them whose body was served before since the reset.
        """
        stats = {
            "in_flight": self._in_flight,
            "peak_in_flight": self._peak_in_flight,
            "total": self._total,
        }
        if self.track_repeats:
            stats["repeated"] = self._repeated
        return stats

    def reset(self) -> None:
        """Start a new measurement: ``total`` and ``peak_in_flight`` restart, ``in_flight`` stays.

        ``peak_in_flight`` restarts at the current ``in_flight`` rather than at 0, so that it stays
        a true maximum of ``in_flight`` since the reset; the two are the same (0) when the backend
        is idle, which is when a measurement normally starts.
        """
        self._total = 0
        self._peak_in_flight = self._in_flight
        self._seen.clear()
        self._repeated = 0

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI 3 application (``http`` and ``lifespan`` scopes).

        Checkpoints. Cancellation ends the response where it is; the request's in-flight count
        is released on every path.
        """
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        route = _ROUTES.get(path)
        if route is None:
            await _send_json(send, 404, _error_body(f"no route for {method} {path}", "not_found"))
            return
        route_method, handler = route
        if method != route_method:
            await _send_json(
                send,
                405,
                _error_body(f"{path} accepts {route_method}, not {method}", "method_not_allowed"),
            )
            return
        await handler(self, receive, send)

    async def _models(self, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, self._models_body)

    async def _stats(self, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, _encode(self.stats()).encode())

    async def _reset(self, receive: Receive, send: Send) -> None:
        self.reset()
        await _send_json(send, 200, _encode(self.stats()).encode())

    async def _fault(self, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        try:
            status = json.loads(body or b"{}").get("status")
            if status is not None and (type(status) is not int or not 400 <= status <= 599):
                raise ValueError("status must be null or an HTTP error status (400-599)")
        except (ValueError, AttributeError) as exc:
            await _send_json(send, 400, _error_body(f"bad fault request: {exc}", "bad_request"))
            return
        self.fail_status = status
        await _send_json(send, 200, _encode({"status": status}).encode())

    async def _serve_generation(
        self,
        receive: Receive,
        send: Send,
        *,
        ollama: bool,
        respond: Callable[[Send, _Generation], Awaitable[None]],
    ) -> None:
        parse = functools.partial(
            _parse_generation, default_model=self.models[0], ollama=ollama, chars_per_token=self.prompt_chars_per_token
        )
        await self._serve(receive, send, parse, respond)

    async def _serve(
        self,
        receive: Receive,
        send: Send,
        parse: Callable[[bytes], _Request],
        respond: Callable[[Send, _Request], Awaitable[None]],
    ) -> None:
        """Read and ``parse`` the body (a 400 if it cannot be served), then ``respond`` while counted in flight."""
        body = await _read_body(receive)
        if body is None:  # the client left before its request was complete
            return
        try:
            request = parse(body)
        except _BadRequest as error:
            await _send_json(send, 400, _error_body(str(error), error.code))
            return
        if self.fail_status is not None:
            kind = "server_error" if self.fail_status >= 500 else "invalid_request_error"
            await _send_json(send, self.fail_status, _error_body("injected failure (POST /fault)", "mock_fault", kind))
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            # No checkpoint between the increment and the ``try``: the ``finally`` below is the
            # one release, on completion, send failure, disconnect and cancellation alike. It
            # runs as soon as the last byte is handed to the socket, before the watcher exits.
            self._in_flight += 1
            self._total += 1
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
            if self.track_repeats:
                self._note(body)
            try:
                await respond(send, request)
            except OSError:
                pass  # ASGI: send raises OSError once the client is gone; nothing to tell
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
        parse = functools.partial(_parse_embedding, default_model=self.models[0], ollama=False)
        await self._serve(receive, send, parse, self._respond_embedding)

    async def _ollama_embed(self, receive: Receive, send: Send) -> None:
        parse = functools.partial(_parse_embedding, default_model=self.models[0], ollama=True)
        await self._serve(receive, send, parse, self._respond_embedding)

    async def _respond_embedding(self, send: Send, response: dict[str, Any]) -> None:
        """Wait ``latency``, then send the vectors (computed while parsing)."""
        if self.latency:
            await trio.sleep(self.latency)
        await _send_json(send, 200, _encode(response).encode())

    def _openai_identity(self, prefix: str) -> dict[str, Any]:
        return {"id": f"{prefix}-mock{next(self._ids)}", "created": int(time.time())}

    async def _respond_chat(self, send: Send, generation: _Generation) -> None:
        model, n_tokens, prompt = generation.model, generation.n_tokens, generation.prompt_tokens
        identity = self._openai_identity("chatcmpl")
        if generation.stream:
            usage = generation.include_usage
            chunks = mock_completion.chat_chunks(model, n_tokens, include_usage=usage, prompt_tokens=prompt, **identity)
            await self._stream(send, _SSE_HEADERS, _frames(chunks, _sse_frame), n_tokens, head=1)
        else:
            response = mock_completion.chat_response(model, n_tokens, prompt_tokens=prompt, **identity)
            await self._respond_whole(send, n_tokens, response)

    async def _respond_completion(self, send: Send, generation: _Generation) -> None:
        model, n_tokens = generation.model, generation.n_tokens
        identity = self._openai_identity("cmpl")
        if generation.stream:
            chunks = mock_completion.completion_chunks(model, n_tokens, **identity)
            await self._stream(send, _SSE_HEADERS, _frames(chunks, _sse_frame), n_tokens)
        else:
            response = mock_completion.completion_response(
                model, n_tokens, prompt_tokens=generation.prompt_tokens, **identity
            )
            await self._respond_whole(send, n_tokens, response)

    async def _respond_ollama_chat(self, send: Send, generation: _Generation) -> None:
        model, n_tokens, prompt = generation.model, generation.n_tokens, generation.prompt_tokens
        if generation.stream:
            lines = mock_completion.ollama_chat_lines(model, n_tokens, created_at=_created_at(), prompt_tokens=prompt)
            frames = _frames(lines, _ndjson_frame)
            await self._stream(send, _NDJSON_HEADERS, frames, n_tokens, trailer=b"")
        else:
            response = mock_completion.ollama_chat_response(
                model, n_tokens, created_at=_created_at(), prompt_tokens=prompt
            )
            await self._respond_whole(send, n_tokens, response)

    async def _respond_whole(self, send: Send, n_tokens: int, response: dict[str, Any]) -> None:
        """Wait the whole generation (latency + ``n_tokens / tokens_per_second``), then reply."""
        tps = self.tokens_per_second
        delay = self.latency + (n_tokens / tps if tps else 0.0)
        if delay:
            await trio.sleep(delay)
        await _send_json(send, 200, _encode(response).encode())

    async def _stream(
        self,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        frames: Iterator[bytes],
        n_tokens: int,
        *,
        head: int = 0,
        trailer: bytes = _SSE_DONE,
    ) -> None:
        """Send a streamed response paced like a real generation.

        After the latency: the headers and the ``head`` frames (the role chunk); then the
        ``n_tokens`` token frames, token ``k`` at ``k / tokens_per_second`` after the head (a
        schedule anchored on the head, so time spent sending does not slow the rate down; a
        stream more than one interval late starts its schedule again from now rather than
        sending a burst; every stream of the backend waits on one :class:`Pacer`, which may
        send a token up to 1 ms early to share a wake-up with another stream's); then the remaining frames (finish chunk, usage chunk) with ``trailer``
        in one message. With ``tokens_per_second == 0`` the whole body is one message.
        """
        if self.latency:
            await trio.sleep(self.latency)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tps = self.tokens_per_second
        if not tps:
            await send({"type": "http.response.body", "body": b"".join(frames) + trailer})
            return
        first = b"".join(itertools.islice(frames, head))
        await send({"type": "http.response.body", "body": first, "more_body": True})
        interval = 1.0 / tps
        due = trio.current_time()
        for frame in itertools.islice(frames, n_tokens):
            due += interval
            await self._pacer.wait_until(due)
            if (late := trio.current_time() - due) > interval:
                due += late
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"".join(frames) + trailer})


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
    "/fault": ("POST", MockBackend._fault),
}


def _request_of(body: bytes, default_model: str) -> tuple[dict[str, Any], str]:
    """The request object and its model (``default_model`` when unnamed)."""
    try:
        request = json.loads(body)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise _BadRequest(f"request body is not valid JSON: {error}", "invalid_json") from None
    if not isinstance(request, dict):
        raise _BadRequest("request body must be a JSON object", "invalid_json")
    model = request.get("model", default_model)
    if not isinstance(model, str):
        raise _BadRequest("'model' must be a string", "invalid_value")
    return request, model


def _parse_generation(body: bytes, *, default_model: str, ollama: bool, chars_per_token: float = 4.0) -> _Generation:
    request, model = _request_of(body, default_model)
    try:
        n_tokens = mock_completion.token_count(request)
    except ValueError as error:
        raise _BadRequest(str(error), "invalid_value") from None
    stream_options = request.get("stream_options")
    include_usage = isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))
    # Ollama streams unless told "stream": false; OpenAI streams only when told "stream": true.
    stream = request.get("stream") is not False if ollama else bool(request.get("stream"))
    prompt_tokens = mock_completion.prompt_token_count(request, chars_per_token)
    return _Generation(model, n_tokens, stream, include_usage, prompt_tokens)


def _parse_embedding(body: bytes, *, default_model: str, ollama: bool) -> dict[str, Any]:
    """The whole embeddings answer to ``body`` (OpenAI's shape, or Ollama's ``/api/embed``)."""
    request, model = _request_of(body, default_model)
    build = mock_embedding.ollama_embed_response if ollama else mock_embedding.embedding_response
    try:
        return build(model, request)
    except ValueError as error:
        raise _BadRequest(str(error), "invalid_value") from None


async def _read_body(receive: Receive) -> bytes | None:
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


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Wait for ``http.disconnect`` and then cancel ``scope`` (the response in progress).

    Checkpoints. Cancelled once the response is complete.
    """
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge ASGI lifespan startup and shutdown; the backend holds no resources.

    Checkpoints. Cancellation propagates.
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def serve_mock_backend(
    backend: MockBackend,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``backend.app`` over HTTP/1.1 (:mod:`iop_http` framing on trio sockets) until cancelled.

    Use with ``port = await nursery.start(serve_mock_backend, backend)``. Nothing is logged per
    request; an exception in the app is logged by the ``iop_mock.server`` logger (the request
    gets a 500 if its response had not started, and its connection closes).

    Args:
        backend: the backend whose app and counters are served.
        host: address to bind; the default is loopback only.
        port: TCP port; 0 picks a free one.
        task_status: receives the actual bound port once the socket listens.

    Raises:
        OSError: the address cannot be bound.

    Checkpoints. Runs until cancelled; cancellation closes the listener and every open
    connection at once (responses in progress end, their in-flight counts are released).
    """
    async with trio.open_nursery() as nursery:
        bound_port = await nursery.start(functools.partial(serve_asgi, backend.app, host, port))
        task_status.started(bound_port)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="iop-mock-backend",
        description="OpenAI/Ollama-compatible fake LLM backend that counts in-flight requests.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9100, help="TCP port, 0 = any (default 9100)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="time to first token (default 0)")
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=0.0,
        help="generation speed, 0 = as fast as possible (default 0)",
    )
    parser.add_argument(
        "--prompt-chars-per-token",
        type=float,
        default=4.0,
        help="prompt characters per prompt token reported in usage (default 4, the Edge's estimate)",
    )
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        help="model id listed by /v1/models; repeatable (default: mock)",
    )
    parser.add_argument(
        "--fail-status",
        type=int,
        default=None,
        help="answer every generation request with this HTTP status (400-599); POST /fault changes it",
    )
    parser.add_argument(
        "--track-repeats",
        action="store_true",
        help="count requests whose body repeats one served before (repeated in /stats; for tests)",
    )
    args = parser.parse_args(argv)
    if args.fail_status is not None and not 400 <= args.fail_status <= 599:
        parser.error("--fail-status must be an HTTP error status (400-599)")
    if args.latency_ms < 0 or args.tokens_per_second < 0:
        parser.error("--latency-ms and --tokens-per-second must be >= 0")
    if args.prompt_chars_per_token <= 0:
        parser.error("--prompt-chars-per-token must be > 0")
    return args


async def _run(backend: MockBackend, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then close every connection and return.

    Checkpoints; runs until a signal or cancellation.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(functools.partial(serve_mock_backend, backend, host=host, port=port))
            url_host = f"[{host}]" if ":" in host else host
            print(f"iop-mock-backend listening on http://{url_host}:{bound}", file=sys.stderr, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``iop-mock-backend``; exits 0 on SIGINT or SIGTERM."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    models: list[str] = args.models or ["mock"]
    backend = MockBackend(
        latency=args.latency_ms / 1000.0,
        tokens_per_second=args.tokens_per_second,
        prompt_chars_per_token=args.prompt_chars_per_token,
        models=models,
        fail_status=args.fail_status,
        track_repeats=args.track_repeats,
    )
    trio.run(_run, backend, args.host, args.port)


if __name__ == "__main__":
    main()
