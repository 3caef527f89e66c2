"""The preprocessing pipeline: parse, transform, conform to the version's schema.

Edge nodes run :func:`preprocess` once per shard, on a preprocessing thread,
before encoding the batches into cached chunks; publish runs :func:`describe`
to record a shard's schema and row count without keeping the data. Both take
the version's spec as the manifest records it: transform, params, and the
source reader's options.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from typing import NamedTuple

import pyarrow as pa

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.context import ShardContext, using
from edgecache.cache.preprocess.fixes import (
    COLUMN_FIX,
    FIX,
    PARAM_FIX,
    MissingColumn,
    ParamMismatch,
)
from edgecache.cache.preprocess.formats import guarded, open_source
from edgecache.cache.preprocess.nulls import batch_nulls, carried, parquet_nulls
from edgecache.cache.preprocess.partitions import (
    add_partitions,
    partition_fields,
    partition_scalars,
    reader_options,
)
from edgecache.cache.preprocess.transforms import (
    Transform,
    cast_column,
    column_index,
    keeps_rows,
    load_transform,
)
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["Description", "ShardContext", "describe", "preprocess", "survey"]


def _sliced(batches: Iterator[pa.RecordBatch], rows: int | None) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        if rows is None or batch.num_rows <= rows:
            yield batch
            continue
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)


class _ReaderFailed(Exception):
    """A reader's MalformedShard, carried through the transform so it is not labelled its."""

    def __init__(self, error: MalformedShard) -> None:
        super().__init__(str(error))
        self.error = error


def _transformed(
    batches: Iterator[pa.RecordBatch],
    spec: pb.PreprocessSpec,
    context: ShardContext,
    transform: Transform | None = None,
    resources: Mapping[str, bytes] | None = None,
) -> Iterator[pa.RecordBatch]:
    name = spec.transform or "identity"
    if transform is None:
        transform = load_transform(name, spec.params, resources)
    source = context.source

    def counted(inputs: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        rows = 0
        sliced = _sliced(inputs, getattr(transform, "batch_rows", None))
        while True:
            try:  # readers parse lazily: their errors surface here, inside the transform
                batch = next(sliced)
            except StopIteration:
                return
            except MalformedShard as exc:
                raise _ReaderFailed(exc) from exc
            context.first_row = rows
            rows += batch.num_rows
            yield batch

    stream = getattr(transform, "stream", None)
    outputs: Iterator[pa.RecordBatch]
    if stream is not None:
        outputs = stream(counted(batches))
    else:
        outputs = (transform(batch) for batch in counted(batches))
    while True:
        try:
            with using(context):
                out = next(outputs)
        except StopIteration:
            return
        except _ReaderFailed as failed:  # the reader's own error, its advice included
            raise failed.error from failed.error.__cause__
        except MalformedShard as exc:
            message = str(exc)
            where = "" if message.startswith(source) else f"{source}: "
            fix = (
                COLUMN_FIX
                if isinstance(exc, MissingColumn)
                else PARAM_FIX
                if isinstance(exc, ParamMismatch)
                else FIX
            )
            raise MalformedShard(f"{where}transform {name!r}: {message}; {fix}") from exc
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
    transform: Transform | None = None,
    resources: Mapping[str, bytes] | None = None,
    context: ShardContext | None = None,
    pool: Executor | None = None,
    key: str | None = None,
) -> Iterator[pa.RecordBatch]:
    """Parse, transform and conform one raw object; yields non-empty batches.

    A version that records Hive partitions (``hive_partitions`` in its source
    options, see :mod:`.partitions`) gets one constant column per partition
    after the transform's columns, its value read from ``key``'s folders.

    Args:
        data: the whole raw object (compressed or not).
        fmt: its source format.
        source: its URL or key, named in every error.
        spec: the version's preprocessing spec (an empty transform name means identity;
            ``source_options`` are the reader's options).
        schema: when given, every batch is made to have exactly this schema: columns
            selected and ordered by name (extras dropped) and safely cast.
        batch_rows: the most rows per batch read from the source.
        transform: the spec's transform, already built (a node builds it once per version).
        resources: the files the transform needs (see ``resource_refs``), when not built.
        context: receives the skipped-sample tally; a new one when None.
        pool: threads for the parts of a batch (images, text slices); never the pool
            this call itself runs on.
        key: the object's key under the version's source prefix (the shard's
            ``source_key``); required when the spec records Hive partitions.

    Raises:
        MalformedShard: the object cannot be parsed, transformed or conformed.
        UnknownTransform: the spec names no known transform.
    """
    context = context or ShardContext()
    context.source, context.pool = source, pool
    fields, values = _partitions(spec, key, source)
    # Not strict: the version's objects passed publish's checks, or were published before them.
    options = reader_options(spec.source_options)
    _, batches, _ = open_source(data, fmt, source, batch_rows, options, strict=False)
    for batch in _transformed(guarded(batches, source), spec, context, transform, resources):
        if batch.num_rows:
            batch = add_partitions(batch, fields, values)
            yield batch if schema is None else _conform(batch, schema, source)


