"""The Edge–Node wire protocol v1: message classes and their JSON codec.

The contract is ``docs/wire.md``. Frames are JSON text, one message each, tagged
by ``"type"``. :func:`decode` raises only :class:`ProtocolError`.
"""

from ._codec import decode, encode, make_converter
from ._errors import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TOO_BIG,
    ProtocolError,
)
from ._messages import (
    END_STATUSES,
    ENDPOINTS,
    ERROR_CODES,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    REJECT_CODES,
    Cancel,
    EdgeMessage,
    Heartbeat,
    Message,
    NodeMessage,
    ProviderInfo,
    Register,
    Registered,
    Rejected,
    Run,
    RunEnd,
    RunEvent,
    TunnelChunk,
    TunnelEnd,
    TunnelRequest,
    TunnelStart,
)

__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_NORMAL",
    "CLOSE_POLICY",
    "CLOSE_PROTOCOL_ERROR",
    "CLOSE_TOO_BIG",
    "ENDPOINTS",
    "END_STATUSES",
    "ERROR_CODES",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "REJECT_CODES",
    "Cancel",
    "EdgeMessage",
    "Heartbeat",
    "Message",
    "NodeMessage",
    "ProtocolError",
    "ProviderInfo",
    "Register",
    "Registered",
    "Rejected",
    "Run",
    "RunEnd",
    "RunEvent",
    "TunnelChunk",
    "TunnelEnd",
    "TunnelRequest",
    "TunnelStart",
    "decode",
    "encode",
    "make_converter",
]
