"""Preprocessing: the raw bytes of one origin object → Arrow record batches of a version's schema.

It lives in cache/ (not edge/) because publishing, a registry operation the CLI
runs too, must apply the same transforms to record schemas and row counts.
Edge nodes run this once per shard, in a worker thread, before encoding the
batches into cached chunks; publish runs :func:`describe` to record a shard's
schema and row count. A version's :class:`~edgecache.v1.manifest_pb2.PreprocessSpec`
names a transform (built-in, registered in-process, or installed as a Python
entry point in group ``edgecache.transforms``), so the same raw data with a
different spec is a different version.

Every way a raw object can be unusable surfaces as :class:`MalformedShard`
naming the object (and the line or row where that can be known), because the
message ends up in front of an operator who must fix or drop that object.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Protocol

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.feather as pa_feather
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from edgecache.cache.errors import MalformedShard, UnknownTransform
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "is_builtin",
    "ENTRY_POINT_GROUP",
    "FORMATS",
    "Transform",
    "TransformFactory",
    "describe",
    "format_from_key",
    "format_from_name",
    "load_transform",
    "parse_type",
    "preprocess",
    "read_source",
    "register_transform",
    "unregister_transform",
]

ENTRY_POINT_GROUP = "edgecache.transforms"
_FIX = "fix or remove the object and publish a new version"
_P, _J, _C, _A = (
    pb.SOURCE_FORMAT_PARQUET,
    pb.SOURCE_FORMAT_JSONL,
    pb.SOURCE_FORMAT_CSV,
    pb.SOURCE_FORMAT_ARROW_IPC,
)
FORMATS: Mapping[str, pb.SourceFormat.ValueType] = MappingProxyType(
    {"parquet": _P, "jsonl": _J, "csv": _C, "arrow": _A, "ipc": _A, "feather": _A}
)
_EXTENSIONS = {f".{ext}": FORMATS[kind] for kind, exts in (("parquet", "parquet pq"),
               ("jsonl", "jsonl ndjson json"), ("csv", "csv"), ("arrow", "arrow ipc feather"))
               for ext in exts.split()}  # fmt: skip
_JSON_KINDS = {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
               dict: "object"}  # fmt: skip
_ArrowErrors = (pa.ArrowException, OSError, ValueError)


class Transform(Protocol):
    """Turns one record batch into another; must be thread-safe and keep no per-shard state."""

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Return the transformed batch; raise MalformedShard for data it cannot handle."""
        ...


TransformFactory = Callable[[dict[str, str]], Transform]
_registered: dict[str, TransformFactory] = {}


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
    """Guess an object's source format from its file extension; None when there is no telling."""
    name = key.rsplit("/", 1)[-1].lower()
    dot = name.rfind(".")
    return _EXTENSIONS.get(name[dot:]) if dot >= 0 else None


def _rebatch(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)


