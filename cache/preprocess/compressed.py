"""Compressed source objects (gzip, zstd, bz2, xz), read transparently.

Text corpora ship as ``.jsonl.gz`` and ``.jsonl.zst``, tables as ``.csv.gz``;
a user should not have to unpack a prefix before publishing it. An object is
recognised by its magic bytes, never by its name alone, so a misnamed object
is still read right, and the name only helps guess the format underneath
(``part-0.csv.gz`` is CSV). Parquet, Arrow IPC and tar magic never collide
with these. Every decompressor used releases the GIL on large inputs, so
several shards decompress on several cores.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zlib
from typing import Protocol

import zstandard

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess import limits
from edgecache.cache.preprocess.fixes import FIX
from edgecache.cache.units import format_bytes

__all__ = [
    "COMPRESSIONS",
    "SUFFIXES",
    "compression_of",
    "decompress",
    "misnamed",
    "strip_suffix",
]

# name → (magic bytes at offset 0, file name suffixes)
COMPRESSIONS: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "gzip": (b"\x1f\x8b", (".gz", ".gzip")),
    "zstd": (b"\x28\xb5\x2f\xfd", (".zst", ".zstd")),
    "bz2": (b"BZh", (".bz2",)),
    "xz": (b"\xfd7zXZ\x00", (".xz",)),
}
SUFFIXES = {suffix: name for name, (_, suffixes) in COMPRESSIONS.items() for suffix in suffixes}


def strip_suffix(name: str) -> str:
    """``part-0.csv.gz`` → ``part-0.csv``: the name the format is told from."""
    lower = name.lower()
    for suffix in SUFFIXES:
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name


def misnamed(source: str, compression: str | None) -> str | None:
    """What to say of an object whose name says a compression its bytes do not have; else None.

    It is read by its bytes (above), which is right for a file renamed by
    mistake but misleads where the name was right and the object is damaged
    or not what it seems: a ``.csv.gz`` of plain text failed as "one column,
    looks space-separated", a ``.jsonl.zst`` as "not valid JSON", with no word
    that the object was not compressed at all. Said before such an error.
    """
    lower = source.lower()
    named = next((name for suffix, name in SUFFIXES.items() if lower.endswith(suffix)), None)
    if named is None or named == compression:
        return None
    actual = f"{compression}-compressed" if compression else "not compressed at all"
    return (
        f"{source} is named as {named}-compressed but is {actual} (no {named} header), "
        "so it was read as such"
    )


def compression_of(head: bytes | memoryview) -> str | None:
    """The compression whose magic ``head`` starts with; None for an uncompressed object.

    bz2's three magic letters could begin a text file, so its block magic is
    checked too (``BZh`` + a level digit + the pi block or sqrt(pi) end marker).
    """
    start = bytes(head[:10])
    for name, (magic, _) in COMPRESSIONS.items():
        if start.startswith(magic):
            blocks = (b"1AY&SY", b"\x17rE8P\x90")  # a first block, or the end (empty data)
            if name == "bz2" and not (start[3:4].isdigit() and start[4:10] in blocks):
                continue
            return name
    return None


class _Reader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


_PIECE = 4 << 20  # bytes decompressed per read: small against the limit, large against overhead


def _too_big(source: str, kind: str, what: str, limit: int) -> MalformedShard:
    if limit >= limits.MAX_DECOMPRESSED_BYTES:
        why = "the most a node expands one object to"
    elif limit > limits.MIN_INFLATION_LIMIT:
        why = f"{limits.MAX_INFLATION}x its size, the most a node expands an object of this size to"
    else:  # a small object: the floor, not the ratio (200x a 21 KB object is 4 MB)
        why = "the most a node expands an object of this size to"
    return MalformedShard(
        f"{source} is {kind}-compressed and {what}, more than {format_bytes(limit)} ({why}: "
        f"a decompression bomb, or a shard too large to preprocess whole: split it into "
        f"objects under {format_bytes(limit)} uncompressed); {FIX}"
    )


def _inflation_limit(compressed: int) -> int:
    """The most ``compressed`` bytes may inflate to: a ratio of its size, within bounds."""
    return min(
        limits.MAX_DECOMPRESSED_BYTES,
        max(limits.MIN_INFLATION_LIMIT, limits.MAX_INFLATION * compressed),
    )


def _read_bounded(reader: _Reader, limit: int, source: str, kind: str) -> bytearray:
    """All of ``reader``, refused as soon as it passes ``limit`` bytes (never allocating more)."""
    out = bytearray()
    while piece := reader.read(min(_PIECE, limit + 1 - len(out))):
        out += piece
        if len(out) > limit:
            raise _too_big(source, kind, "inflates past its limit", limit)
    return out


_XZ_MEMLIMIT = 256 << 20  # xz -9e needs 65 MiB; a header may ask liblzma for 4 GiB


class _XzReader:
    """Concatenated xz streams, decoded with a memory limit (``LZMAFile`` takes none).

    An xz block header names its dictionary size, up to 4 GiB, and liblzma
    allocates it before decoding a byte: a 1 KB object asked for 4 GiB here.
    """

    def __init__(self, data: bytes | memoryview) -> None:
        self._rest = bytes(data)
        self._decoder = lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=_XZ_MEMLIMIT)

    def __enter__(self) -> _XzReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._rest = b""

    def read(self, size: int = -1, /) -> bytes:
        while True:
            if self._decoder.eof:  # the next stream (xz files may be concatenated)
                self._rest = self._decoder.unused_data.lstrip(b"\0")  # stream padding
                if not self._rest:
                    return b""
                self._decoder = lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=_XZ_MEMLIMIT)
            elif not self._rest and self._decoder.needs_input:
                raise EOFError("compressed data ended before the end-of-stream marker")
            chunk = self._decoder.decompress(self._rest, max_length=size)
            self._rest = b""
            if chunk:
                return chunk


_SKIPPABLE_MAGIC = 0x184D2A50  # its low 4 bits are free
_ZSTD_MAGIC = 0xFD2FB528


def _zstd_cut_short(data: memoryview) -> str | None:
    """Why ``data`` is not whole zstd frames to its last byte, or None when it is.

    zstandard's stream reader ends quietly where the input ends, mid-frame or
    not: a ``.csv.zst`` cut in half published half its rows, the last one cut
    mid-value. Walking the frames' block headers costs nothing beside decoding
    and finds the cut (the RFC 8878 layout: a header, blocks of 3-byte headers,
    a 4-byte checksum when the header says so; skippable frames carry a size).
    """
    pos, end = 0, len(data)
    while pos < end:
        if end - pos < 8:
            return (
                f"{end - pos} byte(s) follow its last whole frame: a frame cut short in its "
                "header, or data that is not zstd after it"
            )
        magic = int.from_bytes(data[pos : pos + 4], "little")
        if magic & 0xFFFFFFF0 == _SKIPPABLE_MAGIC:
            pos += 8 + int.from_bytes(data[pos + 4 : pos + 8], "little")
            if pos > end:
                return "it ends inside a skippable frame"
            continue
        if magic != _ZSTD_MAGIC:
            return None  # not a frame: the decoder names it ("Unknown frame descriptor")
        checksum = data[pos + 4] & 0x04  # the frame header descriptor's Content_Checksum_flag
        try:
            pos += zstandard.frame_header_size(bytes(data[pos : pos + 18]))
        except zstandard.ZstdError:
            return "it ends inside a frame header"
        if pos > end:
            return "it ends inside a frame header"
        last = False
        while not last:
            if pos + 3 > end:
                return (
                    "it ends before a frame's last block"
                    if pos == end
                    else "it ends inside a block header"
                )
            header = int.from_bytes(data[pos : pos + 3], "little")
            last, kind, size = bool(header & 1), (header >> 1) & 3, header >> 3
            pos += 3 + (1 if kind == 1 else size)
            if pos > end:
                return "it ends inside a block"
        pos += 4 if checksum else 0
        if pos > end:
            return "it ends inside a frame's checksum"
    return None


def _reader(data: bytes | memoryview, kind: str) -> _Reader:
    if kind == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    if kind == "gzip":
        return gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb")
    if kind == "bz2":
        return bz2.BZ2File(io.BytesIO(data), mode="rb")
    return _XzReader(data)


def decompress(data: bytes | memoryview, source: str) -> tuple[bytes | memoryview, str | None]:
    """``data`` decompressed when it is gzip/zstd/bz2/xz, else unchanged; and which it was.

    Concatenated members/frames (``cat a.gz b.gz``, pzstd output) are read whole.
    Output is bounded by :data:`~.limits.MAX_DECOMPRESSED_BYTES`, and by
    :data:`~.limits.MAX_INFLATION` times the object's size past
    :data:`~.limits.MIN_INFLATION_LIMIT`: a few KB can inflate to many GB, and a
    node must not be the one that finds out by running out of memory. A zstd
    frame that declares more is refused before decoding.

    Raises:
        MalformedShard: the object is truncated or damaged, or inflates past the limit,
            naming it and the compression.
    """
    kind = compression_of(memoryview(data)[:10])
    if kind is None:
        return data, None
    limit = _inflation_limit(len(data))
    try:
        if kind == "zstd":
            if (short := _zstd_cut_short(memoryview(data))) is not None:
                raise MalformedShard(
                    f"{source} is zstd-compressed but truncated: {short} "
                    f"({len(data):,} bytes); {FIX}"
                )
            declared = zstandard.frame_content_size(bytes(memoryview(data)[:18]))
            if declared > limit:
                raise _too_big(source, kind, f"its frame declares {declared:,} bytes", limit)
        with _reader(data, kind) as reader:  # type: ignore[attr-defined]
            return memoryview(_read_bounded(reader, limit, source, kind)), kind
    except lzma.LZMAError as exc:
        if "memory usage limit" not in str(exc).lower():
            raise _damaged(source, kind, exc) from exc
        raise MalformedShard(
            f"{source} is xz-compressed with a dictionary larger than the "
            f"{format_bytes(_XZ_MEMLIMIT)} a node decodes with ({exc}); recompress it "
            f"(xz -9 needs 64 MiB) or {FIX}"
        ) from exc
    except (OSError, EOFError, ValueError, zlib.error, zstandard.ZstdError) as exc:
        if isinstance(exc, MalformedShard):
            raise
        raise _damaged(source, kind, exc) from exc


def _damaged(source: str, kind: str, exc: BaseException) -> MalformedShard:
    return MalformedShard(
        f"{source} looks {kind}-compressed but cannot be decompressed ({exc}); "
        f"it may be truncated; {FIX}"
    )
