"""The listener's plain lane: a whole plain HTTP/1.1 request, read by :mod:`iop_http` alone, its whole answer
written as h11 writes it.

Why: driving h11 for one small keep-alive exchange (its events and state
machine: the request head, its body, its end; the answer's head, body and end;
the next cycle) cost the Edge about 80 us of CPU per request on the benchmark
box, a sixth of all its CPU per request at concurrency 64 (py-spy).

The lane is taken only where its bytes are h11's bytes, and every other
exchange stays h11's:

- a read is a plain request (:func:`is_plain`) only when it is exactly one
  whole request :func:`iop_http.accept_head` accepted: HTTP/1.1, keep-alive,
  not ``HEAD`` nor ``CONNECT``, a body framed by ``content-length`` and wholly
  in the read, no ``expect``, nothing after it. Anything else (a head in
  several reads, a chunked body, a pipelined request) goes to h11, after the
  same :func:`iop_http.accept_head` accepted its head.
- :func:`plain_response` writes a whole answer (head and body at once) only
  when h11 would write exactly those bytes: a final status that carries a body,
  one ``content-length`` equal to the body's length, valid header names and
  values, and none of the headers h11 rewrites (``connection``,
  ``transfer-encoding``) or moves (``host``). Otherwise None: the listener
  hands the request's bytes to h11 and answers through it (a streamed answer,
  say).
"""

from __future__ import annotations

from typing import Final, final

from iop_http import CHUNKED, RequestHead, accept_head, encode_head, find_head_end

_REWRITTEN: Final = frozenset({b"connection", b"transfer-encoding", b"host"})
"""Response headers h11 rewrites or reorders: an answer with one goes through h11."""
_NOT_PLAIN: Final = frozenset({b"expect", b"transfer-encoding", b"upgrade"})
"""Request headers that make h11 answer differently (``100 Continue``, a chunked body, a protocol switch)."""
_NO_BODY_STATUSES: Final = frozenset({204, 304})
_NOT_PLAIN_METHODS: Final = frozenset({b"HEAD", b"CONNECT"})


@final
class PlainRequest:
    """One whole plain request: what the listener needs of an ``h11.Request`` plus its body and bytes.

    ``headers`` have lower-case names, as h11 gives them; ``target`` is the
    origin form the request is routed by; ``raw`` is every byte of the request
    (handed to h11 when its answer is not plain).
    """

    __slots__ = ("head", "method", "target", "headers", "http_version", "body", "raw")

    def __init__(self, head: RequestHead, body: bytes, raw: bytes):
        self.head = head
        self.method = head.method
        self.target = head.path
        self.headers = head.headers
        self.http_version = b"1.1"
        self.body = body
        self.raw = raw

    def __repr__(self) -> str:
        return f"<PlainRequest {self.method.decode('latin-1')} {self.target!r}, {len(self.body)} bytes of body>"


def parse_plain(data: bytes, max_head_bytes: int) -> PlainRequest | None:
    """``data`` (one read, nothing before it) as one whole plain request (see the module), or None."""
    end = find_head_end(data)
    if end < 0:
        return None
    head = accept_head(data[:end], max_head_bytes)
    if type(head) is not RequestHead or end + head.length != len(data) or not is_plain(head):
        return None
    return PlainRequest(head, data[end:], data)


def is_plain(head: RequestHead) -> bool:
    """Whether an accepted request head (whose whole body is in hand) may take the plain lane (see the module)."""
    return (
        head.keep_alive
        and head.http_version == b"1.1"
        and head.length != CHUNKED
        and head.method not in _NOT_PLAIN_METHODS
        and not any(name in _NOT_PLAIN for name, _ in head.headers)
    )


def plain_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes | None:
    """The bytes h11 writes for this whole answer to a plain request, or None when it would write others."""
    if status < 200 or status > 999 or status in _NO_BODY_STATUSES:
        return None
    framed = False
    for name, value in headers:
        if type(name) is not bytes or type(value) is not bytes:
            return None
        lower = name.lower()
        if lower == b"content-length":
            if framed or value != b"%d" % len(body):
                return None
            framed = True
        elif lower in _REWRITTEN:
            return None
    if not framed:
        return None
    try:
        return encode_head(status, headers) + body  # checks each name and value as h11 does
    except ValueError:
        return None
