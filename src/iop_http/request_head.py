"""Accepting a request head (RFC 9112): the request line, the fields, ``Host`` and the body's framing.

:func:`accept_head` is the one place that decides whether the bytes of a
request head are a request the project serves and, if so, where its body
ends. It is stricter than RFC 9112 requires wherever a lenient reading could
let two parsers frame the same bytes differently (request smuggling); each
rule is listed with its RFC section in ``docs/security.md``:

- the head ends at the first empty line and every line ends in CRLF; a bare
  CR or LF, a line folded onto the one before it (obs-fold), whitespace
  before a field's colon or a control character in a field refuse it (400);
- the request line is ``method SP target SP HTTP/1.x``; the target is a path
  (origin form), ``*`` for ``OPTIONS``, or an ``http``/``https`` URL
  (absolute form), which is routed by its path and query: anything else 400;
  a version other than 1.0 or 1.1 is 505;
- HTTP/1.1 requests carry exactly one ``Host``, HTTP/1.0 at most one (400);
- ``Content-Length`` is 1*DIGIT (at most 18 digits); several must be the same bytes (400);
- ``Transfer-Encoding`` beside ``Content-Length`` is 400, in an HTTP/1.0
  request 400, and anything but a single ``chunked`` 501;
- a head longer than the limit is 431, whatever the reads it came in.

Every refusal closes the connection: the body (if any) was not read, so the
next byte's place in the stream is unknown. A refusal's text is fixed: it
never carries the request's bytes.
"""

from __future__ import annotations

import re
from typing import Final, final

MAX_HEAD_BYTES: Final = 64 * 1024
"""The default bound of a request head, its final empty line included."""

CHUNKED: Final = -1
""":attr:`RequestHead.length` of a body in the chunked transfer coding."""

_MAX_LENGTH_DIGITS: Final = 18  # below 2**63: a length every parser holds in a machine word
_REQUEST_LINE: Final = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+) ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
_FIELDS: Final = re.compile(rb"(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+:[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*\r\n")
"""Every field line well formed (a token, a colon, no control character but HTAB, CRLF), then the empty line."""
_ABSOLUTE: Final = re.compile(rb"(?i:https?)://([^/?#]*)([^#]*)")
_AUTHORITY: Final = re.compile(rb"[-A-Za-z0-9._~%!$&'()*+,;=:\[\]]*")
_DIGITS: Final = re.compile(rb"[0-9]{1,%d}" % _MAX_LENGTH_DIGITS)
_HOST: Final = re.compile(rb"[-A-Za-z0-9._~%!$&'()*+,;=:\[\]]*")


@final
class RequestHead:
    """An accepted request head.

    Attributes:
        method: the method, as sent (case matters).
        target: the request target as sent.
        path: the target in origin form (``/path?query``): the path of an
            absolute-form target, ``*`` for ``OPTIONS *``; what the request is
            routed by.
        http_version: ``b"1.1"`` or ``b"1.0"``.
        headers: the fields, names lower-cased, values without surrounding whitespace.
        length: the body's length in bytes, or :data:`CHUNKED`.
        keep_alive: whether the client lets the connection carry another request.
        expect_continue: the client waits for ``100 Continue`` before sending its body.
        size: the head's length in bytes (its final empty line included).
    """

    __slots__ = (
        "method",
        "target",
        "path",
        "http_version",
        "headers",
        "length",
        "keep_alive",
        "expect_continue",
        "size",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        path: bytes,
        http_version: bytes,
        headers: list[tuple[bytes, bytes]],
        length: int,
        keep_alive: bool,
        expect_continue: bool,
        size: int,
    ) -> None:
        self.method = method
        self.target = target
        self.path = path
        self.http_version = http_version
        self.headers = headers
        self.length = length
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.size = size

    def __repr__(self) -> str:
        length = "chunked" if self.length == CHUNKED else f"{self.length} bytes"
        return f"<RequestHead {self.method.decode('latin-1')} {self.path!r}, body {length}>"


@final
class Refusal:
    """A refused request head: answer ``status`` with ``reason`` (fixed text), then close the connection."""

    __slots__ = ("status", "reason")

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason

    def __repr__(self) -> str:
        return f"<Refusal {self.status} {self.reason}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Refusal) and (self.status, self.reason) == (other.status, other.reason)

    def __hash__(self) -> int:
        return hash((self.status, self.reason))


def find_head_end(data: bytes | bytearray) -> int:
    """The length of the request head at the start of ``data`` (through its empty line), or -1 if not whole."""
    end = data.find(b"\r\n\r\n")
    return end + 4 if end >= 0 else -1


def head_too_large(data: bytes | bytearray, max_head_bytes: int = MAX_HEAD_BYTES) -> Refusal | None:
    """For the start of a head not yet whole: its refusal when it can no longer be accepted, else None.

    Past ``max_head_bytes`` without an end it is 431 at once, however many
    reads brought it; a bare LF (a head a lenient parser would end at
    ``\\n\\n``) is 400 at once rather than waited on.
    """
    if len(data) > max_head_bytes:
        return _TOO_LARGE
    return _BARE if _has_bare_cr_or_lf(data[:-1] if data.endswith(b"\r") else data) else None


def _has_bare_cr_or_lf(data: bytes | bytearray) -> bool:
    crlf = data.count(b"\r\n")
    return data.count(b"\n") != crlf or data.count(b"\r") != crlf