def _partitions(
    spec: pb.PreprocessSpec, key: str | None, source: str
) -> tuple[list[pa.Field], list[pa.Scalar]]:
    """The partition columns the spec records, and their values for the object at ``key``."""
    try:
        fields = partition_fields(spec.source_options)
    except ValueError as exc:
        raise MalformedShard(f"{source}: {exc}") from exc
    if not fields:
        return [], []
    if key is None:
        raise ValueError(f"{source}: the version records Hive partitions; pass the shard's key")
    return fields, partition_scalars(fields, key, source)


class Description(NamedTuple):
    """What publish learns of one object: its schema and rows after the transform, and nulls.

    ``nulls``: null values per column that becomes a tensor in EdgeDataset (see
    :mod:`.nulls`), only those with any; None where the object was not looked at
    closely enough to say (a tar or an MDS shard counted from its headers or index,
    a Parquet footer under a transform it cannot follow).
    """

    schema: pa.Schema
    rows: int
    nulls: dict[str, int] | None
    skipped: int = 0  # samples the transform dropped (images' on_error=skip)
    notes: tuple[str, ...] = ()  # the first of them, named, and why


def describe(
    data: bytes | memoryview,
    *,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    spec: pb.PreprocessSpec,
    transform: Transform | None = None,
    resources: Mapping[str, bytes] | None = None,
    context: ShardContext | None = None,
) -> tuple[pa.Schema, int]:
    """Return what publish records for one object: the transformed schema and the row count.

    When the format knows its row count without decoding (Parquet's footer, a
    tar's member headers, an MDS shard's header) and the transform keeps every
    row, nothing is decoded (a tar is still read whole: its headers lie
    throughout it); anything else is parsed and transformed in full.
    Hive partition columns are not part of it: publish adds them from the keys.

    Raises:
        MalformedShard: as :func:`preprocess`.
    """
    found = survey(
        data,
        fmt=fmt,
        source=source,
        spec=spec,
        transform=transform,
        resources=resources,
        context=context,
    )
    return found.schema, found.rows


