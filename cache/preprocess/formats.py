"""Source formats: the raw bytes of one origin object → Arrow record batches.

Parquet, JSON Lines, CSV (with reader options, see :mod:`.source_options`),
Arrow IPC (file, stream, Feather), WebDataset tars (:mod:`.webdataset`) and
MosaicML MDS shards (:mod:`.mds`); any of them gzip/zstd/bz2/xz-compressed
(:mod:`.compressed`). Every way an object can be unreadable becomes
:class:`MalformedShard` naming the object (and the line, row or sample where
that can be known).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.feather as pa_feather
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess import limits
from edgecache.cache.preprocess.byte_types import is_text_or_binary
from edgecache.cache.preprocess.compressed import decompress, misnamed, strip_suffix
from edgecache.cache.preprocess.fixes import COLUMN_FIX, FIX, MissingColumn, options_fix
from edgecache.cache.preprocess.mds import mds_source
from edgecache.cache.preprocess.source_options import (
    LONG_INTEGER,
    column_types,
    has_fractions,
    integer_type_hint,
    read_csv,
    rounded_integer_error,
    rounds_in_float,
)
from edgecache.cache.preprocess.webdataset import MEMBER_RULES_OPTION, tar_source
from edgecache.cache.units import format_bytes
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "ARROW_ERRORS",
    "FIX",
    "FORMATS",
    "KIND_NAMES",
    "format_from_key",
    "format_from_name",
    "guarded",
    "open_source",
    "read_source",
]

_P, _J, _C, _A, _W, _M = (
    pb.SOURCE_FORMAT_PARQUET,
    pb.SOURCE_FORMAT_JSONL,
    pb.SOURCE_FORMAT_CSV,
    pb.SOURCE_FORMAT_ARROW_IPC,
    pb.SOURCE_FORMAT_WEBDATASET,
    pb.SOURCE_FORMAT_MDS,
)
FORMATS: Mapping[str, pb.SourceFormat.ValueType] = MappingProxyType(
    {"parquet": _P, "jsonl": _J, "csv": _C, "arrow": _A, "ipc": _A, "feather": _A,
     "webdataset": _W, "wds": _W, "tar": _W, "mds": _M}
)  # fmt: skip
KIND_NAMES: Mapping[pb.SourceFormat.ValueType, str] = MappingProxyType(
    {_P: "Parquet", _J: "JSON Lines", _C: "CSV", _A: "Arrow IPC", _W: "WebDataset", _M: "MDS"}
)
_EXTENSIONS = {f".{ext}": FORMATS[kind] for kind, exts in (("parquet", "parquet pq"),
               ("jsonl", "jsonl ndjson json"), ("csv", "csv tsv"), ("arrow", "arrow ipc feather"),
               ("webdataset", "tar"), ("mds", "mds"))
               for ext in exts.split()}  # fmt: skip
_WHOLE_TABLE_BYTES = 512 << 20  # Parquet shards up to this (uncompressed) are read in one go
_JSON_KINDS = {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
               dict: "object"}  # fmt: skip
ARROW_ERRORS = (pa.ArrowException, OSError, ValueError)


def format_from_name(name: str) -> pb.SourceFormat.ValueType:
    """Return the source format called ``name`` ("parquet", "jsonl", "csv", "arrow", ...).

    Raises:
        ValueError: the name is not one of :data:`FORMATS`.
    """
    try:
        return FORMATS[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown source format {name!r}; use one of: {', '.join(FORMATS)}"
        ) from None


def format_from_key(key: str) -> pb.SourceFormat.ValueType | None:
    """Guess an object's source format from its file extension; None when there is no telling.

    A compression suffix is looked through: ``part-0.csv.gz`` is CSV, and ``.tgz``
    is a gzip-compressed tar (WebDataset), as ``.tar.gz`` is.
    """
    name = strip_suffix(key.rsplit("/", 1)[-1]).lower()
    if name.endswith(".tgz"):
        return _W
    dot = name.rfind(".")
    return _EXTENSIONS.get(name[dot:]) if dot >= 0 else None


def _rebatch(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)


_CULPRIT_LINE_BYTES = 1 << 20  # longer lines are left to pyarrow's own message


def _lines(data: memoryview) -> Iterator[tuple[int, memoryview]]:
    """(number, line) of ``data`` without copying it whole (a shard may be gigabytes)."""
    start, number = 0, 0
    for number, newline in enumerate(re.finditer(rb"\n", data), start=1):  # noqa: B007
        yield number, data[start : newline.start()]
        start = newline.end()
    if start < len(data):
        yield number + 1, data[start:]


def _jsonl_culprit(data: pa.Buffer) -> str | None:
    """Find the first line pyarrow would reject, as 'line N: what is wrong'.

    Python parses each line here, so lines over ``_CULPRIT_LINE_BYTES`` are
    skipped: a 1 GB line of ``[1,1,…]`` would become tens of GB of Python objects.
    """
    kinds: dict[str, tuple[str, int]] = {}
    for number, line in _lines(memoryview(data)):
        if len(line) > _CULPRIT_LINE_BYTES:
            continue
        raw = line.tobytes()
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except UnicodeDecodeError:
            return f"line {number}: not valid UTF-8"
        except json.JSONDecodeError as exc:
            return f"line {number}: not valid JSON ({exc.msg})"
        except RecursionError:
            return f"line {number}: JSON nested too deeply"
        if not isinstance(value, dict):
            return f"line {number}: not a JSON object (each line must be one {{...}} record)"
        for key, item in value.items():
            if item is None:
                continue
            kind = _JSON_KINDS[type(item)]
            seen = kinds.setdefault(key, (kind, number))
            if seen[0] != kind:
                return (
                    f"line {number}: field {key!r} is a {kind} but line {seen[1]} has a {seen[0]}"
                )
    return None


def _json_array(data: pa.Buffer) -> bool:
    """Whether ``data`` is one JSON array (its first character ``[``), not JSON Lines.

    Only the start is looked at: a record per line never starts with ``[``, and a
    JSON array of records is a common export (pandas, Hugging Face ``to_json``).
    """
    head = memoryview(data)[:4096].tobytes().lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


_Path = tuple[str | None, ...]  # field names from the top; None: into a list's items


def _float_paths(kind: pa.DataType, path: _Path) -> Iterator[_Path]:
    """The paths to the float values of a (nested) JSON column type."""
    if pa.types.is_floating(kind):
        yield path
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        yield from _float_paths(kind.value_type, (*path, None))
    elif pa.types.is_struct(kind):
        for i in range(kind.num_fields):
            yield from _float_paths(kind.field(i).type, (*path, kind.field(i).name))


def _values_at(value: object, path: _Path) -> Iterator[object]:
    if not path:
        yield value
    elif path[0] is None:
        for item in value if isinstance(value, list) else ():
            yield from _values_at(item, path[1:])
    elif isinstance(value, dict) and path[0] in value:
        yield from _values_at(value[path[0]], path[1:])


def _path_name(path: _Path) -> str:
    """``a.id``, ``xs[]``: where a value sits, as a person reads it."""
    out = ""
    for step in path:
        out += "[]" if step is None else (f".{step}" if out else step)
    return out


def _typed_at(path: _Path, leaf: str) -> str:
    """The type of ``path``'s top-level column with ``leaf`` at its end: ``list<uint64>``.

    Only the path is spelled: JSON Lines infers the struct fields a type leaves out.
    """
    kind = leaf
    for step in reversed(path[1:]):
        kind = f"list<{kind}>" if step is None else f"struct<{step}: {kind}>"
    return kind


def _leaf_values(table: pa.Table, path: _Path) -> pa.ChunkedArray:
    """Every value at ``path`` in ``table``: struct fields followed, lists flattened."""
    values = table.column(path[0])
    for step in path[1:]:
        values = pc.list_flatten(values) if step is None else pc.struct_field(values, step)
    return values


def _refuse_rounded_integers(
    table: pa.Table, buf: pa.Buffer, source: str, types: Mapping[str, pa.DataType]
) -> None:
    """Refuse JSON Lines integers a float64 column would round: past int64, or past 2**53.

    Such a column is read as float64 beside fractions, and it loses their digits.
    Top-level fields and fields nested in objects and arrays alike; only when a
    float was inferred somewhere (no text is scanned otherwise).
    """
    inferred = [
        path
        for field in table.schema
        if field.name not in types
        for path in _float_paths(field.type, (field.name,))
    ]
    if not inferred:
        return
    for number, line in _lines(memoryview(buf)):
        raw = line.tobytes()
        if not LONG_INTEGER.search(raw):
            continue
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        for path in inferred:
            for value in _values_at(record, path):
                if isinstance(value, int) and rounds_in_float(value):
                    name = _path_name(path)
                    fractions = has_fractions(_leaf_values(table, path))
                    kind = _typed_at(path, integer_type_hint(value, fractions))
                    raise rounded_integer_error(
                        f"{source} line {number}",
                        f"field {name!r}",
                        str(path[0]),
                        value,
                        kind,
                        _typed_at(path, "float64"),
                        fractions=fractions,
                    )


def _read_text(
    buf: pa.Buffer,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    options: Mapping[str, str],
    strict: bool,
) -> pa.Table:
    def parse(block_size: int | None, threads: bool = False) -> pa.Table:
        # Serial readers: a node parses several shards at once, one per core, and threads
        # inside each would only add switching.
        if fmt == _J:
            opts = {"use_threads": threads, **({"block_size": block_size} if block_size else {})}
            types = column_types(options)
            parse = pa_json.ParseOptions(
                explicit_schema=pa.schema(list(types.items())) if types else None,
                unexpected_field_behavior="infer",
            )
            table = pa_json.read_json(
                pa.BufferReader(buf),
                read_options=pa_json.ReadOptions(**opts),
                parse_options=parse,
            )
            # Typed fields come first from explicit_schema: back to the data's order, which
            # publish records. A second parse of the whole object, so only there: a node
            # (strict=False) conforms each batch to the recorded schema by name.
            if types and strict:
                found = pa_json.read_json(
                    pa.BufferReader(buf), read_options=pa_json.ReadOptions(**opts)
                ).column_names
                rest = [n for n in table.column_names if n not in found]
                table = table.select([*found, *rest])
            if strict:
                _refuse_rounded_integers(table, buf, source, types)
            # explicit_schema adds a column of nulls for a name no record has: a typo.
            missing = [
                name
                for name in types
                if table.column(name).null_count == table.num_rows
                and json.dumps(name).encode() not in buf.to_pybytes()
            ]
            if missing:
                raise MissingColumn(
                    f"{source}: column_types names {', '.join(missing)}, but no record has "
                    f"{'it' if len(missing) == 1 else 'them'}; the fields are "
                    f"{', '.join(n for n in table.column_names if n not in missing)}; "
                    f"{COLUMN_FIX}"
                )
            return table
        return read_csv(buf, options, source, threads=threads, block_size=block_size, strict=strict)

    try:
        try:
            return parse(None)
        except pa.ArrowInvalid as exc:
            if "straddl" not in str(exc):
                raise
            return parse(min(buf.size + 1, 2**31 - 1))  # one record longer than a block
    except MalformedShard:
        raise
    except ARROW_ERRORS as exc:
        if fmt == _J:
            if _json_array(buf):
                raise MalformedShard(
                    f"{source} is a JSON array (one document, as to_json(lines=False) writes), "
                    "not JSON Lines (one object per line); convert it to JSON Lines (e.g. "
                    "jq -c '.[]' in.json > out.jsonl, or to_json(lines=True)) and publish that"
                ) from exc
            where = _jsonl_culprit(buf) or f"not valid JSON Lines ({exc})"
            raise MalformedShard(f"{source} {where}; {FIX}") from exc
        try:  # the serial reader reports the row number; the threaded one does not
            parse(min(buf.size + 1, 2**31 - 1), threads=False)
        except ARROW_ERRORS as serial:
            exc = serial
        note = " (rows count the header as row 1)" if "Row #" in str(exc) else ""
        raise MalformedShard(f"{source}: {exc}{note}; {options_fix(options)}") from exc


def _parquet(
    buf: pa.Buffer, batch_rows: int, source: str
) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int]:
    footer = pq.ParquetFile(pa.BufferReader(buf))
    schema = footer.schema_arrow
    # String and binary columns (views too) are read as dictionaries and expanded a slice at
    # a time (see _expanded): one dictionary value repeated on every row made 4 GiB from 293
    # bytes.
    # The footer parsed once serves both opens.
    wide = [f.name for f in schema if is_text_or_binary(f.type)]
    parquet = pq.ParquetFile(pa.BufferReader(buf), metadata=footer.metadata, read_dictionary=wide)
    meta = parquet.metadata
    rows = meta.num_rows
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if size > _WHOLE_TABLE_BYTES:  # stream row groups: bounded memory for huge shards
        batches = parquet.iter_batches(batch_size=batch_rows, use_threads=False)
        return schema, _expanded(batches, schema, source), rows

    def whole() -> Iterator[pa.RecordBatch]:
        # Decoded in the calling thread, when first asked for. pq.read_table costs the
        # same CPU but spends it on Arrow's executor even with use_threads=False, where
        # the node's thread clock missed it: StagingRate then counted encoding alone and
        # promised the planner about twice the preprocessing rate it had.
        table = parquet.read(use_threads=False)
        yield from table.to_batches(max_chunksize=batch_rows)

    return schema, _expanded(whole(), schema, source), rows


def _expanded(
    batches: Iterator[pa.RecordBatch], schema: pa.Schema, source: str
) -> Iterator[pa.RecordBatch]:
    """``batches`` with dictionary columns made plain, in slices of about BATCH_DECODED_BYTES.

    What a row expands to is known before expanding it (the lengths of the values its
    indices pick), so no slice is allocated larger than the budget allows (a row at a
    time at worst), and a shard decoding past MAX_DECODED_BYTES is refused.
    """
    total = 0
    for batch in batches:
        sizes = np.full(batch.num_rows, batch.nbytes // max(batch.num_rows, 1), np.int64)
        for column in batch.columns:
            if pa.types.is_dictionary(column.type):
                picked = pc.binary_length(column.dictionary).take(column.indices)  # null: null
                sizes += picked.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        ends = np.cumsum(sizes)
        if total + int(ends[-1] if len(ends) else 0) > limits.MAX_DECODED_BYTES:
            raise MalformedShard(
                f"{source} decodes to more than {format_bytes(limits.MAX_DECODED_BYTES)} "
                f"(Parquet dictionary values repeated over many rows: a decompression bomb, "
                f"or a shard too large to preprocess whole: split it); {FIX}"
            )
        start = 0
        while start < batch.num_rows:
            before = int(ends[start - 1]) if start else 0
            stop = int(np.searchsorted(ends, before + limits.BATCH_DECODED_BYTES, "right"))
            stop = max(stop, start + 1)
            part = batch.slice(start, stop - start)
            arrays = [_plain(c, f.type) for c, f in zip(part.columns, schema, strict=True)]
            yield pa.RecordBatch.from_arrays(arrays, schema=schema)
            start = stop
        total += int(ends[-1]) if len(ends) else 0


def _plain(column: pa.Array, kind: pa.DataType) -> pa.Array:
    """A column read as a dictionary, as the ``kind`` its schema gives; others as they are."""
    if not pa.types.is_dictionary(column.type):
        return column
    if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):
        # Arrow casts no dictionary to a view type: decode to the plain values first.
        return column.dictionary_decode().cast(kind)
    return column.cast(kind)


def open_source(
    data: bytes | memoryview,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    batch_rows: int,
    options: Mapping[str, str] | None = None,
    *,
    strict: bool = True,
) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int | None]:
    """Parse enough of ``data`` to know its schema (and, where it says, its row count).

    ``strict`` (publish) refuses CSV and JSON Lines objects that parse, but not as
    their writer meant (an aligned table as one column, integers rounded to floats,
    text that is not UTF-8, names over a header); a node staging a version reads it
    without them (``strict=False``): a version published under these rules passed
    them already, and one published before them must still stage as it was recorded.

    ``options`` are the version's reader options (``PreprocessSpec.source_options``).
    A gzip/zstd/bz2/xz-compressed object is decompressed first, whatever its format.
    """
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    options = options or {}
    if len(data) == 0:
        raise MalformedShard(f"{source} is empty (0 bytes); {FIX}")
    data, compression = decompress(data, source)
    try:
        return _open_decompressed(data, fmt, source, batch_rows, options, strict, compression)
    except MalformedShard as exc:
        said = misnamed(source, compression)
        if said is None:
            raise
        raise MalformedShard(f"{said}: {exc}") from exc


def _open_decompressed(
    data: bytes | memoryview,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    batch_rows: int,
    options: Mapping[str, str],
    strict: bool,
    compression: str | None,
) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int | None]:
    """:func:`open_source` once ``data`` is decompressed (``compression`` it was, or None)."""
    buf = pa.py_buffer(data)
    if buf.size == 0:
        raise MalformedShard(f"{source} is empty once {compression}-decompressed; {FIX}")
    kind = KIND_NAMES.get(fmt)
    if kind is None:
        raise MalformedShard(
            f"{source}: unsupported source format {fmt!r}; the version must name one of "
            f"{', '.join(FORMATS)} (publish it with the right format)"
        )
    try:
        if fmt in (_J, _C):
            table = _read_text(buf, fmt, source, options, strict)
            return table.schema, iter(table.to_batches(max_chunksize=batch_rows)), None
        if fmt == _P:
            return _parquet(buf, batch_rows, source)
        if fmt == _W:
            # A version without the option was published under the earlier member rules.
            return tar_source(data, source, batch_rows, rules=options.get(MEMBER_RULES_OPTION, ""))
        if fmt == _M:
            return mds_source(data, options, source, batch_rows)
        head = memoryview(buf)[:6].tobytes()
        # Compressed IPC buffers are decompressed in this thread (see _parquet).
        serial = pa.ipc.IpcReadOptions(use_threads=False)
        if head == b"ARROW1":  # IPC file format, which Feather v2 is
            reader = pa.ipc.open_file(buf, options=serial)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            return reader.schema, _rebatch(batches, batch_rows), None
        if head[:4] == b"FEA1":
            table = pa_feather.read_table(pa.BufferReader(buf), use_threads=False)
            return table.schema, iter(table.to_batches(max_chunksize=batch_rows)), None
        stream = pa.ipc.open_stream(buf, options=serial)
        return stream.schema, _rebatch(iter(stream), batch_rows), None
    except MalformedShard:
        raise
    except ARROW_ERRORS as exc:
        raise MalformedShard(f"{source}: not a readable {kind} object ({exc}); {FIX}") from exc


def guarded(batches: Iterator[pa.RecordBatch], source: str) -> Iterator[pa.RecordBatch]:
    """``batches``, with Arrow's errors while decoding turned into MalformedShard.

    A MalformedShard raised while decoding (a limit refusing the shard) already names
    the object and says what to do: it passes through as it is.
    """
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except MalformedShard:
            raise
        except ARROW_ERRORS as exc:
            raise MalformedShard(f"{source}: corrupt data ({exc}); {FIX}") from exc
        yield batch


def read_source(
    data: bytes | memoryview,
    *,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    batch_rows: int = 65536,
    options: Mapping[str, str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Parse one raw object into record batches of at most ``batch_rows`` rows.

    Args:
        data: the whole object, compressed (gzip, zstd, bz2, xz) or not.
        fmt: its format; for ``SOURCE_FORMAT_ARROW_IPC`` the IPC file format,
            the IPC stream format and Feather (v1 and v2) are told apart by magic bytes.
        source: the object's URL or key, named in every error.
        batch_rows: the most rows per yielded batch.
        options: reader options (CSV: header, column_names, delimiter, skip_rows,
            column_types; MDS: the columns publish recorded).

    Raises:
        MalformedShard: the object is empty, corrupt, or not in ``fmt``.
    """
    _, batches, _ = open_source(data, fmt, source, batch_rows, options)
    yield from guarded(batches, source)
