"""The listener's plain lane: a whole plain HTTP/1.1 request read by llhttp, its whole answer written as h11 writes it.

Why: driving h11 for one small keep-alive exchange (its events and state
machine: the request head, its body, its end; the answer's head, body and end;
the next cycle) cost the Edge about 80 us of CPU per request on the benchmark
box, a sixth of all its CPU per request at concurrency 64 (py-spy); llhttp
(``httptools``, the parser the Node reads upstream answers with) reads the same
request in about 2 us.

The lane is taken only where its bytes are h11's bytes, and every other
exchange stays h11's:

- :func:`parse_plain` reads one read's bytes as a request only when they are
  exactly one whole request that h11 would read the same way: HTTP/1.1,
  keep-alive, not ``HEAD`` nor ``CONNECT``, one ``host``, a body framed by
  ``content-length`` (no ``transfer-encoding``), no ``expect``, nothing after
  it, a head within the listener's ``max_head_bytes``. Anything else (a head
  in several reads, a chunked body, a pipelined request, bytes llhttp
  refuses) returns None and goes to h11 as before.
- :func:`plain_response` writes a whole answer (head and body at once) only
  when h11 would write exactly those bytes: a final status that carries a body,
  one ``content-length`` equal to the body's length, valid header names and
  values, and none of the headers h11 rewrites (``connection``,
  ``transfer-encoding``) or moves (``host``). Otherwise None: the listener
  hands the request's bytes to h11 and answers through it (a streamed answer,
  say).
"""

from __future__ import annotations

import re
from typing import Final, final

import httptools

_TOKEN: Final = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
"""A header name, as h11 validates it."""
_FIELD_VALUE: Final = re.compile(rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?")
"""A header value, as h11 validates it (no surrounding whitespace, no control characters)."""
_REWRITTEN: Final = frozenset({b"connection", b"transfer-encoding", b"host"})
"""Response headers h11 rewrites or reorders: an answer with one goes through h11."""
_NOT_PLAIN: Final = frozenset({b"expect", b"transfer-encoding"})
"""Request headers that make h11 answer differently (``100 Continue``, a chunked body)."""
_NO_BODY_STATUSES: Final = frozenset({204, 304})


@final
class PlainRequest:
    """One whole plain request: what the listener needs of an ``h11.Request`` plus its body and bytes.

    ``headers`` have lower-case names, as h11 gives them; ``raw`` is every byte
    of the request (handed to h11 when its answer is not plain).
    """

    __slots__ = ("method", "target", "headers", "http_version", "body", "raw")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes, raw: bytes):
        self.method = method
        self.target = target
        self.headers = headers
        self.http_version = b"1.1"
        self.body = body
        self.raw = raw

    def __repr__(self) -> str:
        return f"<PlainRequest {self.method.decode('latin-1')} {self.target!r}, {len(self.body)} bytes of body>"


@final
class _Found:
    """llhttp's callbacks (httptools calls them by name) and what they found."""

    __slots__ = ("parser", "url", "headers", "body", "messages", "complete", "plain_head")

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.plain_head = False
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.messages = 0
        self.complete = 0

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value.strip(b" \t")))  # llhttp keeps trailing whitespace, h11 not

    def on_headers_complete(self) -> None:
        # Asked here: llhttp forgets a message's keep-alive once the message is complete.
        parser = self.parser
        self.plain_head = (
            parser.should_keep_alive() and parser.get_http_version() == "1.1" and self.parser.get_method() != b"HEAD"
        )

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete += 1


def parse_plain(data: bytes, max_head_bytes: int) -> PlainRequest | None:
    """``data`` as one whole plain request (see the module), or None to leave it to h11."""
    head_end = data.find(b"\r\n\r\n") + 4
    if head_end < 4 or head_end > max_head_bytes:
        return None
    found = _Found()
    try:
        found.parser.feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None  # CONNECT and upgrades too
    if found.messages != 1 or found.complete != 1 or head_end + len(found.body) != len(data) or not found.plain_head:
        return None
    method: bytes = found.parser.get_method()
    if not data.startswith(b"%b %b HTTP/1.1\r\n" % (method, found.url)):  # the request line as h11 reads one
        return None
    hosts = 0
    for name, _ in found.headers:
        if name in _NOT_PLAIN:
            return None
        if name == b"host":
            hosts += 1
    if hosts != 1:
        return None
    return PlainRequest(method, found.url, found.headers, found.body, data)


def plain_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes | None:
    """The bytes h11 writes for this whole answer to a plain request, or None when it would write others."""
    if status < 200 or status > 999 or status in _NO_BODY_STATUSES:
        return None
    parts = [b"HTTP/1.1 %d \r\n" % status]
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
        if _TOKEN.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
            return None
        parts.append(b"%b: %b\r\n" % (name, value))
    if not framed:
        return None
    parts.append(b"\r\n")
    parts.append(body)
    return b"".join(parts)
