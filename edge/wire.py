"""Encoding ``Chunk`` messages for ReadShard without protobuf's extra copies.

The serve path sends stored frames exactly as LMDB holds them. Building a
``Chunk`` message and serializing it would copy each multi-MiB frame twice
(into the message, then into the wire bytes); writing the protobuf encoding
by hand copies it once, straight from the LMDB view into the bytes handed to
grpcio. Readers decode with the generated ``Chunk`` class as usual.
"""

from __future__ import annotations

from edgecache.cache.frame import Buffer

__all__ = ["encode_chunk"]

# Field tags of edgecache.v1.Chunk: (field number << 3) | wire type.
_INDEX, _COUNT, _ROWS = 0x08, 0x10, 0x18  # varint fields 1, 2, 3
_CHECKSUM = 0x21  # fixed64 field 4
_FRAME = 0x2A  # length-delimited field 5
_FIRST_ROW = 0x30  # varint field 6


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_chunk(
    *, index: int, chunk_count: int, rows: int, checksum: int, frame: Buffer, first_row: int = 0
) -> bytes:
    """The wire form of ``Chunk(index, chunk_count, rows, checksum, frame, first_row)``."""
    head = bytearray()
    for tag, value in ((_INDEX, index), (_COUNT, chunk_count), (_ROWS, rows)):
        if value:  # proto3 omits zero scalars
            head.append(tag)
            head += _varint(value)
    if checksum:
        head.append(_CHECKSUM)
        head += checksum.to_bytes(8, "little")
    tail = b""
    if first_row:  # field 6 follows the frame, as protobuf serializes in field order
        tail = bytes((_FIRST_ROW,)) + _varint(first_row)
    if not len(frame):
        return bytes(head) + tail
    head.append(_FRAME)
    head += _varint(len(frame))
    return b"".join((head, frame, tail))
