"""A request head as llhttp reads it, and the project's rules on it at headers-complete.

:class:`HeadFields` gathers the fields of the head being read from llhttp's callbacks
and, once the head is whole, :meth:`HeadFields.accept` applies the rules where llhttp is
more permissive than a gateway facing the internet should be (listed in
:mod:`iop_http.reader` and, with their RFC sections, in ``docs/security.md``): the
accepted :class:`RequestHead`, its framing decided, or :class:`Refused`.
"""

from __future__ import annotations

from typing import Final, final

from .refusals import (
    AUTHORITY,
    BAD_HOST,
    BAD_LENGTH,
    BAD_REQUEST_LINE,
    BAD_TARGET,
    CODING,
    CODING_IN_1_0,
    MAX_LENGTH_DIGITS,
    UPGRADE_WITH_BODY,
    VERSION,
    Refusal,
    routed,
)

CHUNKED: Final = -1
""":attr:`RequestHead.length` of a body in the chunked transfer coding."""


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


class Refused(Exception):
    """Raised in a parser callback to stop llhttp with our refusal."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


@final
class HeadFields:
    """The head being read: its fields, gathered from llhttp's callbacks, and the rules on them.

    The reader sets :attr:`line` and :attr:`size` when it has the whole head (before llhttp
    reads it); :attr:`in_head` is True from the message's start until its head is complete
    (then a field is a trailer's, and an error of llhttp's is a body's).
    """

    __slots__ = (
        "in_head",
        "line",
        "size",
        "url",
        "headers",
        "lengths",
        "codings",
        "hosts",
        "connection",
        "expect",
        "upgrade",
    )

    def __init__(self) -> None:
        self.line = b""  # the request line of the head being read
        self.size = 0  # the length of the head being read
        self.reset()

    def reset(self) -> None:
        """A new message begins (llhttp's ``on_message_begin``)."""
        self.in_head = True
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.lengths: list[bytes] = []
        self.codings: list[bytes] = []
        self.hosts: list[bytes] = []
        self.connection: list[bytes] = []
        self.expect = False
        self.upgrade = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:
            return  # a trailer field: llhttp checked its syntax; the body's end is all it decides
        name = name.lower()
        value = value.strip(b" \t")
        self.headers.append((name, value))
        if name == b"content-length":
            self.lengths.append(value)
        elif name == b"transfer-encoding":
            self.codings.extend(c.strip(b" \t").lower() for c in value.split(b","))
        elif name == b"host":
            self.hosts.append(value)
        elif name == b"connection":
            self.connection.extend(c.strip(b" \t").lower() for c in value.split(b","))
        elif name == b"expect":
            self.expect = value.lower() == b"100-continue"
        elif name == b"upgrade":
            self.upgrade = True

    def accept(self, method: bytes, http_version: str) -> RequestHead:
        """The project's rules on the head llhttp read (``method``, ``http_version`` as it read them).

        Raises:
            Refused: the head breaks a rule.
        """
        self.in_head = False
        line = self.line
        if line[-9:-3] != b" HTTP/":
            raise Refused(BAD_REQUEST_LINE)  # RTSP/1.0, say: llhttp reads it as HTTP
        version = http_version.encode("ascii")
        if version not in (b"1.1", b"1.0"):
            raise Refused(VERSION)
        target = self.url
        if line != b"%b %b HTTP/%b" % (method, target, version):
            raise Refused(BAD_REQUEST_LINE)  # not method SP target SP version: llhttp takes "GET  /"
        path = routed(method, target)
        if path is None:
            raise Refused(BAD_TARGET)
        hosts = self.hosts
        if len(hosts) > 1 or (not hosts and version == b"1.1"):
            raise Refused(BAD_HOST)
        if hosts and AUTHORITY.fullmatch(hosts[0]) is None:
            raise Refused(BAD_HOST)
        length = self._length(version)
        upgrade = self.upgrade and b"upgrade" in self.connection
        if upgrade and length:
            raise Refused(UPGRADE_WITH_BODY)
        keep_alive = version == b"1.1" and b"close" not in self.connection and not upgrade
        return RequestHead(method, target, path, version, self.headers, length, keep_alive, self.expect, self.size)

    def _length(self, version: bytes) -> int:
        """The body's framing (RFC 9112 6.3, strictly): its length or :data:`CHUNKED`; raises to refuse."""
        if self.codings:
            if version == b"1.0":
                raise Refused(CODING_IN_1_0)
            if self.codings != [b"chunked"]:
                raise Refused(CODING)
            return CHUNKED
        if self.lengths:
            value = self.lengths[0]
            if len(value) > MAX_LENGTH_DIGITS:
                raise Refused(BAD_LENGTH)
            return int(value)
        return 0
