"""Binary data frames of the wire protocol: a run's output bytes, several records per frame.

A data frame is one binary WebSocket message holding one or more records, back to
back, each::

    id_length: u8 | run_id: id_length bytes, ASCII | seq: u32 big-endian | length: u32 big-endian | data

``seq`` counts a run's records from 0; ``data`` is the run's output exactly as the
client receives it (for an ``openai`` upstream, the upstream's own bytes). Contract:
``docs/wire.md``. Decoding raises only :class:`ProtocolError`; it copies each record's
data once and looks at nothing inside it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final, final

from ._errors import CLOSE_TOO_BIG, ProtocolError
from ._messages import MAX_MESSAGE_BYTES

_COUNTERS: Final = struct.Struct("!II")
MAX_RUN_ID_BYTES: Final = 255
"""The longest run id a data record can carry (its length is one byte)."""


@final
class RunData:
    """One record of a data frame: the next ``data`` bytes of run ``run_id`` (its ``seq``-th record)."""

    __slots__ = ("run_id", "seq", "data")

    def __init__(self, run_id: str, seq: int, data: bytes) -> None:
        self.run_id = run_id
        self.seq = seq
        self.data = data

    def __eq__(self, other: object) -> bool:
        if type(other) is not RunData:
            return NotImplemented
        return (self.run_id, self.seq, self.data) == (other.run_id, other.seq, other.data)

    def __hash__(self) -> int:
        return hash((self.run_id, self.seq, self.data))

    def __repr__(self) -> str:
        return f"RunData({self.run_id!r}, {self.seq}, <{len(self.data)} bytes>)"


def record_header(run_id: str, seq: int, length: int) -> bytes:
    """The header of one record (prepend it to the ``length`` data bytes).

    Raises:
        ValueError: ``run_id`` is not ASCII or longer than 255 bytes, or ``seq`` /
            ``length`` do not fit in 32 bits.
    """
    raw_id = run_id.encode("ascii")
    if len(raw_id) > MAX_RUN_ID_BYTES:
        raise ValueError(f"run id longer than {MAX_RUN_ID_BYTES} bytes: {run_id[:40]!r}...")
    try:
        return bytes((len(raw_id),)) + raw_id + _COUNTERS.pack(seq, length)
    except struct.error as exc:
        raise ValueError(f"seq {seq} or length {length} does not fit in 32 bits") from exc


def encode_data(records: Iterable[RunData]) -> bytes:
    """One data frame carrying ``records`` in order.

    Raises:
        ValueError: see :func:`record_header`.
    """
    parts: list[bytes] = []
    for record in records:
        parts.append(record_header(record.run_id, record.seq, len(record.data)))
        parts.append(record.data)
    return b"".join(parts)


def decode_data(frame: bytes | bytearray, *, max_bytes: int = MAX_MESSAGE_BYTES) -> list[RunData]:
    """The records of one data frame, in order.

    Raises:
        ProtocolError: see :func:`split_data`.
    """
    return [RunData(run_id, seq, data) for run_id, seq, data in split_data(frame, max_bytes=max_bytes)]


def split_data(frame: bytes | bytearray, *, max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int, bytes]]:
    """The records of one data frame, in order, as ``(run_id, seq, data)`` tuples.

    What :func:`decode_data` returns without an object per record: for a relay that
    hands each record's bytes on at once. The whole frame is checked before anything
    is returned.

    Raises:
        ProtocolError: the frame is larger than ``max_bytes`` (close code 1009), empty,
            or a record is truncated or has a run id that is not ASCII (1002).
    """
    size = len(frame)
    if size > max_bytes:
        raise ProtocolError(f"data frame too large: {size} bytes > {max_bytes}", close_code=CLOSE_TOO_BIG)
    if not size:
        raise ProtocolError("empty data frame")
    raw = frame if type(frame) is bytes else bytes(frame)  # slices of bytes are the records' bytes
    records: list[tuple[str, int, bytes]] = []
    append = records.append
    unpack = _COUNTERS.unpack_from
    offset = 0
    while offset < size:
        id_end = offset + 1 + raw[offset]
        data_start = id_end + 8
        if data_start > size:
            raise ProtocolError(f"truncated data record header at byte {offset}")
        seq, length = unpack(raw, id_end)
        data_end = data_start + length
        if data_end > size:
            raise ProtocolError(f"data record at byte {offset} announces {length} bytes, {size - data_start} left")
        try:
            run_id = raw[offset + 1 : id_end].decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError(f"data record at byte {offset}: run id is not ASCII") from None
        append((run_id, seq, raw[data_start:data_end]))
        offset = data_end
    return records
