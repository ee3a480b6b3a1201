"""One request's body on the Edge's listener, as its app reads it: :class:`RequestBody`.

The body's bytes come from the connection's :class:`iop_http.RequestReader`, read from the
socket only when the app asks (after a ``100 Continue`` if the client waits for one). After
the body's end, reading waits for the client to leave (bytes of a next request are kept for
it). An answer that goes out before the body's end was read decides, as its head goes out,
whether the connection can carry another request: the rest of the body is skipped if it is in
hand, or drained when small (:data:`DRAIN_LIMIT`).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Final, final

import trio

from iop_http import END_OF_MESSAGE, NEED_DATA, Refusal, RequestHead, RequestReader, encode_head
from iop_io import PeerGone

if TYPE_CHECKING:
    from iop_edge.listener.cycle import CycleHost

Message = MutableMapping[str, Any]
DISCONNECT: Message = {"type": "http.disconnect"}

DRAIN_LIMIT = 64 * 1024
"""Unread request body bytes the listener reads and drops to keep a connection alive."""

_CONTINUE: Final = encode_head(100, [])


def skip_buffered(reader: RequestReader) -> bool:
    """Skip the request body bytes ``reader`` has, without reading more; whether the body's end was among them.

    A refusal keeps its connection only then (:meth:`RequestBody.keeps_unread`, the head desk's
    refusals): where a body still to come ends is the client's word only.
    """
    while True:
        event = reader.next_event()
        if event is END_OF_MESSAGE:
            return True
        if type(event) is not bytes:
            return False


class Malformed(Exception):
    """The request body's chunked framing is malformed (the reader refused it)."""


@final
class RequestBody:
    """The body of one request: its ASGI messages, ``100 Continue``, and what is left of it unread.

    Attributes:
        done: the body's end was read.
        delivered: the app received the body's last message.
        waiting: the app waits for the client to leave (it reads the socket meanwhile).
    """

    __slots__ = ("_conn", "_request", "_continued", "done", "delivered", "waiting")

    def __init__(self, conn: CycleHost, request: RequestHead) -> None:
        self._conn = conn
        self._request = request
        self._continued = False  # 100 Continue went out for the request
        self.done = False
        self.delivered = False
        self.waiting = False
        if request.length == 0:  # its end is queued right behind its head
            self.done = conn.reader.next_event() is END_OF_MESSAGE

    async def after_end(self) -> Message:
        """``receive`` once the body's end was read: its last message if the app did not have it,
        else the client's departure (read and kept, for the next request, until it goes)."""
        if not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        self.waiting = True
        try:
            return await self._wait_disconnect()
        finally:
            self.waiting = False

    async def continue_if_asked(self) -> None:
        """Send ``100 Continue`` if the client waits for it and sent none of the body yet; after the
        body is read, one would come too late."""
        if self._request.expect_continue and not self._continued and not self._conn.reader.buffered:
            self._continued = True
            await self._conn.send_bytes(_CONTINUE)
        self._continued = True

    async def next_message(self) -> Message:
        """The body bytes the reader has (reading when it has none), ``more_body`` false at the end.

        Raises:
            PeerGone: the client left mid-body.
            Malformed: the reader refused the body's chunked framing.
        """
        conn = self._conn
        reader = conn.reader
        body = b""
        while True:
            event = reader.next_event()
            if type(event) is bytes:
                body += event
                continue
            if event is END_OF_MESSAGE:
                self.done = self.delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            if event is NEED_DATA:
                if body:
                    return {"type": "http.request", "body": body, "more_body": True}
                data = await conn.receive(trio.current_time() + conn.limits.read_timeout, "body")
                reader.feed(data)
                continue
            if type(event) is Refusal:
                raise Malformed
            raise PeerGone  # CLOSED: the client left mid-body

    def keeps_unread(self, status: int) -> bool:
        """Whether the connection can carry another request after a ``status`` answer sent before the
        request body's end was read, decided as its head goes out (RFC 9112 9.6: a connection that
        will end says so in that head): a refusal (400 or more) when the body's end is in hand (its
        bytes are skipped now), another answer when what is left of the body fits the drain
        (:meth:`drain`); never while the client waits for ``100 Continue`` to send it."""
        request = self._request
        if request.expect_continue and not self._continued:
            return False
        if status >= 400:
            self.done = skip_buffered(self._conn.reader)
            return self.done
        return 0 <= request.length <= DRAIN_LIMIT

    async def drain(self) -> bool:
        """Read and drop what is left of the body, :data:`DRAIN_LIMIT` bytes at most; whether its end came."""
        if self.done:
            return True
        drained = 0  # a success whose head found the rest of the body within the drain
        try:
            while not self.done and drained <= DRAIN_LIMIT:
                message = await self.next_message()
                drained += len(message["body"])
        except (PeerGone, Malformed):
            return False
        return self.done

    async def _wait_disconnect(self) -> Message:
        """Read (and keep, for the next request) until the client goes away."""
        conn = self._conn
        while not conn.gone:
            if conn.reader.buffered > conn.limits.max_head_bytes:
                await trio.sleep_forever()  # pipelined too far ahead: stop reading, keep the bytes
            try:
                data = await conn.transport.receive_some()
            except PeerGone:
                data = b""
            if not data:
                conn.gone = True
                break
            conn.reader.feed(data)
        return DISCONNECT
