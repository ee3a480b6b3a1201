"""The trio I/O pieces the project's servers share: the accept loop, the connection transport, due queues, parking.

Why a package of its own: the Edge's listener and the mock backend each had
a batch accept loop and a non-blocking socket with a TLS fallback. They live
here once, beside :mod:`iop_http` (which stays sans-I/O: bytes in, bytes out)
and under no daemon, so a server of any package uses them through public names.

- :mod:`.accept`: :func:`accept_loop` and :func:`accept_waiting`, every
  connection waiting accepted in one wake-up (up to :data:`ACCEPT_BATCH`).
- :mod:`.due`: :class:`DueQueue`, tasks woken at their due times by one runner
  task (one timer for a paced stream's tokens or a flood's paused connections).
- :mod:`.lifespan`: :func:`answer_lifespan`, the ASGI lifespan of an app with nothing to set up.
- :mod:`.ready_set`: :class:`ReadySet`, sockets watched for readability by one
  task in an epoll set of its own (Linux: :data:`CAN_POLL`), for the Edge's
  disconnect watch and the Node's body poller.
- :mod:`.off_loop`: long pure-Python work in a worker thread that does not stall
  the loop (:func:`run_off_loop`, :func:`run_in_turns`); the work calls
  :func:`yield_to_loop` itself, the one place of the GIL-yield concern.
- :mod:`.parking`: :class:`ParkedTask`, the one task a single-consumer queue wakes.
- :mod:`.byte_stream`: :class:`ByteStream`, one connection's bytes both ways (a
  non-blocking socket driven with trio's low-level waits, or a trio stream: TLS),
  the byte mover of the Edge's listener and node socket, the Node's Edge link and
  upstream connections, and the mock backend.
- :mod:`.transport`: :class:`Transport` (a server's writes that never wait on the
  client, a flusher for the rest) on a :class:`ByteStream`; :class:`SocketTransport`
  (a plain TCP connection) and :class:`StreamTransport` (a trio stream: TLS).
"""

from .accept import ACCEPT_BATCH, Handler, accept_loop, accept_waiting
from .byte_stream import CLOSE_TIMEOUT, RECEIVE_SIZE, ByteStream, PeerGone
from .due import Answer, DueQueue
from .lifespan import answer_lifespan
from .off_loop import bulk_work, paced, run_in_turns, run_off_loop, yield_to_loop
from .parking import ParkedTask
from .ready_set import CAN_POLL, ReadySet
from .transport import WRITE_BUFFER_LIMIT, SocketTransport, StreamTransport, Transport

__all__ = [
    "ACCEPT_BATCH",
    "CAN_POLL",
    "CLOSE_TIMEOUT",
    "RECEIVE_SIZE",
    "WRITE_BUFFER_LIMIT",
    "Answer",
    "ByteStream",
    "DueQueue",
    "Handler",
    "ParkedTask",
    "PeerGone",
    "ReadySet",
    "SocketTransport",
    "StreamTransport",
    "Transport",
    "accept_loop",
    "accept_waiting",
    "answer_lifespan",
    "bulk_work",
    "paced",
    "run_in_turns",
    "run_off_loop",
    "yield_to_loop",
]
