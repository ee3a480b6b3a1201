"""Reading requests (RFC 9112): llhttp frames them, the project's rules decide which it serves.

One :class:`RequestReader` per connection, fed every byte the client sends,
once. Parsing is a library's (llhttp through ``httptools``, as uvicorn reads
requests); this module adds, in one place (:meth:`RequestReader.on_headers_complete`),
the rules where llhttp is more permissive than a gateway facing the internet
should be, and maps llhttp's errors onto fixed refusals. Each rule is listed
with its RFC section in ``docs/security.md``.

llhttp refuses on its own: ``Content-Length`` beside ``Transfer-Encoding``,
obs-fold, a bare CR or LF, a duplicate ``Content-Length`` (even an equal one),
whitespace before a field's colon, control characters, an unknown method, a
version that is not ``HTTP/x.y``, ``Transfer-Encoding`` whose last coding is
not ``chunked`` (501 here), and malformed chunk framing (a size with ``0x``, a
sign or past 2**64, data longer than its size). Ours, at headers-complete:

- the target is a path (origin form), ``*`` for ``OPTIONS``, or an
  ``http``/``https`` URL (absolute form, routed by its path and query); anything else 400;
- the request line is exactly ``method SP target SP HTTP/x.y`` (llhttp also takes ``RTSP/1.0``
  and several spaces: 400), the version 1.0 or 1.1 (else 505);
- HTTP/1.1 requests carry exactly one ``Host``, HTTP/1.0 at most one, well formed (400);
- ``Content-Length`` has at most 18 digits (400);
- ``Transfer-Encoding`` other than a single ``chunked`` is 501, in HTTP/1.0 400;
- a protocol upgrade (``Upgrade`` with ``connection: upgrade``) with a body is 400; without one
  it is answered as a plain request, and the connection closes after it;
- a head longer than the limit is 431, whatever the reads it came in;
- a chunked body whose chunk extensions and trailer fields pass
  ``max_chunk_extension_bytes`` in all is 400 (RFC 9112 §7.1.1; measured as in
  :mod:`iop_http.chunks`, checked after each piece fed).

Where a message ends is found without parsing ahead: a head ends at the first
CRLF CRLF (a byte search; llhttp then reads exactly those bytes), a
``Content-Length`` body after that many bytes, and a chunked body, which
always ends with CRLF CRLF, is fed to llhttp in pieces cut after each CRLF
CRLF, so the piece in which llhttp completes the message ends where the
message ends. llhttp thus never reads a byte of the next request before the
reader is asked for it, and the bytes a request consumed are exact.

Every refusal ends the reading: the connection closes after the answer. A
refusal's text is fixed: it never carries the request's bytes
(:mod:`iop_http.refusals` holds them, and the mapping of llhttp's errors).
"""

from __future__ import annotations

from collections import deque
from typing import Final, final

import httptools

from .chunks import MAX_CHUNK_EXTENSION_BYTES, extension_bytes
from .refusals import (
    AUTHORITY,
    BAD_HOST,
    BAD_LENGTH,
    BAD_REQUEST_LINE,
    BAD_TARGET,
    CHUNK_EXTENSIONS_TOO_LONG,
    CODING,
    CODING_IN_1_0,
    MALFORMED_HEAD,
    MAX_LENGTH_DIGITS,
    NOT_A_HEAD,
    TOO_LARGE,
    UPGRADE_WITH_BODY,
    VERSION,
    Refusal,
    refusal_for,
    routed,
)

MAX_HEAD_BYTES: Final = 64 * 1024
"""The default bound of a request head, its final empty line included."""

CHUNKED: Final = -1
""":attr:`RequestHead.length` of a body in the chunked transfer coding."""

