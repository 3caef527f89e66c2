"""Byte splitting: the fixed-width buffers of an Arrow IPC stream, their bytes transposed.

zstd-1 on int32 token ids was most of an edge node's staging CPU, and the
ids' bytes are the reason: in ``[b0 b1 b2 b3][b0 b1 b2 b3]…`` the high bytes
(almost always 0 for a 50k vocabulary) sit between the low ones, so zstd sees
short, broken matches everywhere. Split each value's bytes into streams —
all the b0s, then all the b1s, … (what Blosc calls *shuffle* and Parquet
``BYTE_STREAM_SPLIT``) — and the high streams become long runs of zeros that
zstd passes over at memory speed, while the low ones compress as their own
distribution. Measured on token ids (``bench.codec_store``): about 3× less
compression CPU, ratio 3.3 instead of 2.5, and zstd also decompresses the
split bytes about twice as fast, which pays for joining the bytes back.

Only the buffers whose element width is known are split (primitive data,
list and string offsets, dictionary indices; 2, 4 or 8 bytes); metadata,
validity bitmaps, strings' bytes and anything of a width 1 stay as they are.
Which byte ranges were split, and how wide their elements are, is written
down explicitly (:func:`pack_regions`): decoding never has to guess the
layout from the Arrow types, so a type this module does not know is merely
left unsplit, never decoded wrongly.

A byte stream that holds one value throughout (the high bytes of token ids
under 65,536, of small labels, of offsets) is not stored at all: the table
records its value. That halves what is split, compressed, decompressed and
joined for token ids, and is what makes decoding faster than plain zstd
rather than merely as fast: joining is the costly step here.

numpy does the transposes (its loops release the GIL, so readers still decode
chunks on several threads): splitting shifts whole words right and casts them
to bytes, joining shifts them left and ORs them together, both on 2-, 4- or
8-byte integers, where numpy's strided copies of every width-th byte are 2-3×
slower.
Constant streams are found with an OR and an AND reduction (~25 GB/s).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from edgecache.cache import recycled
from edgecache.cache.errors import ChunkCorrupt

__all__ = [
    "Region",
    "Span",
    "join",
    "pack_regions",
    "spans_of",
    "split",
    "stored_length",
    "unpack_regions",
]

Span = tuple[int, int, int]  # (offset, length, width): bytes [offset, offset + length)
WIDTHS = (2, 4, 8)
MIN_REGION_BYTES = 256  # smaller buffers gain nothing worth a table entry
# Splitting costs a copy of the whole stream both ways (the bytes between regions too):
# below this share of the stream in regions (images with their offsets) it is not done.
MIN_SHARE = 1 / 8
_COUNT = struct.Struct("<I")
_ENTRY = struct.Struct("<QQBBQ")  # offset, length, width, constant-stream mask, their bytes
_WORDS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class Region(NamedTuple):
    """One split byte range: ``length`` bytes at ``offset`` of elements ``width`` bytes wide.

    Bit k of ``constant`` set: byte k of every element is byte k of ``values``
    (little-endian), and that stream is not stored. The stored streams follow
    each other in byte order, ``length // width`` bytes each.
    """

    offset: int
    length: int
    width: int
    constant: int = 0
    values: int = 0

    @property
    def stored(self) -> int:
        """Bytes of this region in the split data."""
        return (self.width - self.constant.bit_count()) * (self.length // self.width)


def _widths(kind: pa.DataType) -> list[int] | None:
    """Element width of each buffer, in ``Array.buffers()`` order; 0 = leave as is.

    None when the layout is not known here (views, unions, run-end encoded):
    the column is then left whole.
    """
    t = pa.types
    if isinstance(kind, pa.ExtensionType):
        return _widths(kind.storage_type)
    if t.is_null(kind):
        return [0]
    if t.is_boolean(kind) or t.is_fixed_size_binary(kind) or t.is_decimal(kind):
        return [0, 0]
    if t.is_dictionary(kind):
        return [0, kind.index_type.bit_width // 8]
    if t.is_string(kind) or t.is_binary(kind):
        return [0, 4, 0]
    if t.is_large_string(kind) or t.is_large_binary(kind):
        return [0, 8, 0]
    if t.is_fixed_size_list(kind):
        return _nested([0], [kind.value_type])
    if t.is_map(kind):
        return _nested([0, 4, 0], [kind.key_type, kind.item_type])
    if t.is_list(kind):
        return _nested([0, 4], [kind.value_type])
    if t.is_large_list(kind):
        return _nested([0, 8], [kind.value_type])
    if t.is_struct(kind):
        return _nested([0], [kind.field(i).type for i in range(kind.num_fields)])
    if t.is_integer(kind) or t.is_floating(kind) or t.is_temporal(kind):
        try:
            width = kind.bit_width // 8
        except ValueError:  # e.g. month_day_nano intervals
            return None
        return [0, width if width in WIDTHS else 0]
    return None


def _nested(own: list[int], children: Sequence[pa.DataType]) -> list[int] | None:
    out = list(own)
    for child in children:
        widths = _widths(child)
        if widths is None:
            return None
        out += widths
    return out


def spans_of(stream: pa.Buffer) -> list[Span]:
    """The byte ranges of ``stream`` (one Arrow IPC stream, one batch) worth splitting.

    The stream is read back zero-copy, so each buffer's place in it is its
    address minus the stream's. Ranges are sorted and never overlap; none when
    they would be less than :data:`MIN_SHARE` of the stream.
    """
    batch = pa.ipc.open_stream(stream).read_next_batch()
    base, end = stream.address, stream.size
    found: list[Span] = []
    for column in batch.columns:
        buffers = column.buffers()
        widths = _widths(column.type)
        if widths is None or len(widths) != len(buffers):
            continue
        for buffer, width in zip(buffers, widths, strict=True):
            if buffer is None or width < 2:
                continue
            offset = buffer.address - base
            length = buffer.size - buffer.size % width
            if length >= MIN_REGION_BYTES and 0 <= offset and offset + length <= end:
                found.append((offset, length, width))
    found.sort()
    kept: list[Span] = []
    for span in found:  # IPC writes each buffer once; never trust that blindly
        if not kept or span[0] >= kept[-1][0] + kept[-1][1]:
            kept.append(span)
    if sum(length for _, length, _ in kept) < MIN_SHARE * end:
        return []
    return kept


def _constant_streams(elements: np.ndarray, width: int) -> tuple[int, int]:
    """(mask, values) of the byte streams that hold one value in every element."""
    words = elements.view(_WORDS[width])
    ones = int(np.bitwise_or.reduce(words))
    zeros = int(np.bitwise_and.reduce(words))
    mask = values = 0
    for k in range(width):
        byte = (ones >> 8 * k) & 0xFF
        if byte == (zeros >> 8 * k) & 0xFF:  # the OR and the AND agree: one value only
            mask |= 1 << k
            values |= byte << 8 * k
    return mask, values


def split(stream: pa.Buffer, spans: Sequence[Span]) -> tuple[pa.Buffer, list[Region]]:
    """``stream`` with each span's element bytes split into streams, constant ones left out.

    Returns the split data (shorter than ``stream`` by the streams left out)
    and the regions that describe it.
    """
    if not spans:
        return stream, []
    src = np.frombuffer(stream, np.uint8)
    regions = []
    for offset, length, width in spans:
        elements = src[offset : offset + length]
        mask, values = _constant_streams(elements, width)
        regions.append(Region(offset, length, width, mask, values))
    out = pa.allocate_buffer(stored_length(regions, stream.size))  # Arrow's pool reuses it
    dst = np.frombuffer(out, np.uint8)
    done = at = 0
    for r in regions:
        gap = r.offset - done
        dst[at : at + gap] = src[done : r.offset]
        at += gap
        _split_one(src[r.offset : r.offset + r.length], dst[at : at + r.stored], r)
        at += r.stored
        done = r.offset + r.length
    dst[at:] = src[done:]
    return out, regions


def _split_one(elements: np.ndarray, dst: np.ndarray, region: Region) -> None:
    # Stream k is each word shifted right by 8k and cast to uint8 (the cast keeps the low
    # byte): whole-word passes numpy vectorises, 2-3x the speed of gathering every width-th
    # byte with a strided copy. The shifted words go to one scratch array from Arrow's pool
    # (which reuses it: a fresh numpy array per call costs page faults), only as wide as
    # the highest stored byte needs (token ids under 65,536: 2 bytes, not 4).
    kept = [k for k in range(region.width) if not region.constant >> k & 1]
    words = elements.view(_WORDS[region.width])
    count = len(words)
    scratch: np.ndarray | None = None
    by = 0
    for i, k in enumerate(kept):
        out = dst[i * count : (i + 1) * count]
        if not k:
            np.copyto(out, words, casting="unsafe")
            continue
        if scratch is None:
            narrow = next(w for w in WIDTHS if w > kept[-1] - k)
            scratch = np.frombuffer(pa.allocate_buffer(count * narrow), _WORDS[narrow])
            np.right_shift(words, 8 * k, out=scratch, casting="unsafe")
        else:
            np.right_shift(scratch, 8 * (k - by), out=scratch)
        by = k
        np.copyto(out, scratch, casting="unsafe")


def stored_length(regions: Sequence[Region], raw_len: int) -> int:
    """Bytes of split data that ``regions`` describe for ``raw_len`` bytes of stream."""
    return raw_len - sum(r.length - r.stored for r in regions)


def join(data: pa.Buffer, regions: Sequence[Region], raw_len: int) -> pa.Buffer:
    """Undo :func:`split`: the ``raw_len`` bytes of stream, in a new buffer."""
    if not regions:
        return data
    dst, out = recycled.buffers.allocate(raw_len)
    src = np.frombuffer(data, np.uint8)
    done = at = 0
    for r in regions:
        gap = r.offset - done
        dst[done : r.offset] = src[at : at + gap]
        at += gap
        _join_one(src[at : at + r.stored], dst[r.offset : r.offset + r.length], r)
        at += r.stored
        done = r.offset + r.length
    dst[done:] = src[at:]
    return out


def _join_one(stored: np.ndarray, dst: np.ndarray, region: Region) -> None:
    # Little-endian words: byte k of each element is stream k shifted left by 8k. The
    # stored streams are contiguous rows, so each step is one vectorised pass; a
    # constant stream costs nothing unless it is non-zero (then one OR at the end).
    words = dst.view(_WORDS[region.width])
    kept = [k for k in range(region.width) if not region.constant >> k & 1]
    streams = stored.reshape(len(kept), -1) if kept else stored
    if not kept:
        words.fill(region.values)
        return
    above = kept[-1]
    np.copyto(words, streams[-1], casting="unsafe")
    for row, k in zip(range(len(kept) - 2, -1, -1), reversed(kept[:-1]), strict=True):
        words <<= 8 * (above - k)
        words |= streams[row]
        above = k
    if above:
        words <<= 8 * above
    if region.values:
        words |= region.values


def pack_regions(regions: Sequence[Region]) -> bytes:
    """The regions table as stored in a frame's payload, before the zstd data."""
    return _COUNT.pack(len(regions)) + b"".join(_ENTRY.pack(*r) for r in regions)