def accept_head(head: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> RequestHead | Refusal:
    """Read ``head`` (the bytes :func:`find_head_end` measured) as a request head, or refuse it."""
    size = len(head)
    if size > max_head_bytes:
        return _TOO_LARGE
    if not head.endswith(b"\r\n\r\n"):
        return _NOT_A_HEAD
    first = head.find(b"\r\n")
    line = _REQUEST_LINE.fullmatch(head, 0, first)
    if line is None:
        return _BARE if _has_bare_cr_or_lf(head) else _BAD_REQUEST_LINE
    if _FIELDS.fullmatch(head, first + 2) is None:
        return _malformed_fields(head[first + 2 :])
    method, target, major, minor = line.groups()
    if major != b"1" or minor not in (b"0", b"1"):
        return _VERSION
    http_version = b"1." + minor
    path = _routed(method, target)
    if path is None:
        return _BAD_TARGET
    fields = _Fields()
    refusal = fields.read(head[first + 2 : -4].split(b"\r\n") if size > first + 4 else [])
    if refusal is not None:
        return refusal
    if fields.hosts > 1 or (fields.hosts == 0 and http_version == b"1.1"):
        return _BAD_HOST
    length = fields.length(http_version)
    if type(length) is Refusal:
        return length
    assert type(length) is int
    keep_alive = http_version == b"1.1" and b"close" not in fields.connection
    return RequestHead(
        method, target, path, http_version, fields.headers, length, keep_alive, fields.expect_continue, size
    )


@final
class _Fields:
    """The field lines of one head, and what the framing decision needs of them."""

    __slots__ = ("headers", "lengths", "codings", "connection", "hosts", "expect_continue")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.lengths: set[bytes] = set()
        self.codings: list[bytes] = []
        self.connection: list[bytes] = []
        self.hosts = 0
        self.expect_continue = False

    def read(self, lines: list[bytes]) -> Refusal | None:
        """Read the field lines (each a token, a colon and a value: :data:`_FIELDS`); a refusal, or None."""
        for raw in lines:
            name, _, value = raw.partition(b":")
            name = name.lower()
            value = value.strip(b" \t")
            self.headers.append((name, value))
            if name == b"content-length":
                if _DIGITS.fullmatch(value) is None:
                    return _BAD_LENGTH
                self.lengths.add(value)  # several must be the same bytes: "4" and "04" are refused, as h11 does
            elif name == b"transfer-encoding":
                self.codings.extend(c.strip(b" \t").lower() for c in value.split(b","))
            elif name == b"host":
                self.hosts += 1
                if _HOST.fullmatch(value) is None:
                    return _BAD_HOST
            elif name == b"connection":
                self.connection.extend(c.strip(b" \t").lower() for c in value.split(b","))
            elif name == b"expect":
                self.expect_continue = value.lower() == b"100-continue"
        return None

    def length(self, http_version: bytes) -> int | Refusal:
        """The body's framing (RFC 9112 6.3, strictly): its length, :data:`CHUNKED`, or a refusal."""
        if self.codings:
            if self.lengths:
                return _LENGTH_AND_CODING
            if http_version == b"1.0":
                return _CODING_IN_1_0
            return CHUNKED if self.codings == [b"chunked"] else _CODING
        if len(self.lengths) > 1:
            return _LENGTHS_DIFFER
        return int(self.lengths.pop()) if self.lengths else 0


def _malformed_fields(fields: bytes) -> Refusal:
    """Why the field lines of a head (from the line after the request line) are not well formed."""
    if _has_bare_cr_or_lf(fields):
        return _BARE
    for raw in fields.split(b"\r\n"):
        if raw[:1] in (b" ", b"\t"):
            return _OBS_FOLD
    return _BAD_FIELD


def _routed(method: bytes, target: bytes) -> bytes | None:
    """The origin form ``target`` is routed by, or None when it is no target this server takes."""
    if target[:1] == b"/":
        return target
    if target == b"*":
        return target if method == b"OPTIONS" else None
    absolute = _ABSOLUTE.fullmatch(target)
    if absolute is None or method == b"CONNECT":
        return None
    authority, rest = absolute.groups()
    if not authority or _AUTHORITY.fullmatch(authority) is None or b"@" in authority:
        return None
    if rest[:1] == b"/":
        return rest
    return b"/" + rest if rest[:1] == b"?" or not rest else None


_TOO_LARGE: Final = Refusal(431, "request head too large")
_NOT_A_HEAD: Final = Refusal(400, "request head not terminated by an empty line")
_BARE: Final = Refusal(400, "bare CR or LF in the request head")
_BAD_REQUEST_LINE: Final = Refusal(400, "malformed request line")
_VERSION: Final = Refusal(505, "HTTP version not supported")
_BAD_TARGET: Final = Refusal(400, "request target is not a path")
_OBS_FOLD: Final = Refusal(400, "folded header line (obs-fold)")
_BAD_FIELD: Final = Refusal(400, "malformed header field")
_BAD_LENGTH: Final = Refusal(400, "content-length is not a number")
_LENGTHS_DIFFER: Final = Refusal(400, "several differing content-length values")
_BAD_HOST: Final = Refusal(400, "missing, repeated or malformed host")
_LENGTH_AND_CODING: Final = Refusal(400, "both content-length and transfer-encoding")
_CODING_IN_1_0: Final = Refusal(400, "transfer-encoding in an HTTP/1.0 request")
_CODING: Final = Refusal(501, "transfer-encoding other than chunked")
