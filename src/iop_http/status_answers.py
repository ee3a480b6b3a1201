"""Answers read for their status on a kept connection, parsed by llhttp: :class:`StatusAnswers`.

The Node's health probes (``iop_node.health``) read one answer after another on
a kept connection and need of each only its status, its body and whether the
connection can carry the next request. :class:`~.answer.AnswerParser`, the
parser of run answers, is made per answer and keeps and bounds every field of
the head, a Python callback per field; here one llhttp parser (httptools) serves
the connection's life, with a callback at the head's end, one per piece of body
and one at the answer's end (the probe loop's largest cost after the system
calls was the parse). The rules are :class:`~.answer.AnswerParser`'s where they
apply, and its bounds:

- Informational answers (1xx) are skipped; the next answer is the real one; at
  most ``informational_answers`` of them (:data:`INFORMATIONAL_ANSWERS`).
- The head's fields are not kept, but its bytes (informational answers before
  it included) are bounded all the same: ``head_bytes`` (:data:`HEAD_BYTES`,
  as a client's request head). The body is bounded by the caller, which reads
  :attr:`StatusAnswers.size`.
- An answer the close ends (no framing, or framed and cut short: llhttp does
  not say which) gives its status, and its body only when it is not a success
  (:meth:`StatusAnswers.closed`): a failure's text is the reason shown, while a
  success's body is what capacity is read from, and a ``/metrics`` cut inside a
  figure would still parse, as a wrong figure.
- Bytes after the end of the answer (unasked) make the connection unusable.
"""

from __future__ import annotations

from typing import Final, final

import httptools

from .answer import AnswerError

HEAD_BYTES: Final = 64 * 1024
"""The default bound on an answer's head, the informational answers before it included (a run's ``head_bytes``)."""
INFORMATIONAL_ANSWERS: Final = 5
"""The default bound on the informational answers before one answer (a run's ``informational_answers``)."""


@final
class StatusAnswers:
    """The answers read on one connection (the llhttp callbacks and what they found).

    Attributes:
        status: the answer's status (0 until it is complete).
        body: the pieces of its body.
        size: the bytes of its body.
        head_done: the answer's head is parsed.
        complete: the answer ended.
        reusable: complete, and the connection may carry the next probe.
    """

    __slots__ = (
        "_parser",
        "_head_bytes",
        "_informational",
        "_bounds",
        "status",
        "body",
        "size",
        "head_done",
        "complete",
        "reusable",
    )

    def __init__(self, head_bytes: int = HEAD_BYTES, informational_answers: int = INFORMATIONAL_ANSWERS) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._bounds = (head_bytes, informational_answers)
        self._head_bytes = 0
        self._informational = 0
        self.status = 0
        self.body: list[bytes] = []
        self.size = 0
        self.head_done = False
        self.complete = False
        self.reusable = False

    def __repr__(self) -> str:
        return f"<StatusAnswers {self.status or 'waiting'}{' complete' if self.complete else ''}>"

    def expect(self) -> None:
        """A request was sent: parse its answer."""
        self.status = 0
        self.body = []
        self.size = 0
        self._head_bytes = self._informational = 0
        self.head_done = self.complete = self.reusable = False

    def feed(self, data: bytes) -> None:
        """Parse ``data`` (not empty: use :meth:`closed` at the end of input).

        Raises:
            AnswerError: the answer is not valid HTTP/1.1 (or asks to upgrade): ``invalid``; its head
                went past ``head_bytes``: ``too_large``; more than ``informational_answers`` came
                before it: ``over_bound``.
        """
        head_open = not self.head_done and not self.complete
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise AnswerError("the server switched protocols") from None
        except httptools.HttpParserError as exc:
            if not self.complete:
                raise AnswerError(str(exc)) from None
            self.reusable = False  # whatever follows the answer is not ours to parse
        head_bytes, informational = self._bounds
        if head_open:
            self._head_bytes += len(data)  # a bound, counted by the read: the head's end may share it
            if not self.head_done and not self.complete and self._head_bytes > head_bytes:
                raise AnswerError(f"the answer's head is over {head_bytes} bytes", "too_large")
        if self._informational > informational:
            raise AnswerError(f"more than {informational} informational answers", "over_bound")

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
            self._informational += 1
            return
        self.status = status
        self.complete = True
        self.reusable = parser.should_keep_alive()
