"""One client connection's bytes, both ways: :mod:`iop_io.transport`, shared with the mock backend (kept
importable here)."""

from iop_io.transport import (
    CLOSE_TIMEOUT,
    RECEIVE_SIZE,
    WRITE_BUFFER_LIMIT,
    PeerGone,
    SocketTransport,
    StreamTransport,
    Transport,
)

__all__ = [
    "CLOSE_TIMEOUT",
    "RECEIVE_SIZE",
    "WRITE_BUFFER_LIMIT",
    "PeerGone",
    "SocketTransport",
    "StreamTransport",
    "Transport",
]