def _jsonl_culprit(data: pa.Buffer) -> str | None:
    """Find the first line pyarrow would reject, as 'line N: what is wrong'."""
    kinds: dict[str, tuple[str, int]] = {}
    for number, raw in enumerate(memoryview(data).tobytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except UnicodeDecodeError:
            return f"line {number}: not valid UTF-8"
        except json.JSONDecodeError as exc:
            return f"line {number}: not valid JSON ({exc.msg})"
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


def _read_text(buf: pa.Buffer, fmt: pb.SourceFormat.ValueType, source: str) -> pa.Table:
    def parse(block_size: int | None, threads: bool = True) -> pa.Table:
        opts = {"use_threads": threads, **({"block_size": block_size} if block_size else {})}
        if fmt == _J:
            return pa_json.read_json(pa.BufferReader(buf), read_options=pa_json.ReadOptions(**opts))
        # An empty unquoted field is null and "" is an empty string, as pyarrow writes them.
        convert = pa_csv.ConvertOptions(strings_can_be_null=True, quoted_strings_can_be_null=False)
        return pa_csv.read_csv(
            pa.BufferReader(buf), read_options=pa_csv.ReadOptions(**opts), convert_options=convert
        )

    try:
        try:
            return parse(None)
        except pa.ArrowInvalid as exc:
            if "straddl" not in str(exc):
                raise
            return parse(min(buf.size + 1, 2**31 - 1))  # one record longer than a block
    except _ArrowErrors as exc:
        if fmt == _J:
            where = _jsonl_culprit(buf) or f"not valid JSON Lines ({exc})"
            raise MalformedShard(f"{source} {where}; {_FIX}") from exc
        try:  # the serial reader reports the row number; the threaded one does not
            parse(min(buf.size + 1, 2**31 - 1), threads=False)
        except _ArrowErrors as serial:
            exc = serial
        note = " (rows count the header as row 1)" if "Row #" in str(exc) else ""
        raise MalformedShard(f"{source}: {exc}{note}; {_FIX}") from exc


def _open(
    data: bytes | memoryview, fmt: pb.SourceFormat.ValueType, source: str, batch_rows: int
) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int | None]:
    """Parse enough of ``data`` to know its schema (and, for Parquet, its row count)."""
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    buf = pa.py_buffer(data)
    if buf.size == 0:
        raise MalformedShard(f"{source} is empty (0 bytes); {_FIX}")
    kind = {_P: "Parquet", _J: "JSON Lines", _C: "CSV", _A: "Arrow IPC"}.get(fmt)
    if kind is None:
        raise MalformedShard(
            f"{source}: unsupported source format {fmt!r}; the version must name one of "
            f"{', '.join(FORMATS)} (publish it with the right format)"
        )
    try:
        if fmt in (_J, _C):
            table = _read_text(buf, fmt, source)
            return table.schema, iter(table.to_batches(max_chunksize=batch_rows)), None
        if fmt == _P:
            parquet = pq.ParquetFile(pa.BufferReader(buf))
            batches = parquet.iter_batches(batch_size=batch_rows)
            return parquet.schema_arrow, batches, parquet.metadata.num_rows
        head = memoryview(buf)[:6].tobytes()
        if head == b"ARROW1":  # IPC file format, which Feather v2 is
            reader = pa.ipc.open_file(buf)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            return reader.schema, _rebatch(batches, batch_rows), None
        if head[:4] == b"FEA1":
            table = pa_feather.read_table(pa.BufferReader(buf))
            return table.schema, iter(table.to_batches(max_chunksize=batch_rows)), None
        stream = pa.ipc.open_stream(buf)
        return stream.schema, _rebatch(iter(stream), batch_rows), None
    except MalformedShard:
        raise
    except _ArrowErrors as exc:
        raise MalformedShard(f"{source}: not a readable {kind} object ({exc}); {_FIX}") from exc


def _guarded(batches: Iterator[pa.RecordBatch], source: str) -> Iterator[pa.RecordBatch]:
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except _ArrowErrors as exc:
            raise MalformedShard(f"{source}: corrupt data ({exc}); {_FIX}") from exc
        yield batch


def read_source(
    data: bytes | memoryview,
    *,
    fmt: pb.SourceFormat.ValueType,
    source: str,
    batch_rows: int = 65536,
) -> Iterator[pa.RecordBatch]:
    """Parse one raw object into record batches of at most ``batch_rows`` rows.

    Args:
        data: the whole object.
        fmt: its format; for ``SOURCE_FORMAT_ARROW_IPC`` the IPC file format,
            the IPC stream format and Feather (v1 and v2) are told apart by magic bytes.
        source: the object's URL or key, named in every error.
        batch_rows: the most rows per yielded batch.

    Raises:
        MalformedShard: the object is empty, corrupt, or not in ``fmt``.
    """
    _, batches, _ = _open(data, fmt, source, batch_rows)
    yield from _guarded(batches, source)


# --- Arrow type strings -----------------------------------------------------------------------

_PRIMITIVES = (
    "int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 float double bool "
    "string utf8 large_string binary large_binary date32 timestamp[unit]"
)
_LIST = re.compile(r"(large_list|list|fixed_size_list)\s*<(.*)>\s*(?:\[\s*(\d+)\s*\])?", re.S)
_FIELD_NAME = re.compile(r"^\s*\w+\s*:\s*")  # pyarrow prints list<item: int32>


