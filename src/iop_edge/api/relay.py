"""A run's answer relayed to its client: the first message, SSE streams, whole answers.

Every function here checkpoints; a node gone mid-run becomes the client's 502, a client too slow
for its run's buffer ``client_too_slow``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import trio

from iop_edge.api.rejections import JSON as _JSON
from iop_edge.api.rejections import RequestRejected, node_disconnected
from iop_edge.api.responder import SSE, Responder
from iop_edge.api.run_failure import UPSTREAM_RETRY_AFTER, run_failure
from iop_edge.nodes.runs import NodeGone, RunChannel, RunMessage
from iop_wire import RunData, RunEnd


async def next_message(run: RunChannel) -> RunMessage:
    try:
        return await run.next()
    except NodeGone as exc:
        if run.overflowed:
            raise RequestRejected(502, "client_too_slow", str(exc), type="upstream_error") from None
        raise node_disconnected(str(exc)) from None


async def first_message(run: RunChannel, first_token: float | None) -> RunMessage:
    """The run's first message, within ``first_token`` seconds when set ([first-token-timeout]).

    Checkpoints. Past the timeout it raises a retryable provider failure; the
    caller leaving the run's ``async with`` then cancels the run on the node.
    A message that arrived in the scheduling round the timeout ended the wait
    came in time: the node link's reader may have written the whole answer to
    the client already (:meth:`RunChannel.answer_whole`), which must then count
    as answered, not as a failure of the provider.
    """
    if first_token is None:
        return await next_message(run)
    with trio.move_on_after(first_token):
        return await next_message(run)
    if run.ready():
        return await next_message(run)
    raise RequestRejected(
        502,
        "first_token_timeout",
        "no first byte from the upstream in time (first_token_timeout_ms)",
        type="upstream_error",
        retry_after=UPSTREAM_RETRY_AFTER,
        retry="first_token_timeout",
        provider_failure=True,
    )


def end_of(message: RunMessage) -> RunEnd:
    """The run's end; an error end or a message no run carries becomes the client's error."""
    if type(message) is not RunEnd:
        raise RequestRejected(502, "upstream_error", "unexpected tunnel message for a run", type="upstream_error")
    if message.status != "ok":
        raise run_failure(message)
    return message


async def relay_stream(
    run: RunChannel,
    responder: Responder,
    head: list[tuple[bytes, bytes]],
    first: RunMessage | None = None,
    scan: Callable[[bytes], None] | None = None,
) -> None:
    """Relay a streamed run: every burst of output that has arrived goes out in one send.

    The data records are the SSE body already (its ``[DONE]`` included), written as is.
    ``first`` is the run's first message when the caller received it already.
    ``scan`` (token cost, [tenant-edge]) sees every burst written, to find the reported usage.

    Once the head is out and everything received is written, data records go
    from the node link's reader straight to the client's socket (the server's
    ``write_body_nowait``, :meth:`RunChannel.attach`); this task then only
    waits for the run's end.
    """
    try:
        await relay_bursts(run, responder, head, first, scan)
    finally:
        run.detach()


async def relay_bursts(
    run: RunChannel,
    responder: Responder,
    head: list[tuple[bytes, bytes]],
    first: RunMessage | None,
    scan: Callable[[bytes], None] | None,
) -> None:
    while True:
        if scan is None and responder.started and responder.write_nowait is not None:
            run.attach(responder.write_nowait)
        message, first = (first, None) if first is not None else (await next_message(run), None)
        burst = [message, *run.buffered()]
        parts: list[bytes] = []
        end: RunMessage | None = None
        for item in burst:
            if isinstance(item, RunData):
                parts.append(item.data)
            else:
                end = item
                break
        if parts:
            if not responder.started:
                await responder.start(200, [SSE, (b"cache-control", b"no-cache"), *head])
            data = b"".join(parts)
            if scan is not None:
                scan(data)
            await responder.chunk(data)
        if end is not None:
            end_of(end)
            if not responder.started:
                await responder.start(200, [SSE, (b"cache-control", b"no-cache"), *head])
            await responder.finish(b"")
            return


@final
class AnswerBudget:
    """The bytes of non-stream answers this Edge holds, all runs together ([upstream-bounds]).

    A relayed non-stream answer is held until its run ends (a run that fails
    before that still gets a clean error answer), as the pieces its records
    brought, never joined. :meth:`take` counts each piece against the bound on
    one answer (``max_answer_bytes``) and on all of them (``answer_budget_bytes``);
    the relay gives each piece's bytes back as it hands the piece to the client's
    connection, and the rest when it gives up. :attr:`held` is
    ``iop_answer_bytes_held`` in ``/metrics``.
    """

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = 0

    def take(self, answer: int, size: int, limits: tuple[int, int]) -> None:
        """Count ``size`` more bytes of an answer that holds ``answer`` bytes already.

        ``limits``: ``(max_answer_bytes, answer_budget_bytes)``.

        Raises:
            RequestRejected: past the answer's bound (502 ``upstream_too_large``, retried on another
                candidate like the Node's own bound) or the budget's (503 ``overloaded``, reason
                ``answer_budget``); nothing is counted then.
        """
        per_answer, budget = limits
        if answer + size > per_answer:
            raise RequestRejected(
                502,
                "upstream_too_large",
                f"the upstream's answer is larger than this Edge relays whole (max_answer_bytes: {per_answer})",
                type="upstream_error",
                retry="upstream_error",
                provider_failure=True,
            )
        if self.held + size > budget:
            raise RequestRejected(
                503,
                "overloaded",
                f"this Edge holds as many answer bytes as it may (answer_budget_bytes: {budget}); retry later",
                type="service_unavailable",
                reason="answer_budget",
                retry_after=UPSTREAM_RETRY_AFTER,
            )
        self.held += size

    def give_back(self, size: int) -> None:
        """The relay no longer holds ``size`` bytes it took (never below 0)."""
        self.held = max(0, self.held - size)


async def relay_whole(
    run: RunChannel,
    responder: Responder,
    head: list[tuple[bytes, bytes]],
    hold: tuple[AnswerBudget, tuple[int, int]],
    first: RunMessage | None = None,
    scan: Callable[[list[bytes]], None] | None = None,
) -> None:
    """Relay a non-stream run: the body bytes of its data records, held as they came, never joined.

    ``hold``: the Edge's :class:`AnswerBudget` and its limits (``max_answer_bytes``,
    ``answer_budget_bytes``); each piece is counted as it arrives, so an answer past
    either bound fails (the run is cancelled on the node as the caller leaves it) before
    any byte went to the client, and the budget is given back however this ends.
    ``first`` is the run's first message when the caller received it already.
    Messages that arrived with it are taken without waiting (the answer and its
    end usually come in one read: no scheduling round between them). When the
    whole answer came before this task took any of it, the node link's reader
    has written it to the client already (:meth:`RunChannel.answer_whole`):
    the client has its answer one scheduling round sooner, and this task only
    goes through the run's messages. ``scan`` sees the pieces (token cost).
    """
    held = _HeldAnswer(*hold)
    try:
        while True:
            if first is None:
                first = await next_message(run)
            for message in (first, *run.buffered()):
                if isinstance(message, RunData):
                    # Answered: written already, within max_answer_bytes (the caller's writer).
                    held.add(message.data, counted=not run.answered)
                    continue
                _ended(message, held.parts, scan)
                if not run.answered:
                    await responder.pieces(200, [_JSON, *head], held.parts, held.written)
                return
            first = None
    finally:
        held.drop()


@final
class _HeldAnswer:
    """The pieces of one whole answer, held for its end: counted against the Edge's
    :class:`AnswerBudget` and its limits as they come, given back as they are written."""

    __slots__ = ("parts", "_budget", "_limits", "_size")

    def __init__(self, budget: AnswerBudget, limits: tuple[int, int]) -> None:
        self.parts: list[bytes] = []
        self._budget = budget
        self._limits = limits
        self._size = 0

    def add(self, data: bytes, counted: bool) -> None:
        """Hold ``data``; when ``counted``, take it from the budget first (raises past a bound)."""
        if counted:
            self._budget.take(self._size, len(data), self._limits)
            self._size += len(data)
        self.parts.append(data)

    def written(self, piece: int) -> None:
        """A piece handed to the client's connection is no longer held here."""
        self._size -= piece
        self._budget.give_back(piece)

    def drop(self) -> None:
        """Give the budget back whatever is still held, however the relay ended."""
        self._budget.give_back(self._size)
        # A failure's traceback keeps the relay's frame alive, often until the collector's next full
        # pass (an exception and a frame refer to each other): the pieces must not stay with it.
        self.parts.clear()


def _ended(end: RunMessage, parts: list[bytes], scan: Callable[[list[bytes]], None] | None) -> None:
    """The run ended with ``end`` after the held ``parts``: an error end (:func:`end_of`) or no
    answer at all is the client's error; else ``scan`` sees the parts (token cost)."""
    end_of(end)
    if not parts:
        raise RequestRejected(502, "upstream_error", "the node ended the run without a response", type="upstream_error")
    if scan is not None:
        scan(parts)
