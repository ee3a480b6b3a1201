"""The bound on a chunked body's chunk extensions (RFC 9112 §7.1.1), for a parser that does not report them.

llhttp parses chunk extensions and trailer fields but ``httptools`` hands
neither to its caller, so their length is measured from what it does report:
every byte of a chunked body is either data (``on_body``) or framing, and the
framing of one chunk without extensions is at most :data:`CHUNK_FRAMING_BYTES`
(``on_chunk_header`` counts the chunks). What is left -- extensions, trailer
fields, and padding such as leading zeros in a size -- is bounded for the
whole message, as RFC 9112 §7.1.1 asks ("limit the total length of chunk
extensions received"). Node.js bounds chunk extensions since CVE-2024-22019:
without a bound, a peer that sends one endless extension holds a reader busy
with bytes that never make progress.
"""

from __future__ import annotations

from typing import Final

CHUNK_FRAMING_BYTES: Final = 20
"""The framing of one chunk without extensions: a size of up to 16 hex digits, its CRLF, the CRLF after the data."""

MAX_CHUNK_EXTENSION_BYTES: Final = 16 * 1024
"""The default bound of a chunked body's extensions and trailer fields together (Node.js's bound)."""


def extension_bytes(fed: int, data: int, chunks: int) -> int:
    """The bytes of a chunked body beyond its data and its chunks' plain framing.

    Args:
        fed: the body's bytes read so far (framing and data).
        data: its data bytes among them.
        chunks: its chunks begun so far (the last, empty one included).
    """
    return fed - data - CHUNK_FRAMING_BYTES * chunks
