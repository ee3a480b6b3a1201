"""Errors and close codes of the Edge–Node wire protocol.

:class:`ProtocolError` is the only exception :func:`iop_wire.decode` raises. It
carries the WebSocket close code the receiver should use, so both daemons close
a connection the same way after a bad frame (1002, or 1009 when oversized).
"""

from __future__ import annotations

from typing import Final, final

CLOSE_NORMAL: Final = 1000
"""Normal closure (the Edge shutting down or ending a connection on purpose)."""
CLOSE_GOING_AWAY: Final = 1001
"""Going away: graceful shutdown of the node (or of the Edge)."""
CLOSE_PROTOCOL_ERROR: Final = 1002
"""A frame failed :func:`iop_wire.decode` or broke the message ordering rules."""
CLOSE_POLICY: Final = 1008
"""Policy violation: the registration was rejected (sent after ``rejected``)."""
CLOSE_TOO_BIG: Final = 1009
"""A frame was larger than the receiver's limit."""

# RFC 6455 §5.5: a control frame payload is at most 125 bytes, two of which
# hold the close code, leaving 123 bytes for the UTF-8 reason.
_MAX_CLOSE_REASON_BYTES: Final = 123


@final
class ProtocolError(Exception):
    """A frame broke the wire protocol (see ``docs/wire.md``).

    Attributes:
        reason: A readable description that names the offending field, e.g.
            ``"invalid run_end message: required field missing @ $.status"``.
        close_code: The WebSocket close code the receiver should close with:
            :data:`CLOSE_TOO_BIG` for an oversized frame,
            :data:`CLOSE_PROTOCOL_ERROR` for everything else.
    """

    def __init__(self, reason: str, *, close_code: int = CLOSE_PROTOCOL_ERROR) -> None:
        self.reason = reason
        self.close_code = close_code
        super().__init__(reason)

    @property
    def close_reason(self) -> str:
        """The reason cut to fit a WebSocket close frame (at most 123 UTF-8 bytes)."""
        raw = self.reason.encode("utf-8", "surrogatepass")
        if len(raw) <= _MAX_CLOSE_REASON_BYTES:
            return self.reason
        cut = raw[: _MAX_CLOSE_REASON_BYTES - 3].decode("utf-8", "ignore")
        return cut + "..."
