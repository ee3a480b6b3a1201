"""HTTP/1.1 for every piece of the project, without I/O: request heads, bodies' framing, encoded answers.

Why a package of its own, and why without trio: the Edge faces the internet,
and the rules that decide where one request ends and the next begins are the
ones an attacker probes (request smuggling). They live here once, as plain
functions on bytes (in the manner of h11 and of :mod:`iop_admission`'s core),
so the listener, the Node's upstream client, the mock backend and the load
generator ask the same code, and tests check every rule without a socket.

- :mod:`.request_head`: :func:`accept_head` reads a request head and returns
  either an accepted :class:`RequestHead` (its framing decided) or a
  :class:`Refusal` (status, reason, and whether the connection must close).
- :mod:`.chunked`: :class:`ChunkedBody`, the strict decoder of a chunked body.
- :mod:`.encoding`: requests, response heads, whole answers, chunks and canned answers.
"""

from .chunked import ChunkedBody, MalformedChunk
from .encoding import (
    LAST_CHUNK,
    encode_chunk,
    encode_head,
    encode_request,
    encode_response,
    error_response,
    length_framed,
)
from .request_head import (
    CHUNKED,
    MAX_HEAD_BYTES,
    Refusal,
    RequestHead,
    accept_head,
    find_head_end,
    head_too_large,
)

__all__ = [
    "CHUNKED",
    "LAST_CHUNK",
    "MAX_HEAD_BYTES",
    "ChunkedBody",
    "MalformedChunk",
    "Refusal",
    "RequestHead",
    "accept_head",
    "encode_chunk",
    "encode_head",
    "encode_request",
    "encode_response",
    "error_response",
    "find_head_end",
    "head_too_large",
    "length_framed",
]
