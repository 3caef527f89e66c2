"""What an error about a raw object tells its reader to do, said the same way everywhere.

The advice depends on whose mistake it most likely is: the object's (corrupt,
empty, rows that do not fit: :data:`FIX`), or the publisher's, a parameter
or reader option that does not fit the data (:class:`MissingColumn`,
:class:`ParamMismatch`, :func:`options_fix`), which publish meets on the
first object and which a new version with the right value fixes.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

import pyarrow as pa

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.arrow_types import quote_name, type_name
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "COLUMN_FIX",
    "FIX",
    "PARAM_FIX",
    "MissingColumn",
    "ParamMismatch",
    "columns_text",
    "options_fix",
    "schema_mismatch",
]

# The object is wrong (corrupt, empty, rows that do not fit): a version is immutable.
FIX = "fix or remove the object and publish a new version"
# A column a parameter names is not in the data: most often the parameter is wrong.
COLUMN_FIX = (
    "if the parameter that names it is wrong, fix it and publish again; if this object lacks "
    "the column, fix or remove the object and publish a new version"
)
# A parameter's value does not fit the data (a column of another type, a name taken).
PARAM_FIX = (
    "fix the --param and publish again; if only this object differs from the others, fix or "
    "remove it and publish a new version"
)


class MissingColumn(MalformedShard):
    """A column a parameter names is missing from the data, or there twice.

    Said with :data:`COLUMN_FIX` rather than "fix the object": a typo in the
    parameter is the likelier cause, and publish finds it on the first object.
    """


class ParamMismatch(MalformedShard):
    """A transform's parameter does not fit the data: said with :data:`PARAM_FIX`."""


def options_fix(options: Mapping[str, str]) -> str:
    """The advice for an object that does not parse with the reader options given.

    Without options the object is at fault (:data:`FIX`); with them, options
    that do not match the file (a column count, rows to skip) are as likely.
    """
    # Recorded on every CSV version, empty by default: not an option anyone gave.
    options = {k: v for k, v in options.items() if (k, v) != ("null_values", "")}
    if not options:
        return FIX
    given = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    return (
        f"if the reader options ({given}) do not match the file, fix them and publish again; "
        f"else {FIX}"
    )


# Bounds on a schema in a message: a JSON file read as one row (a tokenizer.json's
# vocabulary as a struct) used to print a 28 KB "schema".
_MAX_COLUMNS_SHOWN = 12
_MAX_TYPE_CHARS = 80


def columns_text(schema: pa.Schema) -> str:
    """A schema on one line, ``a: int64, b: float64``, spelled as publish prints types.

    Bounded: a long type is cut (``struct<…> (2,345 fields)``), and past
    :data:`_MAX_COLUMNS_SHOWN` columns the rest are counted, not listed.
    """
    shown = []
    for field in list(schema)[:_MAX_COLUMNS_SHOWN]:
        text = type_name(field.type)
        if len(text) > _MAX_TYPE_CHARS:
            kind = text.split("<", 1)[0]
            inner = f" ({field.type.num_fields:,} fields)" if pa.types.is_struct(field.type) else ""
            text = f"{kind}<…>{inner}"
        shown.append(f"{field.name}: {text}")
    if len(schema) > _MAX_COLUMNS_SHOWN:
        shown.append(f"and {len(schema) - _MAX_COLUMNS_SHOWN} more columns")
    return ", ".join(shown)


