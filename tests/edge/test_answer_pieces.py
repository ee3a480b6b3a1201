"""A whole answer written as its pieces (:meth:`Responder.pieces`): one ``content-length``, the pieces in
order, never joined; cut short, nothing more is written into the promised body (no error event inside
a JSON answer): the connection closes with the body short."""

from __future__ import annotations

from typing import Any

import trio

from iop_edge.api.rejections import RequestRejected
from iop_edge.api.responder import Responder

PIECES = [b'{"a":', b'"' + b"x" * 10 + b'"', b"}"]


class Recorder:
    """An ASGI ``send`` keeping every message in :attr:`sent`; once ``cancel_after`` body messages
    went out it cancels :attr:`scope` (its caller's)."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.cancel_after = cancel_after
        self.scope = trio.CancelScope()

    async def __call__(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if len(self.bodies()) == self.cancel_after:
            self.scope.cancel()
        await trio.lowlevel.checkpoint()

    def bodies(self) -> list[dict[str, Any]]:
        return [m for m in self.sent if m["type"] == "http.response.body"]


async def test_pieces_go_out_in_order_under_one_content_length() -> None:
    send = Recorder()
    responder = Responder(send, {})
    parts = list(PIECES)
    handed: list[int] = []
    await responder.pieces(200, [(b"content-type", b"application/json")], parts, handed.append)
    assert parts == []  # each piece let go once handed on
    assert handed == [len(piece) for piece in PIECES]
    head, *bodies = send.sent
    assert head["status"] == 200
    assert (b"content-length", b"%d" % len(b"".join(PIECES))) in head["headers"]
    assert [m["body"] for m in bodies] == [*PIECES, b""]
    assert [m["more_body"] for m in bodies] == [True, True, True, False]
    assert responder.finished


async def test_a_body_cut_short_gets_no_error_written_into_it() -> None:
    send = Recorder(cancel_after=1)
    responder = Responder(send, {})
    with send.scope:
        await responder.pieces(200, [], list(PIECES))
    assert send.scope.cancelled_caught
    assert responder.finished
    await responder.reject(RequestRejected(504, "deadline_exceeded", "late", type="timeout_error"))
    assert [m["body"] for m in send.bodies()] == [PIECES[0]]
