"""The HTTP/1.1 under the etcd gateway's calls: one kept connection per endpoint (docs/ha.md).

A leader renews its lease every third of the TTL for as long as it leads, and
a standby campaigns every poll: the calls are few, small and all alike (a JSON
POST, a JSON answer), so nearly the whole of their cost is the client's
machinery, and that cost is HA's steady cost (docs/benchmarks.md). httpx's
(request and response models, the connection pool's locks, a cancel scope per
phase) cost several times what the call itself does. This is the project's
own sans-I/O HTTP (:func:`iop_http.encode_request`, the answer parsed by
llhttp through :class:`iop_http.StatusAnswers`, the parser the Node's health
probes keep per connection) over a trio stream, TLS when the endpoint is
``https://``. One call is one write and, mostly, one read.

A kept connection is used again only if it is idle and quiet (nothing to read:
a peer that closed it, or sent bytes nobody asked for, makes it readable), as
httpcore checks; otherwise, and after any failure or cancellation in the middle
of a call, it is closed and the next call opens a new one. Nothing is retried
here: a call that fails is the election's to retry (:class:`~iop_edge.ha.etcd.EtcdGateway`
tries the next endpoint).
"""

from __future__ import annotations

import select
import ssl
import urllib.parse
from collections.abc import Sequence
from typing import Final, final

import trio

from iop_http import AnswerError, StatusAnswers, encode_request

BODY_BYTES: Final = 1 << 20
"""The bound on an answer's body: etcd's answers to the election's calls are a few hundred bytes."""
READ_BYTES: Final = 65536

Headers = Sequence[tuple[bytes, bytes]]


class CallFailed(Exception):
    """No answer came: the connection failed, the answer was not valid HTTP, or the call timed out."""


@final
class _Kept:
    """One endpoint's connection and the parser that reads its answers."""

    __slots__ = ("stream", "answers")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.answers = StatusAnswers()

    def quiet(self) -> bool:
        """Whether the connection can carry a call: nothing waits to be read on it (no EOF, no stray bytes).

        ``poll``, not ``select``: an Edge at fleet size holds descriptors past ``select``'s limit.
        """
        stream = self.stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if not isinstance(stream, trio.SocketStream):
            return True  # not a socket (never, as opened here): nothing to ask
        poller = select.poll()
        poller.register(stream.socket.fileno(), select.POLLIN)
        return not poller.poll(0)


@final
class EtcdHttp:
    """JSON POSTs to etcd's endpoints, each call bounded by ``timeout`` seconds (connecting included).

    Args:
        timeout: the bound on one call, from its start to its answer's end.
        tls: the context of ``https://`` endpoints (None: the system's default trust).
    """

    def __init__(self, timeout: float, tls: ssl.SSLContext | None = None) -> None:
        self.timeout = timeout
        self._tls = tls
        self._kept: dict[str, _Kept] = {}

    async def post(self, url: str, body: bytes, headers: Headers = ()) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to ``url``; its answer's status and body.

        Raises:
            CallFailed: no whole answer came within the timeout.
        """
        parts = urllib.parse.urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        target = (parts.path or "/").encode()
        if parts.query:
            target += b"?" + parts.query.encode()
        request = encode_request(
            b"POST", target, [(b"host", parts.netloc.encode()), (b"content-type", b"application/json"), *headers], body
        )
        kept = self._kept.pop(origin, None)
        if kept is not None and not kept.quiet():
            await trio.aclose_forcefully(kept.stream)
            kept = None
        reusable = False
        try:
            with trio.fail_after(self.timeout):
                if kept is None:
                    kept = _Kept(await self._connect(parts))
                status, answer, reusable = await _exchange(kept, request)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, AnswerError) as exc:
            timed_out = isinstance(exc, trio.TooSlowError)
            reason = f"no answer within {self.timeout:g} s" if timed_out else str(exc) or type(exc).__name__
            raise CallFailed(f"{origin}: {reason}") from exc
        finally:  # kept only after a whole answer that leaves it reusable (a cancelled call's state is unknown)
            if kept is not None:
                if reusable:
                    self._kept[origin] = kept
                else:
                    await trio.aclose_forcefully(kept.stream)
        return status, answer

    async def _connect(self, parts: urllib.parse.SplitResult) -> trio.abc.Stream:
        host = parts.hostname or ""
        secure = parts.scheme == "https"
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, parts.port or (443 if secure else 80))
        if secure:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            stream = trio.SSLStream(stream, self._tls, server_hostname=host, https_compatible=True)
        return stream

    async def aclose(self) -> None:
        """Close every kept connection."""
        kept, self._kept = self._kept, {}
        for connection in kept.values():
            await trio.aclose_forcefully(connection.stream)


async def _exchange(kept: _Kept, request: bytes) -> tuple[int, bytes, bool]:
    """Send ``request`` on ``kept``, read its whole answer: ``(status, body, whether the connection is reusable)``."""
    answers = kept.answers
    answers.expect()
    await kept.stream.send_all(request)
    while not answers.complete:
        data = await kept.stream.receive_some(READ_BYTES)
        if not data:
            raise AnswerError("the connection closed before the answer's end")
        answers.feed(bytes(data))
        if answers.size > BODY_BYTES:
            raise AnswerError(f"the answer's body is over {BODY_BYTES} bytes", "too_large")
    return answers.status, b"".join(answers.body), answers.reusable
