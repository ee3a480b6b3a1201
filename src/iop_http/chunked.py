"""The chunked transfer coding of a request body (RFC 9112 section 7.1), decoded strictly.

A chunk is its size in hex (1 to 16 digits: no ``0x``, no sign, no
whitespace before it), optional extensions, CRLF, exactly that many bytes,
CRLF; the last chunk has size 0 and is followed by trailer fields (each a
well-formed field line, no obs-fold) and an empty line. Anything else raises
:class:`MalformedChunk`: the caller answers 400 and closes the connection.
"""

from __future__ import annotations

import re
from typing import Final, final

MAX_CHUNK_LINE: Final = 4096
"""The longest chunk-size line (extensions included) or trailer line, CRLF included."""
MAX_TRAILERS: Final = 64 * 1024
"""The most trailer bytes after the last chunk."""

_SIZE_LINE: Final = re.compile(
    rb"([0-9A-Fa-f]{1,16})((?:[ \t]*;[ \t]*[-!#$%&'*+.^_`|~0-9A-Za-z]+(?:[ \t]*=[ \t]*(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+|\"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*\"))?)*)"
)
_TRAILER: Final = re.compile(
    rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+:[ \t]*(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?[ \t]*"
)

_SIZE, _DATA, _DATA_END, _TRAILERS, _DONE = range(5)


class MalformedChunk(Exception):
    """The chunked body breaks the coding; the message is fixed text (never the request's bytes)."""


@final
class ChunkedBody:
    """Decodes one chunked body from the bytes that follow its head, in pieces as they arrive.

    :meth:`feed` takes the bytes read so far (not yet consumed) and returns
    the body bytes it decoded and how many input bytes it consumed; bytes
    after the body's end are never consumed (they are the next request).
    """

    __slots__ = ("_state", "_left", "_trailer_bytes")

    def __init__(self) -> None:
        self._state = _SIZE
        self._left = 0
        self._trailer_bytes = 0

    def __repr__(self) -> str:
        return f"<ChunkedBody state {self._state}, {self._left} bytes left in the chunk>"

    @property
    def done(self) -> bool:
        """The body ended (last chunk, trailers and the empty line all consumed)."""
        return self._state == _DONE

    def feed(self, data: bytes | bytearray) -> tuple[bytes, int]:
        """Decode what ``data`` holds: (body bytes, input bytes consumed). Raises :class:`MalformedChunk`."""
        out: list[bytes] = []
        at = 0
        end = len(data)
        while at < end and self._state != _DONE:
            state = self._state
            if state == _DATA:
                take = min(self._left, end - at)
                out.append(bytes(data[at : at + take]))
                at += take
                self._left -= take
                if not self._left:
                    self._state = _DATA_END
                continue
            if state == _DATA_END:
                if end - at < 2:
                    if data[at : at + 1] != b"\r"[: end - at]:
                        raise MalformedChunk("chunk data longer than its size")
                    break
                if data[at : at + 2] != b"\r\n":
                    raise MalformedChunk("chunk data longer than its size")
                at += 2
                self._state = _SIZE
                continue
            line_end = data.find(b"\r\n", at, at + MAX_CHUNK_LINE)
            if line_end < 0:
                if end - at >= MAX_CHUNK_LINE:
                    raise MalformedChunk("chunk line too long")
                if _BARE.search(data, at) is not None:
                    raise MalformedChunk("bare CR or LF in chunk framing")
                break
            line = bytes(data[at:line_end])
            at = line_end + 2
            if state == _SIZE:
                size = _SIZE_LINE.fullmatch(line)
                if size is None:
                    raise MalformedChunk("malformed chunk size")
                self._left = int(size[1], 16)
                self._state = _DATA if self._left else _TRAILERS
                continue
            if not line:  # _TRAILERS: the empty line ends the body
                self._state = _DONE
                continue
            self._trailer_bytes += len(line) + 2
            if self._trailer_bytes > MAX_TRAILERS:
                raise MalformedChunk("trailers too large")
            if _TRAILER.fullmatch(line) is None:
                raise MalformedChunk("malformed trailer field")
        return b"".join(out), at


_BARE: Final = re.compile(rb"\r[^\n]|\n")