def parse_type(text: str) -> pa.DataType:
    """Parse an Arrow type string: ``int32``, ``list<string>``, ``fixed_size_list<float, 8>``, ...

    Also accepts pyarrow's own spelling, e.g. ``fixed_size_list<item: float>[64]``.

    Raises:
        ValueError: the string is not a type this parser knows; the message names it.
    """
    spec = text.strip()
    if not (match := _LIST.fullmatch(spec)):
        try:  # the names str(type) prints, and aliases: timestamp[ms], halffloat, utf8, ...
            return pa.type_for_alias(spec)
        except ValueError:
            raise ValueError(
                f"unknown Arrow type {spec!r}; known: {_PRIMITIVES.replace(' ', ', ')}"
                ", list<T>, large_list<T>, fixed_size_list<T, N>"
            ) from None
    kind, inner, size = match.groups()
    if kind == "fixed_size_list" and size is None:
        inner, _, size = inner.rpartition(",")
    if (kind == "fixed_size_list") != bool(size) or (size and not size.strip().isdigit()):
        raise ValueError(
            f"bad Arrow type {spec!r}: fixed_size_list needs a size N, other lists none"
        )
    item = parse_type(_FIELD_NAME.sub("", inner, count=1))
    if kind == "fixed_size_list":
        return pa.list_(item, int(size))
    return pa.list_(item) if kind == "list" else pa.large_list(item)


# --- transforms -------------------------------------------------------------------------------


