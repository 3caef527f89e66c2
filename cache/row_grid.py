"""Where a shard's chunks and a reader's shuffle windows begin: one rule for both sides.

A reader decodes whole chunks, and an EdgeDataset shuffles within windows of
consecutive rows that it reads and decodes at once. When a window straddles
two chunks, both are decoded and held while the window is open: twice the
memory per open window, and every batch gathers from twice as many chunks.
With rows of a fixed width (token ids, fixed-shape tensors, numbers) the
decoded size of a row is known from the schema alone, so the encoder cuts
every shard into chunks of exactly :func:`rows_per_window` rows from its
first row, and the reader — which knows only the manifest — cuts its windows
on the same grid: each window is one chunk.

Rows of variable width (strings, binary, lists) have no such size; both
sides then take the same estimate from the manifest (:func:`row_bytes`), so
their grids agree too, and a chunk's bytes follow its rows' real size (a
chunk is closed early, off the grid, only at several times ``chunk_bytes``:
the reader then shares the chunk across a window edge with the neighbouring
window).
"""

from __future__ import annotations

import math

import pyarrow as pa

from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "chunk_rows",
    "fixed_row_bytes",
    "row_bytes",
    "rows_per_window",
    "version_chunk_bytes",
]

DEFAULT_CHUNK_BYTES = 4 << 20  # a version's chunk_bytes when its spec leaves it unset

MAX_WINDOW_ROWS = 1 << 20


def fixed_row_bytes(schema: pa.Schema) -> float | None:
    """Decoded bytes of one row when every column has a fixed width; None otherwise.

    Validity bitmaps are left out (a column may or may not have one), and a
    boolean counts as the bit it is.
    """
    bits = sum((_fixed_bits(field.type) for field in schema), start=0)
    return bits / 8 if bits > 0 else None  # NaN > 0 is False


def _fixed_bits(kind: pa.DataType) -> float:
    """Bits per value of ``kind``; NaN (which poisons any sum) when it has no fixed width."""
    if isinstance(kind, pa.ExtensionType):
        return _fixed_bits(kind.storage_type)
    if pa.types.is_fixed_size_list(kind):
        return kind.list_size * _fixed_bits(kind.value_type)
    if pa.types.is_struct(kind):
        return sum((_fixed_bits(kind.field(i).type) for i in range(kind.num_fields)), start=0)
    if pa.types.is_null(kind):
        return 0
    fixed = (
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_temporal(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_fixed_size_binary(kind)
        or pa.types.is_decimal(kind)
    )
    if not fixed:
        return math.nan
    try:
        return kind.bit_width
    except ValueError:  # e.g. month_day_nano intervals
        return math.nan


def rows_per_window(row_bytes: float, window_bytes: int) -> int:
    """Rows in a window (or chunk) of about ``window_bytes`` for rows of ``row_bytes``."""
    return int(min(max(window_bytes // max(row_bytes, 1.0), 1), MAX_WINDOW_ROWS))


def row_bytes(manifest: pb.Manifest, schema: pa.Schema) -> float:
    """Decoded bytes per row: exact for fixed-width schemas, estimated from the manifest otherwise.

    The estimate is the version's source bytes per row times 1.5 (columnar
    sources are often compressed about 2x; raw binary not at all); it decides
    only where chunks and windows are cut, never what they hold.
    """
    exact = fixed_row_bytes(schema)
    if exact is not None:
        return exact
    rows = sum(s.row_count for s in manifest.shards) or 1
    return 1.5 * sum(s.source_size for s in manifest.shards) / rows


def version_chunk_bytes(manifest: pb.Manifest) -> int:
    """The decoded bytes a chunk of the version aims at (its spec's, else the default)."""
    return manifest.preprocess.chunk_bytes or DEFAULT_CHUNK_BYTES


def chunk_rows(manifest: pb.Manifest, schema: pa.Schema) -> int:
    """Rows per chunk of the version: the grid its readers' default windows lie on."""
    return rows_per_window(row_bytes(manifest, schema), version_chunk_bytes(manifest))