def _common_type(one: pa.DataType, other: pa.DataType) -> pa.DataType | None:
    """The type both columns read as without losing a value (pyarrow's promotion), or None.

    A dictionary column (pandas' ``category``) reads as its values' type: beside
    plain strings it was "must agree" with no cast to give.
    """
    one, other = (t.value_type if pa.types.is_dictionary(t) else t for t in (one, other))
    if one.equals(other):
        return one
    try:
        merged = pa.unify_schemas(
            [pa.schema([("c", one)]), pa.schema([("c", other)])], promote_options="permissive"
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    return merged.field("c").type


def _shared_columns(schema: pa.Schema, first: pa.Schema, fmt: pb.SourceFormat.ValueType) -> str:
    """The advice for objects whose columns differ in name or order: select those both have.

    WebDataset shards often do (an optional extension, ``.json`` on some samples,
    makes a column only in the shards where some sample has one); the ``columns``
    transform's ``select`` reads every object as the same columns, in one order.
    "" when they share none, or a shared column's type differs too.
    """
    theirs = {f.name: f.type for f in schema}
    shared = [f.name for f in first if f.name in theirs]
    if not shared or any(not first.field(n).type.equals(theirs[n]) for n in shared):
        return ""
    left = sorted(set(first.names) ^ set(schema.names))
    why = f"leaving out {', '.join(left)}" if left else "in one order"
    wds = (
        " (WebDataset: a shard where no sample has an optional extension has no column for it)"
        if fmt == pb.SOURCE_FORMAT_WEBDATASET and left
        else ""
    )
    select = shlex.quote("select=" + ",".join(quote_name(n) for n in shared))
    return (
        f"{wds}; to publish the columns both have ({why}), publish with --transform columns "
        f"--param {select}"
    )


def schema_mismatch(
    url: str,
    schema: pa.Schema,
    first_url: str,
    first: pa.Schema,
    fmt: pb.SourceFormat.ValueType,
    transform: str = "identity",
    *,
    others: Sequence[pa.Schema] = (),
    column_types: str = "",
    cast: str = "",
) -> str:
    """Why ``url``'s columns do not match ``first_url``'s, and the types that make them agree.

    An object whose column is all null, or holds one float among integers,
    infers another type than its neighbours; a type said for the column reads
    them all alike: ``--column-types`` for CSV and JSON Lines (read as that type),
    else the ``columns`` transform's cast. Objects whose columns differ in name
    (a WebDataset extension some shards lack) are told the ``select`` of the
    columns they share.

    The types are those of every object (``others``: the rest of the version's
    schemas) and come with the ones the publish already gave (its ``column_types``
    reader option, or its ``columns`` transform's ``cast``, whichever the advice
    names): told from one pair of objects alone, the advice
    named one column, the next publish another, and pasted as printed the first
    again, in a loop.
    """
    text = (
        f"{url} has columns ({columns_text(schema)}) after preprocessing, but {first_url} has "
        f"({columns_text(first)}); all objects of a version must agree"
    )
    read_as = fmt in (pb.SOURCE_FORMAT_CSV, pb.SOURCE_FORMAT_JSONL) and transform == "identity"
    if schema.names != first.names:
        return text + (_shared_columns(schema, first, fmt) if transform == "identity" else "")
    if transform not in ("identity", "columns"):
        return text
    typed: list[str] = []
    alike = [o for o in others if o.names == first.names]
    for at, (mine, theirs) in enumerate(zip(schema, first, strict=True)):
        types = [mine.type, *(o.field(at).type for o in alike)]
        if all(t.equals(theirs.type) for t in types):
            continue
        common: pa.DataType | None = theirs.type
        for each in types:
            common = _common_type(common, each) if common is not None else None
        if common is None and read_as and fmt == pb.SOURCE_FORMAT_CSV:
            common = pa.string()  # a CSV cell reads as text whatever it holds
        if common is None or pa.types.is_null(common):
            return text
        typed.append(f"{quote_name(mine.name)}={type_name(common)}")
    if not typed:
        return text
    given = column_types if read_as else cast
    pairs = ",".join([given, *typed] if given else typed)
    quoted = pairs if all(ch not in pairs for ch in "<>() \"'") else shlex.quote(pairs)
    param = f"'cast={pairs}'" if "'" not in pairs else shlex.quote(f"cast={pairs}")
    how = f"--column-types {quoted}" if read_as else f"--transform columns --param {param}"
    return f"{text}; give the columns one type: publish with {how}"
