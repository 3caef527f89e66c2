"""The ``Chunk`` message of ReadShard, encoded and parsed by hand, without copying frames.

The serve path sends stored frames exactly as LMDB holds them. Building a
``Chunk`` message and serializing it would copy each multi-MiB frame twice
(into the message, then into the wire bytes); :func:`encode_chunk` writes the
protobuf encoding by hand and copies it once, straight from the LMDB view into
the bytes handed to grpcio. On the receiving side the generated parser would
copy each frame out of the message again; :func:`parse_chunk` returns a
memoryview into the received bytes instead, and hands anything but the plain
encoding to protobuf. Readers are both client readers and nodes that copy a
version from a peer, so both halves live here, in ``cache``, beside each other.
"""

from __future__ import annotations

from edgecache.cache.frame import Buffer
from edgecache.v1 import edge_pb2

__all__ = ["READ_SHARD_METHOD", "WireChunk", "encode_chunk", "parse_chunk"]

READ_SHARD_METHOD = "/edgecache.v1.EdgeCache/ReadShard"
# The largest chunk frame a node stores (cache.codec refuses a larger one when staging)
# and the largest ReadShard message a reader or a peer accepts: a chunk of the largest
# --chunk-size (256 MiB) may reach 4x that on the row grid (codec.MAX_CHUNK_FACTOR), and
# the message adds a few fields. Readers and peers refused such chunks at 256 MiB, so a
# version published with --chunk-size 256MiB was stored and never read. A message over
# the limit comes from a broken or hostile node: refused, not allocated.
MAX_FRAME_BYTES = (1 << 30) + (16 << 20)
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + (1 << 20)

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


# Fields the parser's fast path accepts: tag → (name, wire type, largest value). These are
# what encode_chunk writes; protobuf serializers write the same bytes, in field order.
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
_CHUNK_FIELDS = {
    _INDEX: ("index", 0, _U32),
    _COUNT: ("chunk_count", 0, _U32),
    _ROWS: ("rows", 0, _U32),
    _CHECKSUM: ("checksum", 1, _U64),
    _FRAME: ("frame", 2, 0),
    _FIRST_ROW: ("first_row", 0, _U64),
}


class WireChunk:
    """A ``Chunk`` whose ``frame`` is a memoryview into the received message (no copy)."""

    __slots__ = ("index", "chunk_count", "rows", "checksum", "frame", "first_row")

    def __init__(self) -> None:
        self.index = self.chunk_count = self.rows = self.checksum = self.first_row = 0
        self.frame: memoryview | bytes = b""


def _read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """A varint of at most 10 bytes at ``pos``; ``(-1, pos)`` if it is longer or truncated."""
    value = shift = 0
    limit = min(end, pos + 10)
    while pos < limit:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def parse_chunk(data: bytes) -> WireChunk | edge_pb2.Chunk:
    """ReadShard's response deserializer: the ``Chunk`` in ``data``, its frame not copied.

    The generated parser copies each multi-MiB frame out of the message; this
    one returns a memoryview into ``data`` instead. It accepts only the plain
    encoding (known fields, each at most once, values in range); anything else,
    valid or not, is handed to protobuf, so results and errors are exactly
    protobuf's (a malformed message raises, which gRPC turns into INTERNAL, and
    the stream fails over as before).
    """
    out = WireChunk()
    seen = 0
    pos, end = 0, len(data)
    try:
        while pos < end:
            tag = data[pos]
            field = _CHUNK_FIELDS.get(tag)
            if field is None or seen & (1 << (tag >> 3)):
                return edge_pb2.Chunk.FromString(data)  # unknown or repeated field
            seen |= 1 << (tag >> 3)
            name, wire, top = field
            pos += 1
            if wire == 0:
                value, pos = _read_varint(data, pos, end)
                if not 0 <= value <= top:
                    return edge_pb2.Chunk.FromString(data)  # overlong, truncated or wrapped
                setattr(out, name, value)
            elif wire == 1:
                if pos + 8 > end:
                    return edge_pb2.Chunk.FromString(data)
                out.checksum = int.from_bytes(data[pos : pos + 8], "little")
                pos += 8
            else:
                size, pos = _read_varint(data, pos, end)
                if size < 0 or pos + size > end:
                    return edge_pb2.Chunk.FromString(data)
                out.frame = memoryview(data)[pos : pos + size]
                pos += size
    except Exception:  # noqa: BLE001 - whatever went wrong, protobuf decides
        return edge_pb2.Chunk.FromString(data)
    return out
