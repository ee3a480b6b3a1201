"""A request's one deadline ([deadline]): read from its client, bounded by its model, shared by the
queue, every attempt and the Node's backend call.

Where it comes from, first found wins (``docs/openai-api.md``, Deadlines):

1. ``X-Request-Timeout: <seconds>``, a client's whole budget for the request;
2. ``X-Stainless-Read-Timeout: <seconds>``, which the official ``openai`` clients send with
   their ``timeout``: the longest they wait for a byte. A non-stream answer is one wait, so it
   is the request's deadline; for a stream it bounds the wait for the first byte only (the
   client waits as long again for every later byte: a healthy stream is never cut by it);
3. the model's ``default_deadline_ms`` (none by default);

never more than the model's ``max_deadline_ms``. As in gRPC, every hop gets what is left: the
wait in the queue ends at the deadline (or at ``queue_timeout_ms``, whichever comes first), an
attempt runs in what is left, the Node bounds the backend call by what was left when the run
was sent, and a failed attempt is tried again only while ``min_attempt_ms`` is left.
"""

from __future__ import annotations

import math
from typing import final

import trio

from iop_edge.api.rejections import RequestRejected
from iop_edge.api.responder import Responder
from iop_edge.config import EdgeModel
from iop_edge.listener.pacing import Headers

REQUEST_TIMEOUT = b"x-request-timeout"
"""The client's budget for the whole request, in seconds (a decimal number)."""
OPENAI_READ_TIMEOUT = b"x-stainless-read-timeout"
"""What the ``openai`` clients send with their ``timeout``: seconds they wait for a byte."""

_SOURCES = {REQUEST_TIMEOUT: "X-Request-Timeout", OPENAI_READ_TIMEOUT: "X-Stainless-Read-Timeout"}


def _seconds(text: bytes) -> float | None:
    """A header's positive, finite number of seconds; None when it is not one."""
    try:
        value = float(text.decode("ascii").strip(" \t"))
    except (UnicodeDecodeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


@final
class RequestDeadline:
    """One request's deadline and the cancel scope that holds it.

    Use :attr:`scope` around the request's admission and attempts: it is cancelled when the
    deadline passes. ``attempting`` is True while an attempt runs (the lease is held);
    :meth:`first_byte` lifts a deadline that holds only until the first byte.

    Attributes:
        seconds: the deadline, from the request's arrival (None: no deadline).
        source: where it came from (a header's name, ``default_deadline_ms``, or ``none``).
        whole: it holds for the whole answer; False: only until the first byte (a stream's
            ``openai`` read timeout).
    """

    __slots__ = ("seconds", "source", "whole", "scope", "attempting", "tried", "answered")

    def __init__(self, seconds: float | None, source: str, whole: bool = True) -> None:
        self.seconds = seconds
        self.source = source
        self.whole = whole
        self.scope = trio.CancelScope(deadline=math.inf if seconds is None else trio.current_time() + seconds)
        self.attempting = False
        self.tried: tuple[str, int] | None = None
        """The provider of the latest attempt and its number (for ``x-iop-provider``, ``x-iop-attempts``)."""
        self.answered: RequestRejected | None = None
        """The deadline's answer, once sent while its run was still being let go (:meth:`answer_now`)."""

    def left(self) -> float:
        """Seconds left until the deadline (``inf`` when there is none); negative once passed."""
        return self.scope.deadline - trio.current_time()

    def run_ms(self) -> int | None:
        """What a run sent now carries for the Node to bound its backend call: the milliseconds left
        (at least 1), or None when the request has no deadline that holds past the first byte."""
        if not self.whole or self.seconds is None:
            return None
        return max(1, math.ceil(self.left() * 1000))

    def may_retry(self, min_attempt: float) -> bool:
        """Whether enough is left for another attempt (``min_attempt`` seconds)."""
        return self.left() >= min_attempt

    def first_byte(self) -> None:
        """The first byte went to the client: a deadline of the first byte only is over."""
        if not self.whole:
            self.scope.deadline = math.inf

    async def answer_now(self, responder: Responder) -> None:
        """If the deadline passed, answer the client now: before the run's node confirms it let go
        of the backend (the lease stays held until then), so that wait is not the client's, nor its
        keep-alive connection's (the next request is served meanwhile: ``serve_next_meanwhile``).

        Call it where the attempt's cancellation passes, before the run is left. Shielded and
        bounded (:meth:`Responder.reject`); the same answer is raised again by
        :func:`~iop_edge.api.attempts.within_deadline` (:attr:`answered`), to be counted.
        """
        if responder.finished or not self.scope.cancel_called or self.left() > 0:
            return
        self.answered = self.exceeded(answered=responder.started)
        await responder.reject(self.answered)
        responder.serve_next_meanwhile()

    def exceeded(self, *, answered: bool) -> RequestRejected:
        """The answer once the deadline passed: 504 ``deadline_exceeded``, saying where the time went
        (queued, in an attempt before the first byte, or after it: ``answered``)."""
        where = "after the first byte" if answered else "before the first byte" if self.attempting else "while queued"
        rejection = RequestRejected(
            504,
            "deadline_exceeded",
            f"the request's deadline of {self.seconds:g} s ({self.source}) passed {where}",
            type="timeout_error",
        )
        if self.tried is not None:
            rejection.provider, rejection.attempts = self.tried
        return rejection


def request_deadline(headers: Headers, model: EdgeModel | None, stream: bool) -> RequestDeadline:
    """The deadline of a request with ``headers`` for ``model`` (its ``models[]`` entry; None: an
    unknown key, whose request is refused later anyway). Does not checkpoint.

    Raises:
        RequestRejected: 400 ``bad_request``, ``X-Request-Timeout`` is not a positive number of seconds.
    """
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in _SOURCES:
            found[name] = value
    asked: float | None = None
    source, whole = "default_deadline_ms", True
    if REQUEST_TIMEOUT in found:
        asked = _seconds(found[REQUEST_TIMEOUT])
        if asked is None:
            raise RequestRejected(400, "bad_request", "X-Request-Timeout must be a positive number of seconds")
        source = _SOURCES[REQUEST_TIMEOUT]
    elif OPENAI_READ_TIMEOUT in found and (asked := _seconds(found[OPENAI_READ_TIMEOUT])) is not None:
        source, whole = _SOURCES[OPENAI_READ_TIMEOUT], not stream
    if model is None:
        return RequestDeadline(None, "none")
    seconds = model.deadline_seconds(asked)
    if asked is not None and seconds is not None and seconds < asked:
        source += ", cut to max_deadline_ms"
    return RequestDeadline(seconds, source if seconds is not None else "none", whole)
