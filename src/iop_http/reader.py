"""Reading requests (RFC 9112): llhttp frames them, the project's rules decide which it serves.

One :class:`RequestReader` per connection, fed every byte the client sends,
once. Parsing is a library's (llhttp through ``httptools``, as uvicorn reads
requests); this module adds, in one place (at headers-complete: :mod:`iop_http.head`),
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
from .head import CHUNKED, HeadFields, Refused, RequestHead
from .refusals import (
    BAD_REQUEST_LINE,
    CHUNK_EXTENSIONS_TOO_LONG,
    MALFORMED_HEAD,
    NOT_A_HEAD,
    TOO_LARGE,
    UPGRADE_WITH_BODY,
    VERSION,
    Refusal,
    refusal_for,
)

MAX_HEAD_BYTES: Final = 64 * 1024
"""The default bound of a request head, its final empty line included."""

_HEAD_END: Final = b"\r\n\r\n"


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
        "_head",
        "_keep_alive",
        "_fed",
        "_max_extension",
        "_chunked",
    )

    def __init__(
        self, max_head_bytes: int = MAX_HEAD_BYTES, max_chunk_extension_bytes: int = MAX_CHUNK_EXTENSION_BYTES
    ) -> None:
        self._head = head = HeadFields()
        self._parser = httptools.HttpRequestParser(_Callbacks(head, self))
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

    def __repr__(self) -> str:
        return f"<RequestReader state {self._state}, {len(self._pending)} bytes buffered>"

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
        fields = self._head
        fields.line = bytes(pending[: pending.find(b"\r\n")])
        del pending[:end]
        self._fed = 0
        fields.size = end
        fields.in_head = True
        self._execute(head)
        if fields.in_head and self._state == _HEAD:  # llhttp wants more than a head: HTTP/2's preface
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
            if isinstance(refused, Refused):
                self._refuse(refused.refusal)
            else:
                self._refuse(refusal_for(str(error), self._head.in_head))

    def _refuse(self, refusal: Refusal) -> None:
        self._fed = 0
        self._events.append(refusal)
        self._state = _DONE
        self._pending.clear()

    # -------------------------------------------------- llhttp's callbacks

    def on_headers_complete(self) -> None:
        """Take the head llhttp read, if :meth:`HeadFields.accept` does; frame its body."""
        parser = self._parser
        head = self._head.accept(parser.get_method(), parser.get_http_version())
        self._keep_alive = head.keep_alive
        self._events.append(head)
        length = head.length
        if length == CHUNKED:
            self._state = _CHUNKED
            self._tail = b""
            self._chunked = [0, 0, 0]
        elif length:
            self._state = _LENGTH
            self._left = length

    def on_body(self, body: bytes) -> None:
        self._events.append(body)
        self._chunked[1] += len(body)

    def on_chunk_header(self) -> None:
        self._chunked[2] += 1

    def on_message_complete(self) -> None:
        self._complete = True
        self._events.append(END_OF_MESSAGE)
        self._state = _HEAD if self._keep_alive else _DONE


@final
class _Callbacks:
    """llhttp's callbacks, each to the object it concerns: the head's fields, or the reader's framing."""

    __slots__ = (
        "on_message_begin",
        "on_url",
        "on_header",
        "on_headers_complete",
        "on_body",
        "on_chunk_header",
        "on_message_complete",
    )

    def __init__(self, head: HeadFields, reader: RequestReader) -> None:
        self.on_message_begin = head.reset
        self.on_url = head.on_url
        self.on_header = head.on_header
        self.on_headers_complete = reader.on_headers_complete
        self.on_body = reader.on_body
        self.on_chunk_header = reader.on_chunk_header
        self.on_message_complete = reader.on_message_complete


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
