"""Framing one response to a request (RFC 9112 6.3 and 9.6), as h11 frames an answer, without I/O.

A :class:`ResponseFraming` per response decides, on its head, how the body is
framed and whether the connection carries another request:

- a ``content-length`` frames the body: more bytes than it says raise
  :class:`BodyOverrun`, and a body cut short leaves :attr:`ResponseFraming.complete` false
  (the connection cannot go on);
- without one, an HTTP/1.1 client gets the chunked coding (``transfer-encoding:
  chunked`` added, :data:`LAST_CHUNK` at the end) and an HTTP/1.0 client a body
  delimited by the connection's close;
- ``HEAD`` and 1xx/204/304 answers carry no body (their bytes are dropped);
- the connection is kept only when the request allows it (HTTP/1.1, no
  ``connection: close``, no upgrade) and the response does not say ``connection:
  close``; otherwise ``connection: close`` is added.
"""

from __future__ import annotations

from typing import Final, final

from .encoding import LAST_CHUNK, encode_chunk, encode_head
from .head import RequestHead

_CLOSE: Final = (b"connection", b"close")
_CHUNKED: Final = (b"transfer-encoding", b"chunked")
_NO_BODY_STATUSES: Final = frozenset({204, 304})

NO_BODY, LENGTH, CHUNKS, UNTIL_CLOSE = range(4)
"""The framings of a response body (:attr:`ResponseFraming.framing`)."""


class BodyOverrun(ValueError):
    """More response body than its ``content-length`` said: the response cannot go on."""


@final
class ResponseFraming:
    """The framing of one response to ``request``: its head, each piece of its body, its end."""

    __slots__ = ("_request", "framing", "left", "keep_alive", "status", "done")

    def __init__(self, request: RequestHead) -> None:
        self._request = request
        self.framing = NO_BODY
        """How the body is framed, once the head is encoded."""
        self.left = 0
        """The bytes a ``content-length`` framed body still owes."""
        self.keep_alive = request.keep_alive
        """Whether the connection may carry another request after this response."""
        self.status = 0
        self.done = False
        """The response's last byte is encoded."""

    def __repr__(self) -> str:
        return f"<ResponseFraming {self.status}, framing {self.framing}, {self.left} bytes owed>"

    @property
    def chunked(self) -> bool:
        """The body is framed as chunks."""
        return self.framing == CHUNKS

    @property
    def complete(self) -> bool:
        """The whole response is encoded, its body as long as its head said."""
        return self.done and not self.left

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The response head, its framing decided (see the module). Raises ``ValueError`` on a bad field."""
        self.status = status
        length = None
        close = not self.keep_alive
        coding = False
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                length = value
            elif lower == b"connection":
                close = close or b"close" in value.lower()
            elif lower == b"transfer-encoding":
                coding = True
        fields = headers
        if status < 200 or status in _NO_BODY_STATUSES:
            self.framing = NO_BODY
        elif length is not None and not coding:
            self.left = int(length)
            self.framing = LENGTH
        elif self._request.http_version == b"1.1":
            if not coding:
                fields = [*fields, _CHUNKED]
            self.framing = CHUNKS
        else:
            close = True
            self.framing = UNTIL_CLOSE
        if self._request.method == b"HEAD":
            self.framing = NO_BODY
            self.left = 0
        if close:
            self.keep_alive = False
            if _CLOSE not in fields:
                fields = [*fields, _CLOSE]
        return encode_head(status, fields)

    def body(self, data: bytes) -> bytes:
        """``data`` framed as the body's next bytes (b"" when the response carries no body)."""
        framing = self.framing
        if framing == CHUNKS:
            return encode_chunk(data)
        if framing == LENGTH:
            if len(data) > self.left:
                raise BodyOverrun("more body than the content-length said")
            self.left -= len(data)
            return data
        return data if framing == UNTIL_CLOSE else b""

    def end(self) -> bytes:
        """The end of the body (the last chunk, or nothing); the response is done."""
        self.done = True
        return LAST_CHUNK if self.framing == CHUNKS else b""
