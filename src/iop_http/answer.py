"""An HTTP/1.1 answer parsed by httptools (llhttp, in C): :class:`AnswerParser`.

Why llhttp and not h11 for answers: a streamed answer is a chunked body of
many small chunks, and h11 parses each with two ``next_event`` calls, each a
pass through its state machine in Python; llhttp parses the same bytes in C
and calls back once per piece of body. Requests are still written by h11.

What this adds to llhttp's callbacks (httptools exposes no "end of input"):

- The end of a body delimited by the connection closing (neither
  ``content-length`` nor chunked ``transfer-encoding``, not a 204/304): llhttp
  waits for more; :meth:`AnswerParser.feed_eof` completes it there (the
  connection is then not reused). A framed body cut short by EOF is an error.
- Informational answers (1xx) are skipped; the next answer is the real one.
- An answer to HEAD has no body: it completes with its head (and the connection
  is closed rather than reused, which needs no body-length bookkeeping).
- Bytes after the end of the answer (unasked data) make the connection unusable,
  and so does a 204 that frames a body (``content-length`` or
  ``transfer-encoding``): a server that sends one may send the body after it.
- Bounds on what the server sends (:class:`AnswerLimits`): the head
  (informational answers before it included), the number of informational
  answers, the chunk extensions and trailer fields of a chunked body
  (:mod:`.chunks`; here each piece of data llhttp hands on, at least one per
  chunk, counts as a chunk: no callback per chunk on a stream's path), and, for
  an answer read whole, the body. Each is checked as the bytes arrive, so a
  server that sends without end is refused after one read past the bound.

Every failure is an :class:`AnswerError`; its :attr:`~AnswerError.kind` says
which (bad HTTP, a bound passed, a head or whole body too large), so a client
maps it to its own errors in one place.
"""

from __future__ import annotations

import sys
from typing import Final, Literal, Protocol, final

import attrs
import httptools

from .chunks import CHUNK_FRAMING_BYTES

_NO_BODY_STATUSES = frozenset({204, 304})
_LINE_BYTES = 4  # the CRLF and the ": " (or the status line's spaces) a head spends on each field beside its text

AnswerErrorKind = Literal["invalid", "over_bound", "too_large"]


class AnswerError(Exception):
    """The answer is not valid HTTP/1.1, was cut short, or went past one of the parser's bounds.

    Attributes:
        kind: ``invalid`` (bad HTTP, or the connection closed in the middle of
            the answer), ``over_bound`` (too many informational answers, or too
            many bytes of chunk extensions and trailers) or ``too_large`` (the
            head, or the body of an answer read whole, past its bound).
    """

    def __init__(self, message: str, kind: AnswerErrorKind = "invalid") -> None:
        super().__init__(message)
        self.kind: AnswerErrorKind = kind


class AnswerLimits(Protocol):
    """The bounds an :class:`AnswerParser` checks (``iop_node.config.UpstreamLimits`` is one)."""

    @property
    def head_bytes(self) -> int: ...

    @property
    def answer_bytes(self) -> int: ...

    @property
    def chunk_extension_bytes(self) -> int: ...

    @property
    def informational_answers(self) -> int: ...


@final
@attrs.frozen
class NoLimits:
    """:class:`AnswerLimits` that bound nothing (a client that trusts its server: a benchmark's)."""

    head_bytes: int = sys.maxsize
    answer_bytes: int = sys.maxsize
    chunk_extension_bytes: int = sys.maxsize
    informational_answers: int = sys.maxsize


NO_LIMITS: Final = NoLimits()