def _split(value: str) -> list[str]:
    """Split on commas outside <...> and [...], so list types with a size stay whole."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(value):
        depth += (char in "<[") - (char in ">]")
        if char == "," and depth == 0:
            parts.append(value[start:i])
            start = i + 1
    parts.append(value[start:])
    return [p.strip() for p in parts if p.strip()]


def _pairs(key: str, value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in _split(value):
        old, eq, new = (s.strip() for s in part.partition("="))
        if not eq or not old or not new or old in out:
            raise ValueError(f"columns param {key}={value!r}: expected unique 'name=value' pairs")
        out[old] = new
    return out


def _cast_column(batch: pa.RecordBatch, index: int, target: pa.DataType) -> pa.Array:
    column, name = batch.column(index), batch.schema.field(index).name
    if column.type == target:
        return column
    try:
        return column.cast(target, safe=True)
    except _ArrowErrors as exc:
        raise MalformedShard(
            f"column {name!r} cannot be cast from {column.type} to {target}: {exc}"
        ) from exc


def _index(batch: pa.RecordBatch, name: str, why: str) -> int:
    names = batch.schema.names
    if names.count(name) != 1:
        found = "appears more than once" if name in names else "is missing"
        raise MalformedShard(f"column {name!r} ({why}) {found}; the data has: {', '.join(names)}")
    return names.index(name)


def _columns(params: dict[str, str]) -> Transform:
    allowed = ("select", "rename", "cast")
    if unknown := sorted(set(params) - set(allowed)):
        raise ValueError(
            f"columns transform: unknown params {unknown}; allowed: {', '.join(allowed)}"
        )
    select = _split(params.get("select", ""))
    if len(set(select)) != len(select):
        raise ValueError(f"columns param select={params['select']!r} names a column twice")
    rename = _pairs("rename", params.get("rename", ""))
    cast = {k: parse_type(v) for k, v in _pairs("cast", params.get("cast", "")).items()}

    def columns(batch: pa.RecordBatch) -> pa.RecordBatch:
        if select:
            batch = batch.select([_index(batch, n, "in select") for n in select])
        if rename:
            for old in rename:
                _index(batch, old, "in rename")
            batch = batch.rename_columns([rename.get(n, n) for n in batch.schema.names])
        if cast:
            arrays = list(batch.columns)
            for name, target in cast.items():
                i = _index(batch, name, "in cast")
                arrays[i] = _cast_column(batch, i, target)
            batch = pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)
        return batch

    return columns


def _identity(params: dict[str, str]) -> Transform:
    if params:
        raise ValueError(f"identity transform takes no params, got {sorted(params)}")
    return lambda batch: batch


_BUILTINS: Mapping[str, TransformFactory] = MappingProxyType(
    {"identity": _identity, "columns": _columns}
)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def is_builtin(name: str) -> bool:
    """Whether ``name`` is a built-in transform (built-ins never add or drop rows)."""
    return (name or "identity") in _BUILTINS


def register_transform(name: str, factory: TransformFactory, *, overwrite: bool = False) -> None:
    """Register ``factory(params) -> Transform`` under ``name`` for this process.

    An in-process registration shadows an installed entry point of the same name.

    Raises:
        ValueError: the name is empty or built-in, or already registered and not ``overwrite``.
        TypeError: ``factory`` is not callable.
    """
    if not name or name in _BUILTINS:
        raise ValueError(f"cannot register transform {name!r}: empty or a built-in name")
    if not callable(factory):
        raise TypeError(f"transform factory for {name!r} must be callable, got {factory!r}")
    if not overwrite and (name in _registered or name in _entry_points()):
        raise ValueError(
            f"transform {name!r} is already registered; pass overwrite=True to replace"
        )
    _registered[name] = factory


def unregister_transform(name: str) -> None:
    """Remove an in-process registration.

    Raises:
        KeyError: ``name`` was not registered with :func:`register_transform`.
    """
    if _registered.pop(name, None) is None:
        raise KeyError(f"transform {name!r} was not registered in this process")


def load_transform(name: str, params: Mapping[str, str]) -> Transform:
    """Build the transform ``name`` with ``params``: built-in, registered, then entry point.

    Built-ins: ``identity`` (no params) and ``columns`` (``select="a,b"``,
    ``rename="a=x,b=y"`` applied after select, ``cast="x=int32,y=list<float>"``
    on the renamed columns).

    Raises:
        UnknownTransform: no transform has that name, or its entry point fails to load.
        ValueError: the params are not what the transform accepts.
    """
    plain = {str(k): str(v) for k, v in params.items()}
    factory = _BUILTINS.get(name) or _registered.get(name)
    if factory is None:
        installed = _entry_points()
        if name not in installed:
            known = sorted({*_BUILTINS, *_registered, *installed})
            raise UnknownTransform(
                f"no transform named {name!r}; available: {', '.join(known)}. To add one, install "
                f'a package declaring [project.entry-points."{ENTRY_POINT_GROUP}"] '
                f'{name or "name"} = "module:factory", where factory(params) returns a callable '
                "RecordBatch -> RecordBatch"
            )
        try:
            factory = installed[name].load()
        except Exception as exc:
            raise UnknownTransform(
                f"transform {name!r} is installed as {installed[name].value!r} but fails to "
                f"load ({type(exc).__name__}: {exc}); fix or reinstall that package"
            ) from exc
    transform = factory(plain)
    if not callable(transform):
        raise TypeError(f"transform factory {name!r} returned {transform!r}, which is not callable")
    return transform


# --- the pipeline -----------------------------------------------------------------------------


def _transformed(
    batches: Iterator[pa.RecordBatch], spec: pb.PreprocessSpec, source: str
) -> Iterator[pa.RecordBatch]:
    name = spec.transform or "identity"
    transform = load_transform(name, spec.params)
    for batch in batches:
        try:
            out = transform(batch)
        except MalformedShard as exc:
            raise MalformedShard(f"{source}: transform {name!r}: {exc}; {_FIX}") from exc
        except pa.ArrowException as exc:
            raise MalformedShard(f"{source}: transform {name!r} failed: {exc}; {_FIX}") from exc
        if not isinstance(out, pa.RecordBatch):
            raise TypeError(f"transform {name!r} returned {type(out).__name__}, not a RecordBatch")
        yield out


def _conform(batch: pa.RecordBatch, schema: pa.Schema, source: str) -> pa.RecordBatch:
    arrays = []
    for field in schema:
        try:
            arr = _cast_column(
                batch, _index(batch, field.name, "in the version's schema"), field.type
            )
        except MalformedShard as exc:
            raise MalformedShard(f"{source}: {exc}; {_FIX}") from exc
        if not field.nullable and arr.null_count:
            raise MalformedShard(
                f"{source}: column {field.name!r} has {arr.null_count} nulls but the version's "
                f"schema says it is not nullable; {_FIX}"
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
    schema, batches, known_rows = _open(data, fmt, source, 65536)
    empty = pa.RecordBatch.from_pylist([], schema=schema)
    if known_rows is not None and is_builtin(spec.transform):
        return next(_transformed(iter([empty]), spec, source)).schema, known_rows
    result: pa.Schema | None = None
    rows = 0
    for out in _transformed(_guarded(batches, source), spec, source):
        result, rows = result or out.schema, rows + out.num_rows
    if result is None:
        result = next(_transformed(iter([empty]), spec, source)).schema
    return result, rows
