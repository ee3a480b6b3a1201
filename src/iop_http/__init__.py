"""HTTP/1.1 for every piece of the project, without I/O: request heads, bodies' framing, encoded answers.

Why a package of its own, and why without trio: the Edge faces the internet,
and the rules that decide where one request ends and the next begins are the
ones an attacker probes (request smuggling). They live here once, as plain
functions on bytes (in the manner of h11 and of :mod:`iop_admission`'s core),
so the listener, the Node's upstream client, the mock backend and the load
generator ask the same code, and tests check every rule without a socket.

- :mod:`.reader`: :class:`RequestReader`, one per connection, reads every
  request with llhttp (``httptools``) and applies the project's rules where
  llhttp is more permissive, in one place: each request's accepted
  :class:`RequestHead` (its framing decided) or :class:`Refusal` (a fixed
  status and text; the connection closes), its body bytes and its end.
  :func:`accept_head` is the same reader's verdict on one head (the reference
  the tests compare the listener with).
- :mod:`.head`: :class:`RequestHead`, and the rules the reader applies to a head
  llhttp read, at headers-complete (``HeadFields``).
- :mod:`.refusals`: every :class:`Refusal` the reader gives (fixed status and
  text), its rules on a target, and llhttp's errors mapped onto refusals.
- :mod:`.answer`: :class:`AnswerParser`, an answer read by a client (the Node's
  upstream, the benchmarks' client) with llhttp, within :class:`AnswerLimits`;
  every failure an :class:`AnswerError`.
- :mod:`.status_answers`: :class:`StatusAnswers`, answers read for their status
  on a kept connection (the Node's health probes): one llhttp parser for the
  connection's life, the same rules and bounds, no field kept.
- :mod:`.response`: :class:`ResponseFraming`, how one response is framed
  (``content-length``, chunks, the connection's close; keep-alive or close).
- :mod:`.encoding`: requests, response heads, whole answers, chunks and canned answers.
"""

from .answer import NO_LIMITS, AnswerError, AnswerLimits, AnswerParser, NoLimits
from .chunks import MAX_CHUNK_EXTENSION_BYTES
from .encoding import (
    LAST_CHUNK,
    encode_chunk,
    encode_head,
    encode_request,
    encode_response,
    error_response,
    length_framed,
)
from .head import CHUNKED, RequestHead
from .reader import (
    CLOSED,
    END_OF_MESSAGE,
    MAX_HEAD_BYTES,
    NEED_DATA,
    Event,
    RequestReader,
    accept_head,
    find_head_end,
)
from .refusals import MALFORMED_CHUNKS, Refusal
from .response import BodyOverrun, ResponseFraming
from .status_answers import StatusAnswers

__all__ = [
    "CHUNKED",
    "CLOSED",
    "END_OF_MESSAGE",
    "LAST_CHUNK",
    "MALFORMED_CHUNKS",
    "MAX_CHUNK_EXTENSION_BYTES",
    "MAX_HEAD_BYTES",
    "NEED_DATA",
    "NO_LIMITS",
    "AnswerError",
    "AnswerLimits",
    "AnswerParser",
    "BodyOverrun",
    "Event",
    "NoLimits",
    "Refusal",
    "RequestHead",
    "RequestReader",
    "ResponseFraming",
    "StatusAnswers",
    "accept_head",
    "encode_chunk",
    "encode_head",
    "encode_request",
    "encode_response",
    "error_response",
    "find_head_end",
    "length_framed",
]
