"""Helpers for store tests: encoded shards and on-disk bit flips."""

from __future__ import annotations

import mmap
from pathlib import Path

from datagen import TOKEN_SCHEMA, token_batch

from edgecache.cache.codec import CodecOptions, encode_shard


def shard_frames(rows: int = 2000, *, seed: int = 0, chunk_bytes: int = 64 << 10) -> list[bytes]:
    """An encoded token shard (about 260 bytes a row before compression)."""
    return encode_shard(
        [token_batch(rows, seed=seed)], TOKEN_SCHEMA, CodecOptions(chunk_bytes=chunk_bytes)
    )


def flip_on_disk(cache_dir: Path, needle: bytes, offset: int, bit: int = 0) -> None:
    """Flip one bit of the LMDB file at ``offset`` bytes into the first copy of ``needle``.

    This is real bit rot: the bytes change under LMDB, which does not checksum values.
    Pass the whole stored value as ``needle``: with ``meminit=False`` LMDB pads pages
    with stale heap bytes, so a short prefix of a value can also appear in padding.
    """
    path = cache_dir / "data.mdb"
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        at = m.find(needle)
        assert at >= 0, "value not found in data.mdb"
        assert m.find(needle, at + 1) < 0, "value found twice in data.mdb"
        m[at + offset] ^= 1 << bit
        m.flush()
