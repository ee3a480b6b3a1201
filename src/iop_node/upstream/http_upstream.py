"""HTTP upstream access shared by the ``openai`` and ``ollama`` adapters.

One :class:`HttpUpstream` per provider owns ONE ``httpx.AsyncClient``. For a
plain ``http://`` upstream (the usual case: a backend on loopback or the LAN)
its transport is :class:`~iop_node.upstream.pool.H11Transport` (h11 over trio
sockets, a keep-alive pool of at most ``capacity`` connections, the request
head and body in one send); for ``https://`` it is httpx's default transport
with a pool of ``capacity`` connections (why not httpcore for plain HTTP:
:mod:`iop_node.upstream.pool`).

Error mapping lives here, once: transport errors and timeouts become
:class:`UpstreamUnreachable`; a non-2xx answer becomes :class:`UpstreamFailed`
carrying the status, the upstream's own message and its body (the Edge passes a
backend 4xx through to the client with them). An answer past the provider's
``limits`` (:class:`~iop_node.config.UpstreamLimits`) becomes
:class:`UpstreamTooLarge` (its head, a non-stream answer, a line of a stream
the Node parses) or :class:`UpstreamFailed` (its chunk extensions, its 1xx answers).
"""

from __future__ import annotations

import http.cookiejar
import json
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager, contextmanager
from typing import Any, Final, Protocol, final

import attrs
import httpx

from iop_node._errors import BadRunRequest, RunFailed, UpstreamFailed, UpstreamTooLarge, UpstreamUnreachable
from iop_node.adapters.interface import TunnelHead
from iop_node.config import ProviderConfig, UpstreamLimits
from iop_node.upstream.connection import AnswerOverBound, AnswerTooLarge
from iop_node.upstream.http11 import PostRequests
from iop_node.upstream.poller import RunOutput
from iop_node.upstream.pool import H11Transport
from iop_wire import UPSTREAM_BODY_LIMIT

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_encode_json: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
"""JSON as httpx encodes a ``json=`` body."""
# httpx sets these itself from the URL and the body it sends.
_REQUEST_OWNED = _HOP_BY_HOP | {"host", "content-length"}