_HEAD_END: Final = b"\r\n\r\n"


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
class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA: Final = _Marker("NEED_DATA")
""":meth:`RequestReader.next_event`: nothing more until more bytes arrive."""
END_OF_MESSAGE: Final = _Marker("END_OF_MESSAGE")
""":meth:`RequestReader.next_event`: the request's body ended (its last bytes came before)."""
CLOSED: Final = _Marker("CLOSED")
""":meth:`RequestReader.next_event`: no further request: the client ended its side (between requests or
mid-request), the request before did not keep the connection, or a refusal was given."""

Event = RequestHead | Refusal | bytes | _Marker
"""What :meth:`RequestReader.next_event` returns; ``bytes`` are body bytes."""

_HEAD, _LENGTH, _CHUNKED, _DONE = range(4)


class _Refused(Exception):
    """Raised in a parser callback to stop llhttp with our refusal."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


@final
class RequestReader:
    """The requests of one connection, from the bytes its client sends (sans-I/O, one llhttp parser).

    :meth:`feed` the bytes as they arrive (``b""`` when the client ends its
    side); :meth:`next_event` returns, in order, each request's
    :class:`RequestHead` (or its :class:`Refusal`), its body bytes, then
    :data:`END_OF_MESSAGE`; :data:`NEED_DATA` when it needs more bytes, and
    :data:`CLOSED` when no further request can come. Bytes are framed only as
    far as events are asked for: the rest waits (:attr:`buffered`).
    """

    __slots__ = (
        "_parser",
        "_max_head",
        "_pending",
        "_events",
        "_state",
        "_eof",
        "_left",
        "_tail",
        "_complete",
        "_in_head",
        "_url",
        "_headers",
        "_lengths",
        "_codings",
        "_hosts",
        "_connection",
        "_expect",
        "_upgrade",
        "_size",
        "_keep_alive",
        "_fed",
        "_line",
        "_max_extension",
        "_chunked",
    )

    def __init__(
        self, max_head_bytes: int = MAX_HEAD_BYTES, max_chunk_extension_bytes: int = MAX_CHUNK_EXTENSION_BYTES
    ) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._max_head = max_head_bytes
        self._max_extension = max_chunk_extension_bytes
        self._chunked = [0, 0, 0]  # a chunked body's bytes fed, data bytes, chunks begun
        self._pending = bytearray()  # received, not fed to llhttp yet
        self._events: deque[Event] = deque()
        self._state = _HEAD
        self._eof = False
        self._left = 0  # the bytes of a content-length body not fed yet
        self._tail = b""  # the last bytes of a chunked body fed (a CRLF CRLF may straddle two reads)
        self._complete = False  # llhttp completed the message in the bytes just fed
        self._keep_alive = True
        self._fed = 0  # the bytes of a head not whole yet already fed to llhttp (its errors come early)
        self._line = b""  # the request line of the head being read
        self._size = 0  # the length of the head being read
        self._reset()

    def __repr__(self) -> str:
        return f"<RequestReader state {self._state}, {len(self._pending)} bytes buffered>"

    def _reset(self) -> None:
        self._in_head = True
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._lengths: list[bytes] = []
        self._codings: list[bytes] = []
        self._hosts: list[bytes] = []
        self._connection: list[bytes] = []
        self._expect = False
        self._upgrade = False

    @property
    def buffered(self) -> int:
        """Bytes received and not framed yet (a pipelined next request, say)."""
        return len(self._pending)

    @property
    def at_rest(self) -> bool:
        """Between requests with nothing buffered and the client's side open: a fresh start."""
        return self._state == _HEAD and not self._pending and not self._events and not self._eof

    def feed(self, data: bytes) -> None:
        """Take the client's next bytes (``b""``: the client ended its side)."""
        if data:
            self._pending += data
        else:
            self._eof = True

    def next_event(self) -> Event:
        """The next event of the request stream (see the class)."""
        events = self._events
        while not events:
            if not self._advance():
                return CLOSED if self._state == _DONE or (self._eof and not self._pending) else NEED_DATA
        return events.popleft()

    # ----------------------------------------------------------------- framing

    def _advance(self) -> bool:
        """Frame what the buffered bytes allow; False when nothing could be (more bytes, or nothing more)."""
        state = self._state
        if state == _HEAD:
            return self._read_head()
        if state == _DONE:
            return False
        pending = self._pending
        if not pending:
            if self._eof:
                self._state = _DONE  # the client left mid-body
            return False
        if state == _LENGTH:
            take = min(self._left, len(pending))
            self._left -= take
            piece = bytes(pending[:take])
            del pending[:take]
            self._execute(piece)
            return True
        return self._read_chunks()

    def _read_head(self) -> bool:
        pending = self._pending
        if not pending:
            if self._eof:
                self._state = _DONE
            return False
        if pending[0] in b"\r\n":  # llhttp would skip empty lines; the head's length would not be the bytes'
            self._refuse(BAD_REQUEST_LINE)
            return True
        end = pending.find(_HEAD_END)
        if end < 0:
            if len(pending) > self._max_head:
                self._refuse(TOO_LARGE)
                return True
            if self._eof:
                self._state = _DONE  # the client left mid-head
                return False
            fed = self._fed
            if fed >= len(pending) - 1:
                return False
            self._fed = len(pending) - 1  # the last byte may be the CR of the end: wait for it
            self._execute(bytes(pending[fed : self._fed]))
            return self._state == _DONE
        end += 4
        if end > self._max_head:
            self._refuse(TOO_LARGE)
            return True
        head = bytes(pending[self._fed : end])
        first = bytes(pending[:4])
        line_end = pending.find(b"\r\n")
        self._line = bytes(pending[:line_end])
        del pending[:end]
        self._fed = 0
        self._size = end
        self._in_head = True
        self._execute(head)
        if self._in_head and self._state == _HEAD:  # llhttp wants more than a head: HTTP/2's preface
            self._refuse(VERSION if first == b"PRI " else MALFORMED_HEAD)
        return True

    def _read_chunks(self) -> bool:
        """Feed a chunked body in pieces cut after each CRLF CRLF: the message can only end at such a cut."""
        pending = self._pending
        data = bytes(pending)
        tail = self._tail
        joined = tail + data
        start = 0
        at = joined.find(_HEAD_END)
        while at >= 0:
            cut = at + 4 - len(tail)
            if cut > start:
                self._execute_chunks(data[start:cut])
                start = cut
                if self._complete or self._state != _CHUNKED:
                    del pending[:start]
                    return True
            at = joined.find(_HEAD_END, at + 1)
        if start < len(data):
            self._execute_chunks(data[start:])
        self._tail = joined[-3:]
        pending.clear()
        return True

    def _execute_chunks(self, data: bytes) -> None:
        """Feed a piece of a chunked body; refuse it once its extensions and trailers pass their bound,
        also when this piece ended the body: the bound does not depend on how the bytes were read."""
        counts = self._chunked
        counts[0] += len(data)
        self._execute(data)
        if extension_bytes(*counts) <= self._max_extension:
            return
        if self._complete and self._events and self._events[-1] is END_OF_MESSAGE:
            self._events.pop()  # the body ended in this piece: refused all the same
        elif self._state != _CHUNKED:
            return  # refused already
        self._refuse(CHUNK_EXTENSIONS_TOO_LONG)

    def _execute(self, data: bytes) -> None:
        """Feed ``data`` to llhttp; its callbacks queue the events."""
        self._complete = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if not self._complete:  # never: llhttp pauses on an upgrade once the message is complete
                self._refuse(UPGRADE_WITH_BODY)
            else:
                self._state = _DONE
        except httptools.HttpParserError as error:
            refused = error.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused.refusal)
            else:
                self._refuse(refusal_for(str(error), self._in_head))

    def _refuse(self, refusal: Refusal) -> None:
        self._fed = 0
        self._events.append(refusal)
        self._state = _DONE
        self._pending.clear()

    # -------------------------------------------------- llhttp's callbacks

    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer field: llhttp checked its syntax; the body's end is all it decides
        name = name.lower()
        value = value.strip(b" \t")
        self._headers.append((name, value))
        if name == b"content-length":
            self._lengths.append(value)
        elif name == b"transfer-encoding":
            self._codings.extend(c.strip(b" \t").lower() for c in value.split(b","))
        elif name == b"host":
            self._hosts.append(value)
        elif name == b"connection":
            self._connection.extend(c.strip(b" \t").lower() for c in value.split(b","))
        elif name == b"expect":
            self._expect = value.lower() == b"100-continue"
        elif name == b"upgrade":
            self._upgrade = True

    def on_headers_complete(self) -> None:
        """The project's rules on a head llhttp read; raises :class:`_Refused` to refuse it."""
        self._in_head = False
        parser = self._parser
        method = parser.get_method()
        line = self._line
        if line[-9:-3] != b" HTTP/":
            raise _Refused(BAD_REQUEST_LINE)  # RTSP/1.0, say: llhttp reads it as HTTP
        version = parser.get_http_version().encode("ascii")
        if version not in (b"1.1", b"1.0"):
            raise _Refused(VERSION)
        target = self._url
        if line != b"%b %b HTTP/%b" % (method, target, version):
            raise _Refused(BAD_REQUEST_LINE)  # not method SP target SP version: llhttp takes "GET  /"
        path = routed(method, target)
        if path is None:
            raise _Refused(BAD_TARGET)
        hosts = self._hosts
        if len(hosts) > 1 or (not hosts and version == b"1.1"):
            raise _Refused(BAD_HOST)
        if hosts and AUTHORITY.fullmatch(hosts[0]) is None:
            raise _Refused(BAD_HOST)
        length = self._length(version)
        upgrade = self._upgrade and b"upgrade" in self._connection
        if upgrade and length:
            raise _Refused(UPGRADE_WITH_BODY)
        keep_alive = version == b"1.1" and b"close" not in self._connection and not upgrade
        self._keep_alive = keep_alive
        head = RequestHead(method, target, path, version, self._headers, length, keep_alive, self._expect, self._size)
        self._events.append(head)
        if length == CHUNKED:
            self._state = _CHUNKED
            self._tail = b""
            self._chunked = [0, 0, 0]
        elif length:
            self._state = _LENGTH
            self._left = length

    def _length(self, version: bytes) -> int:
        """The body's framing (RFC 9112 6.3, strictly): its length or :data:`CHUNKED`; raises to refuse."""
        if self._codings:
            if version == b"1.0":
                raise _Refused(CODING_IN_1_0)
            if self._codings != [b"chunked"]:
                raise _Refused(CODING)
            return CHUNKED
        if self._lengths:
            value = self._lengths[0]
            if len(value) > MAX_LENGTH_DIGITS:
                raise _Refused(BAD_LENGTH)
            return int(value)
        return 0

    def on_body(self, body: bytes) -> None:
        self._events.append(body)
        self._chunked[1] += len(body)

    def on_chunk_header(self) -> None:
        self._chunked[2] += 1

    def on_message_complete(self) -> None:
        self._complete = True
        self._events.append(END_OF_MESSAGE)
        self._state = _HEAD if self._keep_alive else _DONE


def find_head_end(data: bytes | bytearray) -> int:
    """The length of the request head at the start of ``data`` (through its empty line), or -1 if not whole."""
    end = data.find(_HEAD_END)
    return end + 4 if end >= 0 else -1


def accept_head(head: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> RequestHead | Refusal:
    """The reference verdict on ``head`` (the bytes :func:`find_head_end` measured): the accepted
    head, or its refusal. The same :class:`RequestReader` the listener reads requests with."""
    if not head.endswith(_HEAD_END) or find_head_end(head) != len(head):
        return NOT_A_HEAD if len(head) <= max_head_bytes else TOO_LARGE
    reader = RequestReader(max_head_bytes)
    reader.feed(head)
    event = reader.next_event()
    assert isinstance(event, RequestHead | Refusal), event
    return event
