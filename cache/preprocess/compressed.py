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
import lzma
import zlib

import zstandard

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.fixes import FIX

__all__ = ["COMPRESSIONS", "SUFFIXES", "compression_of", "decompress", "strip_suffix"]

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


def decompress(data: bytes | memoryview, source: str) -> tuple[bytes | memoryview, str | None]:
    """``data`` decompressed when it is gzip/zstd/bz2/xz, else unchanged; and which it was.

    Concatenated members/frames (``cat a.gz b.gz``, pzstd output) are read whole.

    Raises:
        MalformedShard: the object is truncated or damaged, naming it and the compression.
    """
    kind = compression_of(memoryview(data)[:10])
    if kind is None:
        return data, None
    try:
        if kind == "gzip":
            return gzip.decompress(data), kind
        if kind == "zstd":
            reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
            with reader:
                return reader.readall(), kind
        if kind == "bz2":
            return bz2.decompress(data), kind
        return lzma.decompress(data, format=lzma.FORMAT_XZ), kind
    except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError, zstandard.ZstdError) as exc:
        raise MalformedShard(
            f"{source} looks {kind}-compressed but cannot be decompressed ({exc}); "
            f"it may be truncated; {FIX}"
        ) from exc
