"""Encoding HTTP/1.1 answers: a response head, a whole answer, a chunk, the last chunk, a canned error.

The bytes are the ones h11 writes for the same answer (an empty reason
phrase, fields in the order given), so a client sees the same answer
whichever piece of the project wrote it. Header names and values are checked:
a CR, LF or NUL in one (a response-splitting attempt carried through a
relayed header) raises ``ValueError`` rather than going on the wire.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from .refusals import Refusal

LAST_CHUNK: Final = b"0\r\n\r\n"
"""The end of a chunked body (no trailers)."""

_NAME: Final = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_VALUE: Final = re.compile(rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?")
_CLOSE: Final = (b"connection", b"close")


def encode_head(status: int, headers: Iterable[tuple[bytes, bytes]], reason: bytes = b"") -> bytes:
    """``HTTP/1.1 <status> <reason>`` and the fields, through the empty line."""
    if not 100 <= status <= 999:
        raise ValueError(f"status {status} out of range")
    parts = [b"HTTP/1.1 %d %b\r\n" % (status, reason)]
    for name, value in headers:
        if _NAME.fullmatch(name) is None or _VALUE.fullmatch(value) is None:
            raise ValueError(f"invalid header field {name!r}")
        parts.append(b"%b: %b\r\n" % (name, value))
    parts.append(b"\r\n")
    return b"".join(parts)


def encode_response(status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes, *, close: bool = False) -> bytes:
    """A whole answer: the head (plus ``connection: close`` when ``close``) and ``body``.

    ``headers`` frame ``body`` (a ``content-length``; this function adds none).
    """
    fields = list(headers)
    if close and _CLOSE not in fields:
        fields.append(_CLOSE)
    return encode_head(status, fields) + body


def encode_request(method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]], body: bytes = b"") -> bytes:
    """A whole request: the request line, the fields (a ``content-length`` added when there is a body),
    the empty line and ``body``. Names and values are checked as for an answer."""
    parts = [b"%b %b HTTP/1.1\r\n" % (method, target)]
    for name, value in headers:
        if _NAME.fullmatch(name) is None or _VALUE.fullmatch(value) is None:
            raise ValueError(f"invalid header field {name!r}")
        parts.append(b"%b: %b\r\n" % (name, value))
    if body:
        parts.append(length_framed(body))
    else:
        parts.append(b"\r\n")
    return b"".join(parts)


def length_framed(body: bytes) -> bytes:
    """The last field of a head, ``content-length``, the empty line and ``body``: a message's tail when
    everything before it (request or status line and the other fields) is already encoded."""
    return b"content-length: %d\r\n\r\n%b" % (len(body), body)


def encode_chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (empty ``data``: nothing, which would end the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


def error_response(refusal: Refusal) -> bytes:
    """The answer to a refused request: its status, its fixed reason as text, and ``connection: close``."""
    body = refusal.reason.encode("ascii") + b"\n"
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body))]
    return encode_response(refusal.status, headers, body, close=True)
