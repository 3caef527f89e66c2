"""The preprocessing pipeline: parse, transform, conform to the version's schema.

Edge nodes run :func:`preprocess` once per shard, in a worker thread, before
encoding the batches into cached chunks; publish runs :func:`describe` to
record a shard's schema and row count without keeping the data.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.formats import FIX, guarded, open_source, read_source
from edgecache.cache.preprocess.transforms import (
    cast_column,
    column_index,
    is_builtin,
    load_transform,
)
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["describe", "preprocess"]


def _transformed(
    batches: Iterator[pa.RecordBatch], spec: pb.PreprocessSpec, source: str
) -> Iterator[pa.RecordBatch]:
    name = spec.transform or "identity"
    transform = load_transform(name, spec.params)
    for batch in batches:
        try:
            out = transform(batch)
        except MalformedShard as exc:
            raise MalformedShard(f"{source}: transform {name!r}: {exc}; {FIX}") from exc
        except pa.ArrowException as exc:
            raise MalformedShard(f"{source}: transform {name!r} failed: {exc}; {FIX}") from exc
        if not isinstance(out, pa.RecordBatch):
            raise TypeError(f"transform {name!r} returned {type(out).__name__}, not a RecordBatch")
        yield out


def _conform(batch: pa.RecordBatch, schema: pa.Schema, source: str) -> pa.RecordBatch:
    arrays = []
    for field in schema:
        try:
            arr = cast_column(
                batch, column_index(batch, field.name, "in the version's schema"), field.type
            )
        except MalformedShard as exc:
            raise MalformedShard(f"{source}: {exc}; {FIX}") from exc
        if not field.nullable and arr.null_count:
            raise MalformedShard(
                f"{source}: column {field.name!r} has {arr.null_count} nulls but the version's "
                f"schema says it is not nullable; {FIX}"
            )
        arrays.append(arr)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def preprocess(
    data: bytes | memoryview,
    *,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    spec: pb.PreprocessSpec,
    schema: pa.Schema | None = None,
    batch_rows: int = 65536,
) -> Iterator[pa.RecordBatch]:
    """Parse, transform and conform one raw object; yields non-empty batches.

    Args:
        data: the whole raw object.
        fmt: its source format.
        source: its URL or key, named in every error.
        spec: the version's preprocessing spec (an empty transform name means identity).
        schema: when given, every batch is made to have exactly this schema: columns
            selected and ordered by name (extras dropped) and safely cast.
        batch_rows: the most rows per batch.

    Raises:
        MalformedShard: the object cannot be parsed, transformed or conformed.
        UnknownTransform: the spec names no known transform.
    """
    for batch in _transformed(
        read_source(data, fmt=fmt, source=source, batch_rows=batch_rows), spec, source
    ):
        if batch.num_rows:
            yield batch if schema is None else _conform(batch, schema, source)


def describe(
    data: bytes | memoryview,
    *,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    spec: pb.PreprocessSpec,
) -> tuple[pa.Schema, int]:
    """Return what publish records for one object: the transformed schema and the row count.

    Parquet with a built-in transform (which keeps every row) reads only the
    footer; anything else is parsed and transformed in full.

    Raises:
        MalformedShard: as :func:`preprocess`.
    """
    schema, batches, known_rows = open_source(data, fmt, source, 65536)
    empty = pa.RecordBatch.from_pylist([], schema=schema)
    if known_rows is not None and is_builtin(spec.transform):
        return next(_transformed(iter([empty]), spec, source)).schema, known_rows
    result: pa.Schema | None = None
    rows = 0
    for out in _transformed(guarded(batches, source), spec, source):
        result, rows = result or out.schema, rows + out.num_rows
    if result is None:
        result = next(_transformed(iter([empty]), spec, source)).schema
    return result, rows