@final
class AnswerParser:
    """One answer being parsed (the llhttp callbacks and what they found).

    Attributes:
        status: the final answer's status (0 until its head is parsed).
        reason: its reason phrase.
        headers: its headers, as sent.
        head_done: the final answer's head is parsed.
        complete: the answer's body ended.
    """

    __slots__ = (
        "_parser",
        "_head_only",
        "_informational",
        "_needs_eof",
        "_keep_alive",
        "_unasked",
        "_parts",
        "_limits",
        "_body_left",
        "_head_read",
        "_head_size",
        "_slack",
        "_informational_count",
        "status",
        "reason",
        "headers",
        "head_done",
        "complete",
    )

    def __init__(self, *, head_only: bool = False, limits: AnswerLimits = NO_LIMITS, whole: bool = False) -> None:
        """``head_only``: the answer to a ``HEAD`` (no body); ``limits``: the bounds checked;
        ``whole``: the body is read whole (bounded by ``limits.answer_bytes``)."""
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._head_only = head_only
        self._limits = limits
        self._body_left = limits.answer_bytes if whole else sys.maxsize
        self._head_read = 0  # bytes read while the head (1xx answers included) was not whole
        self._head_size = 0  # bytes of the heads parsed (their text, and _LINE_BYTES per line)
        self._slack = limits.chunk_extension_bytes
        """Bytes of the body read so far that may still be framing beyond the plain framing of its chunks:
        each read takes its length, each piece of data gives its length and CHUNK_FRAMING_BYTES back."""
        self._informational_count = 0
        self._informational = False
        self._needs_eof = False
        self._keep_alive = False
        self._unasked = False
        self._parts: list[bytes] = []
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False

    @property
    def reusable(self) -> bool:
        """Complete, and the connection may carry another request."""
        return self.complete and self._keep_alive and not self._unasked

    def feed(self, data: bytes) -> None:
        """Parse ``data`` (not empty: use :meth:`feed_eof` at the end of input).

        Raises:
            AnswerError: the answer is not valid HTTP/1.1, or went past one of ``limits``.
        """
        if self.complete:  # unasked data after the answer
            self._unasked = self._unasked or bool(data)
            return
        parser = self._parser
        assert parser is not None  # dropped only at the end of the answer
        in_head = not self.head_done
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise AnswerError("the server switched protocols") from None
        except httptools.HttpParserError as exc:
            bound = exc.__context__
            if isinstance(bound, AnswerError):  # raised by a callback below
                raise bound from None
            if not self.complete:
                raise AnswerError(f"bad answer: {exc}") from None
            self._unasked = True  # whatever follows the answer is not ours to parse
        if self.complete:
            return
        if in_head:
            self._count_head(len(data))
            return
        self._slack -= len(data)
        if self._slack < 0:
            limit = self._limits.chunk_extension_bytes
            raise AnswerError(f"the answer's chunk extensions and trailers exceed {limit} bytes", "over_bound")

    def _count_head(self, size: int) -> None:
        """Count a read of ``size`` bytes that began in the head."""
        if self.head_done:  # the head ended in this read: the body's framing is counted from the next one
            self._slack = self._limits.chunk_extension_bytes
            return
        self._head_read += size
        if self._head_read > self._limits.head_bytes:
            raise AnswerError(f"the answer's head exceeds {self._limits.head_bytes} bytes", "too_large")

    def feed_eof(self) -> None:
        """The connection closed: complete a body that runs to the close, else fail.

        Raises:
            AnswerError: the answer (head or framed body) was cut short.
        """
        if self.complete:
            return
        if not self.head_done:
            raise AnswerError("the server closed the connection without answering")
        if not self._needs_eof:
            raise AnswerError("the server closed the connection in the middle of the answer's body")
        self.complete = True
        self._keep_alive = False

    def take(self) -> bytes | None:
        """Every body byte parsed since the last call, or None if there is none."""
        parts = self._parts
        if not parts:
            return None
        chunk = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return chunk

    # llhttp's callbacks (httptools calls them by name).

    def on_message_begin(self) -> None:
        if self.complete:
            self._unasked = True

    def on_status(self, reason: bytes) -> None:
        if not self.head_done:
            self.reason += reason
            self._grow_head(len(reason) + 16)  # "HTTP/1.1 200 " and the CRLF

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:
            self.headers.append((name, value))
            self._grow_head(len(name) + len(value) + _LINE_BYTES)

    def _grow_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > self._limits.head_bytes:
            raise AnswerError(f"the answer's head exceeds {self._limits.head_bytes} bytes", "too_large")

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        parser = self._parser
        assert parser is not None  # a callback: the parser is parsing
        status = parser.get_status_code()
        if status < 200:  # informational: the real answer follows
            self._informational = True
            self._informational_count += 1
            if self._informational_count > self._limits.informational_answers:
                limit = self._limits.informational_answers
                raise AnswerError(f"the server sent over {limit} informational (1xx) answers", "over_bound")
            self.reason = b""
            self.headers = []
            return
        self.status = status
        self.head_done = True
        framed = any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self.headers)
        self._needs_eof = not framed and status not in _NO_BODY_STATUSES
        if framed and status == 204:  # a body framed for a status that has none (RFC 9110 8.6, RFC 9112 6.1):
            self._unasked = True  # the bytes that follow may be that body: the connection is not reused
        if self._head_only:
            self.complete = True  # _keep_alive stays False: the connection is closed

    def on_body(self, body: bytes) -> None:
        if self.complete:
            self._unasked = True
            return
        self._parts.append(body)
        size = len(body)
        self._slack += size + CHUNK_FRAMING_BYTES
        self._body_left -= size
        if self._body_left < 0:
            raise AnswerError(f"the answer exceeds {self._limits.answer_bytes} bytes", "too_large")

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
        elif not self.complete:
            self.complete = True
            parser = self._parser
            assert parser is not None
            self._keep_alive = parser.should_keep_alive()
            # llhttp's parser holds this object (its callbacks) and this object holds the
            # parser: a reference cycle per answer, left for the cyclic garbage collector.
            # Nothing parses after the end (``feed`` only notes unasked data), so the cycle ends here.
            self._parser = None