def survey(
    data: bytes | memoryview,
    *,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    spec: pb.PreprocessSpec,
    transform: Transform | None = None,
    resources: Mapping[str, bytes] | None = None,
    context: ShardContext | None = None,
) -> Description:
    """:func:`describe`, with the nulls of the columns readers make tensors of.

    Counted on the transformed batches when the object is read whole; from a
    Parquet footer's ``null_count`` statistics when only the footer is read (and
    the transform is one whose columns can be traced to the source's, see
    :func:`.nulls.carried`); not at all (None) otherwise.
    """
    context = context or ShardContext()
    context.source = source
    options = reader_options(spec.source_options)
    schema, batches, known_rows = open_source(data, fmt, source, 65536, options)
    if transform is None:
        transform = load_transform(spec.transform or "identity", spec.params, resources)
    empty = pa.RecordBatch.from_pylist([], schema=schema)

    def schema_of_nothing() -> pa.Schema:
        for out in _transformed(iter([empty]), spec, context, transform):
            return out.schema
        return transform.schema  # type: ignore[attr-defined] # a stream transform says it

    if known_rows is not None and keeps_rows(spec.transform, spec.params):
        result = schema_of_nothing()
        if fmt == pb.SOURCE_FORMAT_WEBDATASET and spec.transform == "images":
            _every_sample_has_its_image(batches, spec.params, source)
        nulls = None
        if fmt == pb.SOURCE_FORMAT_PARQUET:
            counts = parquet_nulls(data, schema)
            nulls = carried(counts, spec.transform, spec.params, schema, result)
        return Description(result, known_rows, nulls)
    found: pa.Schema | None = None
    rows = 0
    tally: dict[str, int] = {}
    for out in _transformed(guarded(batches, source), spec, context, transform):
        found, rows = found or out.schema, rows + out.num_rows
        for name, count in batch_nulls(out).items():
            tally[name] = tally.get(name, 0) + count
    schema = found or schema_of_nothing()
    return Description(schema, rows, tally, context.skipped, tuple(context.notes))


def _every_sample_has_its_image(
    batches: Iterator[pa.RecordBatch], params: Mapping[str, str], source: str
) -> None:
    """Refuse a tar where some samples lack the member ``images`` decodes (``column``).

    Publish counts a tar's rows from its headers and decodes nothing, so tars
    mixing ``.jpg`` and ``.png`` samples published with ``column=jpg`` used to
    exit 0 and fail every staging on the ``png`` samples' null ``jpg``. The tar
    is read whole anyway: its samples are checked here, from the headers' keys.
    """
    import pyarrow.compute as pc

    column = params.get("column")
    missing: list[str] = []
    count = 0
    others: set[str] = set()
    for batch in batches:
        if column is None:
            # The transform's default, the only binary column (its own check refused
            # several or none before this runs): a sample lacking it fails the same way.
            binary = [f.name for f in batch.schema if pa.types.is_binary(f.type)]
            if len(binary) != 1:
                return
            column = binary[0]
        if column not in batch.schema.names or "__key__" not in batch.schema.names:
            return  # the transform itself names a missing or ambiguous column
        values = batch.column(column)
        if not values.null_count:
            continue
        lacking = pc.is_null(values)
        count += values.null_count
        missing += batch.column("__key__").filter(lacking).to_pylist()[: 5 - len(missing)]
        for field in batch.schema:
            if field.name == column or not pa.types.is_binary(field.type):
                continue
            if batch.column(field.name).filter(lacking).null_count < values.null_count:
                others.add(field.name)  # what those samples hold instead: png
    if not count:
        return
    listed = ", ".join(missing) + (
        f" and {count - len(missing)} more" if count > len(missing) else ""
    )
    have = f" (they hold {', '.join(sorted(others))})" if others else ""
    # Only the other image extensions: renaming every member's ('s/[.][^.]*$/.jpg/')
    # named each sample's label .jpg too, and the repacked tar was refused for two .jpg.
    rename = " ".join(
        f"--transform 's/[.]{re.escape(other)}$/.{column}/'" for other in sorted(others)
    )
    example = f", e.g. with GNU tar's {rename}" if others else ""
    raise ParamMismatch(
        f"{source}: {count} sample{'s' if count != 1 else ''} ({listed}) "
        f"{'have' if count != 1 else 'has'} no .{column} member{have}, and the images "
        f"transform decodes column={column} alone: each staging would fail on them. Give "
        f"every image one extension (repack with the members named KEY.{column}: the image "
        f"bytes are decoded whatever their format{example}), "
        "or publish each extension's samples as a version of "
        "their own, or pass --param on_error=skip to drop the samples without it"
    )
