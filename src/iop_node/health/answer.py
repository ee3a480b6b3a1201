"""The answers on one probe connection, parsed by llhttp: :class:`ProbeAnswers`.

Why not :class:`iop_http.AnswerParser`, the Node's parser of run answers: that
one is made per answer and keeps and bounds every field of the head, a Python
callback per field; a probe needs of its answer only the status, the body, and
whether the connection can carry the next probe. Here one llhttp parser
(httptools) serves the connection's life, answer after answer, with a callback
at the head's end, one per piece of body and one at the answer's end: the
probe loop's largest cost after the system calls was the parse.

What a probe's answer needs beyond llhttp's callbacks:

- Informational answers (1xx) are skipped; the next answer is the real one.
- The head's fields are not kept, so a head needs no bound of its own (the
  probe's timeout bounds the time a server may spend sending one); the body is
  bounded by the prober (:data:`~iop_node.health.prober.ANSWER_BYTES`).
- An answer the close ends (no framing, or framed and cut short: llhttp does
  not say which) gives its status, and its body only when it is not a success
  (:meth:`ProbeAnswers.closed`): a failure's text is the reason shown, while a
  success's body is what capacity is read from, and a ``/metrics`` cut inside a
  figure would still parse, as a wrong figure.
- Bytes after the end of the answer (unasked) make the connection unusable.
"""

from __future__ import annotations

from typing import final

import httptools


@final
class ProbeAnswers:
    """The answers read on one connection (the llhttp callbacks and what they found).

    Attributes:
        status: the answer's status (0 until it is complete).
        body: the pieces of its body.
        size: the bytes of its body.
        head_done: the answer's head is parsed.
        complete: the answer ended.
        reusable: complete, and the connection may carry the next probe.
    """

    __slots__ = ("_parser", "status", "body", "size", "head_done", "complete", "reusable")

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.body: list[bytes] = []
        self.size = 0
        self.head_done = False
        self.complete = False
        self.reusable = False

    def __repr__(self) -> str:
        return f"<ProbeAnswers {self.status or 'waiting'}{' complete' if self.complete else ''}>"

    def expect(self) -> None:
        """A request was sent: parse its answer."""
        self.status = 0
        self.body = []
        self.size = 0
        self.head_done = self.complete = self.reusable = False

    def feed(self, data: bytes) -> None:
        """Parse ``data`` (not empty: use :meth:`closed` at the end of input).

        Raises:
            httptools.HttpParserError: the answer is not valid HTTP/1.1 (or asks to upgrade).
        """
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise httptools.HttpParserError("the server switched protocols") from None
        except httptools.HttpParserError:
            if not self.complete:
                raise
            self.reusable = False  # whatever follows the answer is not ours to parse

    def closed(self) -> bool:
        """The connection closed: complete an answer whose head was read; whether it was."""
        if self.complete:
            return True
        if not self.head_done:
            return False
        self.status = self._parser.get_status_code()
        if 200 <= self.status < 300:  # possibly cut: capacity is never read from it
            self.body = []
            self.size = 0
        self.complete = True
        self.reusable = False
        return True

    # llhttp's callbacks (httptools calls them by name).

    def on_message_begin(self) -> None:
        if self.complete:  # unasked: a second answer
            self.reusable = False

    def on_headers_complete(self) -> None:
        if not self.complete:
            self.head_done = True

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.body.append(body)
            self.size += len(body)

    def on_message_complete(self) -> None:
        if self.complete:
            return
        parser = self._parser
        status = parser.get_status_code()
        if status < 200:  # informational: the real answer follows
            self.head_done = False
            return
        self.status = status
        self.complete = True
        self.reusable = parser.should_keep_alive()