@final
@attrs.define(eq=False)
class HttpUpstream:
    """One provider's HTTP client plus the server root for tunnel requests.

    Attributes:
        root: the server root that tunnel paths are appended to (no trailing slash).
        client: the provider's one client (its pool holds at most ``capacity`` connections).
        direct: the client's transport when it is our :class:`H11Transport`: runs go to it
            directly (tunnel requests still go through the client).
        timeouts: the client's timeouts, as a request's ``timeout`` extension.
        limits: the bounds on what the upstream sends.
    """

    root: str
    client: httpx.AsyncClient
    direct: H11Transport | None = None
    timeouts: dict[str, float | None] = attrs.field(factory=dict)
    limits: UpstreamLimits = attrs.field(factory=UpstreamLimits)
    _posts: dict[str, PostRequests] = attrs.field(factory=dict, init=False)

    @classmethod
    def for_provider(
        cls,
        provider: ProviderConfig,
        root: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> HttpUpstream:
        """Build the provider's client: its transport, pool size and timeouts.

        Args:
            provider: the provider's config.
            root: server root for tunnel paths.
            transport: replaces the network transport (tests use ``httpx.MockTransport``).
        """
        timeout = httpx.Timeout(
            provider.timeout_ms / 1000,
            connect=provider.connect_timeout_ms / 1000,
            pool=provider.connect_timeout_ms / 1000,
        )
        if transport is None:
            if root.startswith("http://"):
                transport = H11Transport(provider.capacity, provider.limits, provider.abort_grace_ms / 1000)
            else:
                limits = httpx.Limits(max_connections=provider.capacity, max_keepalive_connections=provider.capacity)
                transport = httpx.AsyncHTTPTransport(limits=limits)
        client = httpx.AsyncClient(timeout=timeout, transport=transport, cookies=_NoCookies())
        direct = transport if isinstance(transport, H11Transport) else None
        return cls(
            root=root.rstrip("/"), client=client, direct=direct, timeouts=timeout.as_dict(), limits=provider.limits
        )

    @asynccontextmanager
    async def post_json(self, url: str, body: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """Open a streaming ``POST url`` with a JSON body; yield the 2xx response.

        Checkpoints. Transport errors raised while the caller reads the body are
        mapped too. Leaving the block (also by cancellation) closes the request.

        Raises:
            UpstreamUnreachable: connection error or timeout.
            UpstreamFailed: the upstream answered non-2xx.
        """
        parsed = self._url(url)
        with _transport_errors_mapped():
            if self.direct is None:
                async with self.client.stream("POST", parsed, json=body) as response:
                    if not response.is_success:
                        raise await _failure_of(response)
                    yield response
                return
            # Straight to our h11 transport: the client's layers (auth, redirects, cookies,
            # event hooks) do nothing for a run and cost a tenth of the Node's CPU per request.
            request = httpx.Request("POST", parsed, json=body, extensions={"timeout": self.timeouts})
            response = await self.direct.handle_async_request(request)
            response.request = request
            try:
                if not response.is_success:
                    raise await _failure_of(response)
                yield response
            finally:
                await response.aclose()

    async def relay_post(
        self, url: str, body: dict[str, Any], send: Callable[[bytes], Awaitable[None]], *, whole: bool = False
    ) -> None:
        """``POST url`` with a JSON body and hand the 2xx answer's body to ``send`` as it arrives.

        ``whole``: the answer is one object (a non-stream run), bounded by ``limits.answer_bytes``.

        A run's relay. With our :class:`H11Transport` the request goes straight to it (no
        ``httpx`` request or response objects) and the body is every byte read so far at
        each read (:meth:`iop_node.upstream.http11.Answer.pump`); when ``send`` is a
        :class:`~iop_node.upstream.poller.RunOutput` with a poller, the session's poller reads it
        instead (:meth:`iop_node.upstream.poller.BodyPoller.relay`). Checkpoints; cancellation
        closes the request.

        Raises:
            UpstreamUnreachable: connection error or timeout.
            UpstreamFailed: the upstream answered non-2xx.
            UpstreamTooLarge: the answer's head (or, ``whole``, its body) is past its bound.
        """
        if self.direct is None:
            limit = self.limits.answer_bytes if whole else None
            async with self.post_json(url, body) as response, aclosing(BodyStream(response, max_bytes=limit)) as chunks:
                await chunks.pump(send)
            return
        content = _encode_json(body).encode()
        # Plain calls and try blocks, no context managers: the generator-based ones (the
        # block of a request, the error mapping) cost a measurable share of each run (see
        # post_json for the client's layers).
        try:
            answer = await self.direct.post(self._post(url), content, self.timeouts, whole=whole)
            try:
                if not 200 <= answer.status < 300:
                    raise await _failure(answer.status, answer.reason.decode("ascii", "replace"), answer)
                if isinstance(send, RunOutput) and send.poller is not None:
                    await send.poller.relay(answer, send)
                else:
                    await answer.pump(send)
            finally:
                answer.close()
        except httpx.TransportError as exc:
            raise _run_error(exc) from None

    def _url(self, url: str) -> httpx.URL:
        return self._post(url).url

    def _post(self, url: str) -> PostRequests:
        # The run URLs are few and fixed: parse each once (httpx would parse the string every
        # time), and let h11 write their requests' head once (PostRequests).
        post = self._posts.get(url)
        if post is None:
            post = self._posts[url] = PostRequests(httpx.URL(url), b"application/json")
        return post

    async def tunnel(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> AsyncGenerator[TunnelHead | bytes, None]:
        """Forward a raw request to ``root + path``; yield the head, then raw body chunks.

        Any upstream status is passed through. The body is relayed as received
        (``aiter_raw``), so ``content-encoding`` stays true. Hop-by-hop headers
        are dropped both ways. Checkpoints; closing or cancelling the generator
        closes the upstream request.

        Raises:
            BadRunRequest: the method is not an HTTP token or the path is not
                an absolute path on the server root.
            UpstreamUnreachable: connection error or timeout.
        """
        if not method.isascii() or not method.isalpha():
            raise BadRunRequest(f"bad tunnel method {method!r}")
        if not path.startswith("/") or path.startswith("//"):
            raise BadRunRequest(f"tunnel path must start with a single '/', got {path!r}")
        client = self.client
        with _transport_errors_mapped():
            request = client.build_request(
                method.upper(),
                self.root + path,
                headers=[(k, v) for k, v in headers if k.lower() not in _REQUEST_OWNED],
                content=body,
            )
            response = await client.send(request, stream=True)
            async with aclosing(BodyStream(response, raw=True)) as response_body:
                yield TunnelHead(
                    status=response.status_code,
                    headers=tuple((k, v) for k, v in response.headers.multi_items() if k.lower() not in _HOP_BY_HOP),
                )
                while (chunk := await response_body.next_chunk()) is not None:
                    yield chunk

    async def aclose(self) -> None:
        """Close the client and its connections. Checkpoints."""
        await self.client.aclose()


class _NoCookies(http.cookiejar.CookieJar):
    """A cookie jar that keeps nothing.

    The provider's one client carries the runs of every Edge client: a cookie
    set by the upstream for one run must not be sent with the next. (It also
    spares httpx's cookie parsing on every response.) Cookies a tunnel request
    carries in its own headers still pass through.
    """

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        pass

    def extract_cookies(self, response: Any, request: Any) -> None:
        pass


class ChunkReader(Protocol):
    """An answer's body, read in chunks as they arrive."""

    async def next_chunk(self) -> bytes | None:
        """The next chunk, or None at the end. Checkpoints."""
        ...

    async def pump(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Hand every chunk to ``send`` until the end. Checkpoints."""
        ...


@final
class BodyStream:
    """Reads a streaming ``httpx`` response body by chunks or by lines.

    Why not ``response.aiter_lines()`` directly: httpx implements its body
    iterators as nested async generators (encode/httpx#3686). Leaving one early
    -- a cancelled run, ``[DONE]``, a send failure -- abandons the inner ones
    half-run, and trio's async-generator finalizer then warns and closes them
    later from a system task. :meth:`aclose` instead closes the response and
    steps the httpx iterator until it ends, so every generator of the chain
    finishes at once, in this task. Use it as ``async with aclosing(body):``.

    Args:
        response: a response opened with ``stream=True``.
        raw: yield the bytes as received (no content decoding), for tunnels.
        max_bytes: the most bytes of the (decoded) body; None: no bound.
        max_line: the most bytes of one line (:meth:`next_line`); None: no bound.
    """

    def __init__(
        self, response: httpx.Response, *, raw: bool = False, max_bytes: int | None = None, max_line: int | None = None
    ) -> None:
        self._response = response
        self._chunks = response.aiter_raw() if raw else response.aiter_bytes()
        self._buffer = b""
        self._lines: deque[bytes] = deque()
        self._ended = False
        self._left = max_bytes
        self._max_line = max_line

    async def next_chunk(self) -> bytes | None:
        """Return the next body chunk, or None at the end. Checkpoints.

        Raises:
            httpx.TransportError: the upstream connection failed.
            UpstreamTooLarge: the body is longer than ``max_bytes``.
        """
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            return None
        if self._left is not None:
            self._left -= len(chunk)
            if self._left < 0:
                raise UpstreamTooLarge("the upstream's answer is larger than the provider's limits.answer_bytes")
        return chunk

    async def pump(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Hand every chunk to ``send`` until the end. Checkpoints.

        Raises:
            httpx.TransportError: the upstream connection failed.
        """
        while (chunk := await self.next_chunk()) is not None:
            await send(chunk)

    async def next_line(self) -> str | None:
        """Return the next line without its line ending, or None at the end. Checkpoints.

        Raises:
            httpx.TransportError: the upstream connection failed.
            UpstreamTooLarge: a line is still without its end past ``max_line`` bytes.
        """
        while not self._lines:
            if self._ended:
                return None
            chunk = await self.next_chunk()
            if chunk is None:
                self._ended = True
                if self._buffer:
                    self._lines.append(self._buffer)
                    self._buffer = b""
                continue
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            self._lines.extend(lines)
            if self._max_line is not None and len(self._buffer) > self._max_line:  # a line without end
                raise UpstreamTooLarge(
                    "a line of the upstream's stream is larger than the provider's limits.answer_bytes"
                )
        return self._lines.popleft().rstrip(b"\r").decode("utf-8", "replace")

    async def aclose(self) -> None:
        """Close the response and finish httpx's body iterator.

        Checkpoints. If the caller is cancelled, ``Cancelled`` is raised from
        inside the iterator chain, which finishes it too, and propagates.
        """
        await self._response.aclose()
        while True:
            try:
                await self._chunks.__anext__()
            except StopAsyncIteration:
                return
            except Exception:  # the closed connection fails the read: the chain is finished
                return


class HttpAdapter:
    """Base of the HTTP adapters: tunnel and close through :attr:`http`."""

    http: HttpUpstream

    def tunnel(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> AsyncGenerator[TunnelHead | bytes, None]:
        """Forward a raw request to the server root. See :meth:`iop_node.Adapter.tunnel`."""
        return self.http.tunnel(method, path, headers, body)

    async def aclose(self) -> None:
        """Close the provider's connection pool. Checkpoints."""
        await self.http.aclose()


async def read_object(response: httpx.Response, max_bytes: int) -> dict[str, Any]:
    """Read the whole body (at most ``max_bytes``) and return it as a JSON object. Checkpoints.

    Raises:
        UpstreamFailed: the body is not a JSON object.
        UpstreamTooLarge: the body is longer than ``max_bytes``.
    """
    data = bytearray()
    async with aclosing(BodyStream(response, max_bytes=max_bytes)) as body:
        while (chunk := await body.next_chunk()) is not None:
            data += chunk
    return parse_object(data)


def parse_object(data: str | bytes | bytearray) -> dict[str, Any]:
    """Parse one upstream JSON object.

    Raises:
        UpstreamFailed: ``data`` is not a JSON object.
    """
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise UpstreamFailed(f"upstream sent invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UpstreamFailed(f"upstream sent JSON {type(value).__name__}, expected an object")
    return value


def error_message(value: dict[str, Any]) -> str | None:
    """Return the message of an OpenAI (``{"error": {"message"}}``) or Ollama
    (``{"error": "..."}``) error object, or None when ``value`` is not one."""
    error = value.get("error")
    if isinstance(error, dict):
        message = error.get("message")
        return str(message) if message is not None else json.dumps(error)
    if isinstance(error, str):
        return error
    return None


async def _failure_of(response: httpx.Response) -> UpstreamFailed:
    async with aclosing(BodyStream(response)) as stream:
        return await _failure(response.status_code, response.reason_phrase, stream)


async def _failure(status: int, reason: str, body: ChunkReader) -> UpstreamFailed:
    """The error for a non-2xx answer: its status, message and (the start of) its body. Checkpoints."""
    data = bytearray()
    while len(data) < UPSTREAM_BODY_LIMIT and (chunk := await body.next_chunk()) is not None:
        data += chunk
    text = data[:UPSTREAM_BODY_LIMIT].decode("utf-8", "replace").strip()[:UPSTREAM_BODY_LIMIT]
    message = None
    try:
        value = json.loads(text)
    except ValueError:
        pass
    else:
        if isinstance(value, dict):
            message = error_message(value)
    if not message:
        message = text or reason or f"HTTP {status}"
    return UpstreamFailed(message, status=status, body=text)


@contextmanager
def _transport_errors_mapped() -> Iterator[None]:
    """Map ``httpx`` transport errors and timeouts to :class:`UpstreamUnreachable`.

    A sync context manager: it may wrap a ``yield`` of an async generator
    without holding a cancel scope across it.
    """
    try:
        yield
    except httpx.TransportError as exc:
        raise _run_error(exc) from None


def _run_error(exc: httpx.TransportError) -> RunFailed:
    """The run error for an ``httpx`` transport error or timeout, or an answer past a bound."""
    if isinstance(exc, AnswerTooLarge):
        return UpstreamTooLarge(str(exc))
    if isinstance(exc, AnswerOverBound):
        return UpstreamFailed(f"bad answer from the upstream: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamUnreachable(
            f"upstream timed out ({type(exc).__name__})", silent=isinstance(exc, httpx.ReadTimeout)
        )
    return UpstreamUnreachable(f"upstream unreachable: {exc or type(exc).__name__}")