def unpack_regions(payload: memoryview, raw_len: int) -> tuple[list[Region], int]:
    """Parse and check a regions table; returns it and its size in bytes.

    A table that does not describe sorted, disjoint ranges of whole 2-, 4- or
    8-byte elements inside the ``raw_len`` decoded bytes, with constants only
    for streams it marks constant, raises :class:`ChunkCorrupt` before
    anything is decompressed.
    """
    if len(payload) < _COUNT.size:
        raise ChunkCorrupt("byte-split payload is shorter than its regions table")
    (count,) = _COUNT.unpack_from(payload)
    size = _COUNT.size + count * _ENTRY.size
    if size > len(payload):
        raise ChunkCorrupt(
            f"byte-split payload lists {count} regions, more than its {len(payload)} bytes hold; "
            "the entry is damaged — drop it and fetch the shard again"
        )
    regions: list[Region] = []
    done = 0
    for entry in _ENTRY.iter_unpack(payload[_COUNT.size : size]):
        r = Region(*entry)
        if (
            r.width not in WIDTHS
            or r.length == 0
            or r.length % r.width
            or r.offset < done
            or r.offset + r.length > raw_len
            or r.constant >> r.width
            or r.values & ~_bytes_of(r.constant)
        ):
            raise ChunkCorrupt(
                f"byte-split region {tuple(r)} is not a range of whole 2-, 4- or 8-byte "
                f"elements after the last one inside {raw_len} bytes with constants for its "
                "constant streams only; the entry is damaged — drop it and fetch the shard again"
            )
        regions.append(r)
        done = r.offset + r.length
    return regions, size


def _bytes_of(mask: int) -> int:
    """The bits of the bytes that ``mask`` marks (bit k set: byte k, 0xFF << 8k)."""
    return sum(0xFF << 8 * k for k in range(8) if mask >> k & 1)
