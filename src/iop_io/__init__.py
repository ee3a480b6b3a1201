"""The trio I/O pieces every HTTP/1.1 server of the project shares: the accept loop and the connection transport.

Why a package of its own: the Edge's listener and the mock backend each had
a batch accept loop and a non-blocking socket with a TLS fallback. They live
here once, beside :mod:`iop_http` (which stays sans-I/O: bytes in, bytes out)
and under no daemon, so a server of any package uses them through public names.

- :mod:`.accept`: :func:`accept_loop` and :func:`accept_waiting`, every
  connection waiting accepted in one wake-up (up to :data:`ACCEPT_BATCH`).
- :mod:`.transport`: :class:`Transport` (writes that never wait on the client,
  a flusher for the rest), :class:`SocketTransport` (a plain TCP connection as a
  non-blocking stdlib socket) and :class:`StreamTransport` (a trio stream: TLS).
"""

from .accept import ACCEPT_BATCH, Handler, accept_loop, accept_waiting
from .transport import (
    RECEIVE_SIZE,
    WRITE_BUFFER_LIMIT,
    PeerGone,
    SocketTransport,
    StreamTransport,
    Transport,
)

__all__ = [
    "ACCEPT_BATCH",
    "RECEIVE_SIZE",
    "WRITE_BUFFER_LIMIT",
    "Handler",
    "PeerGone",
    "SocketTransport",
    "StreamTransport",
    "Transport",
    "accept_loop",
    "accept_waiting",
]
