"""Hive-style partitions: ``key=value`` folders in object keys become columns of a version.

Spark, Hive and ``pyarrow.dataset`` write a partitioned table as folders
(``events/year=2023/month=01/part-0.parquet``) and leave the partition columns
out of the files: the values live in the keys alone, and every reader of such
data adds them back as columns. A version published from such a prefix must
hold them too, or they are lost without a word.

At publish the values come from the keys (no extra reads): the ``key=value``
folders below the source prefix must name the same keys in the same order in
every object's key, and each key's type is inferred from all its values
(``int64`` when every value is an integer literal, else ``string``;
``__HIVE_DEFAULT_PARTITION__`` is null, and :func:`partition_nulls` says so at
publish, as for a null in the data). The result is recorded in the
version's ``source_options`` as ``hive_partitions=year=int64,month=int64``,
so every node adds the same columns with the same types, after the
transform's own, and the version's digest covers them. A version without that
option (one published before partitions were read, or with
``partitioning=none``) gets no added columns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from urllib.parse import unquote

import pyarrow as pa

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.arrow_types import param_pairs, quote_name, type_label
from edgecache.cache.preprocess.nulls import NullCount, tensor_type

__all__ = [
    "PARTITIONING",
    "RECORDED",
    "add_partitions",
    "hive_partitions",
    "partition_fields",
    "partition_nulls",
    "partition_values",
    "partition_scalars",
    "partitioning_mode",
    "reader_options",
    "recorded",
    "with_partitions",
]

PARTITIONING = "partitioning"  # the option a publisher gives: hive (the default) or none
RECORDED = "hive_partitions"  # the option publish records: NAME=TYPE,… in path order
MODES = ("hive", "none")
NULL_VALUE = "__HIVE_DEFAULT_PARTITION__"
_INTEGER = re.compile(r"[+-]?[0-9]+")
_INT64 = 2**63
_TYPES: Mapping[str, pa.DataType] = {"int64": pa.int64(), "string": pa.string()}
_OFF = (
    f"publish with --partitioning none (source option {PARTITIONING}=none) to make no columns "
    "of the folders"
)


def partitioning_mode(options: dict[str, str]) -> str:
    """Take ``partitioning`` (and a recorded ``hive_partitions``) out of ``options``.

    Returns ``hive`` (the default: ``key=value`` folders become columns) or
    ``none``. A ``hive_partitions`` given back (a version's recorded options,
    republished) is dropped: publish derives it from the keys again.

    Raises:
        ValueError: ``partitioning`` is neither ``hive`` nor ``none``.
    """
    options.pop(RECORDED, None)
    given = options.pop(PARTITIONING, "hive")
    mode = given.strip().lower()
    if mode not in MODES:
        raise ValueError(f"partitioning must be hive or none, got {given!r}")
    return mode


def reader_options(options: Mapping[str, str]) -> Mapping[str, str]:
    """The options a format's reader takes: the recorded partitions left out."""
    if RECORDED not in options:
        return options
    return {k: v for k, v in options.items() if k != RECORDED}


def partition_values(key: str) -> list[tuple[str, str]]:
    """The ``(name, raw value)`` pairs of a key's ``name=value`` folders, in path order.

    Names and values are percent-decoded, as Hive and Spark escape them
    (``city=New%20York``); the object's own name is not a folder.
    """
    folders = key.split("/")[:-1]
    pairs = [part.partition("=") for part in folders if "=" in part]
    return [(unquote(name), unquote(value)) for name, _, value in pairs]


def _infer(values: Sequence[str]) -> str:
    """``int64`` when every non-null value is an integer literal within int64, else ``string``."""
    present = [v for v in values if v != NULL_VALUE]
    if present and all(_INTEGER.fullmatch(v) and -_INT64 <= int(v) < _INT64 for v in present):
        return "int64"
    return "string"


def hive_partitions(objects: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The partition columns of a source, ``(name, type)`` in path order, from its keys alone.

    ``objects`` are ``(url, key under the source prefix)`` pairs; the URLs only
    name objects in errors. No object with a ``name=value`` folder: no columns.

    Raises:
        MalformedShard: two objects' keys name different partitions (or the same in
            another order), or one key names a partition twice, or a name is empty or
            holds ``,`` or ``=`` (which the recorded option cannot spell).
    """
    if not objects:
        return []
    parsed = [(url, partition_values(key)) for url, key in objects]
    first_url, first = parsed[0]
    names = [name for name, _ in first]
    for url, pairs in parsed[1:]:
        these = [name for name, _ in pairs]
        if these != names:
            raise MalformedShard(
                f"the objects' keys disagree on their Hive partitions: {url} is under "
                f"{_folders(these)} but {first_url} is under {_folders(names)}; every object "
                "of a partitioned version sits under the same key=value folders, in the same "
                f"order: publish them apart, or {_OFF}"
            )
    if not names:
        return []
    for name in names:
        if not name or "," in name or "=" in name or names.count(name) > 1:
            why = "twice" if names.count(name) > 1 else "as a column name the spec cannot record"
            raise MalformedShard(
                f"{first_url} names the Hive partition {name!r} {why}; rename its folders, "
                f"or {_OFF}"
            )
    return [(name, _infer([pairs[i][1] for _, pairs in parsed])) for i, name in enumerate(names)]


def _folders(names: Sequence[str]) -> str:
    return "/".join(f"{n}=…" for n in names) if names else "no key=value folder"


def recorded(partitions: Sequence[tuple[str, str]]) -> str:
    """The ``hive_partitions`` option for ``partitions``: ``year=int64,month=string``."""
    return ",".join(f"{name}={kind}" for name, kind in partitions)


def partition_fields(options: Mapping[str, str]) -> list[pa.Field]:
    """The columns a version's recorded options add (none without ``hive_partitions``).

    Raises:
        ValueError: the recorded option is not ``NAME=int64|string,…``.
    """
    text = options.get(RECORDED, "")
    if not text:
        return []
    fields = []
    for part in text.split(","):
        name, _, kind = part.partition("=")
        if not name or kind not in _TYPES:
            raise ValueError(
                f"{RECORDED}={text!r}: expected NAME=int64 or NAME=string pairs; the version "
                "was damaged or written by a newer edgecache: publish it again"
            )
        fields.append(pa.field(name, _TYPES[kind]))
    return fields


def with_partitions(
    schema: pa.Schema,
    fields: Sequence[pa.Field],
    source: str,
    *,
    transform: str = "identity",
    params: Mapping[str, str] | None = None,
) -> pa.Schema:
    """``schema`` with the partition columns after its own; a name it already has is refused.

    ``schema`` is the data after ``transform``, so a column of the partition's name
    may be the transform's making (``rename=v=code``): the message says whose it is
    and a fix that works (a second ``--param rename`` is refused).

    Raises:
        MalformedShard: the data already has a column named like a partition.
    """
    for field in fields:
        if field.name in schema.names:
            raise MalformedShard(
                f"{_whose_column(field.name, source, transform, params or {})}, and its key's "
                f"folders name a Hive partition {field.name}=…: the version cannot hold "
                f"both; {_renamed(field.name, transform, params or {})} or the folders, or "
                f"{_OFF}"
            )
    for field in fields:
        schema = schema.append(field)
    return schema


def _rename_targets(params: Mapping[str, str]) -> dict[str, str]:
    """The columns transform's ``rename=a=x,"b,c"=y`` as new name → old name."""
    return {new: old for old, new, _ in param_pairs(params.get("rename", ""))}


def _rename_text(pairs: Mapping[str, str]) -> str:
    """``rename=`` pairs (new name → old name) as the param writes them, quoted where need be."""
    return ",".join(f"{quote_name(old)}={quote_name(new)}" for new, old in pairs.items())


def _whose_column(name: str, source: str, transform: str, params: Mapping[str, str]) -> str:
    """Who made the column: the object, a ``columns`` rename, or another transform.

    ``columns`` only selects, renames and casts the object's own columns; of another
    transform's output this cannot tell what it kept (images keeps the other columns).
    """
    if transform == "columns" and name in (targets := _rename_targets(params)):
        return (
            f"the columns transform's rename={_rename_text({name: targets[name]})} makes a "
            f"column {name!r} of {source}'s {targets[name]!r}"
        )
    if transform in ("identity", "columns"):
        return f"{source} already has a column {name!r}"
    return f"{source}, after the {transform} transform, has a column {name!r}"


def _renamed(name: str, transform: str, params: Mapping[str, str]) -> str:
    """How to give the column another name, for the transform the version is published with."""
    new = "NEW"
    if transform == "identity":
        return f"rename the column (--transform columns --param rename={quote_name(name)}={new})"
    if transform == "columns":
        targets = _rename_targets(params)
        if name in targets:
            pairs = {n: o for n, o in targets.items() if n != name} | {new: targets[name]}
            return f"rename it to another name (--param rename={_rename_text(pairs)})"
        pairs = targets | {new: name}
        return (
            f"rename the column in the same --param rename ({_rename_text(pairs)}: it is given "
            "once)"
        )
    # The images transform keeps the object's other columns; a plugin may make any.
    return f"rename that column before publishing (or in the {transform} transform's params)"


def partition_scalars(fields: Sequence[pa.Field], key: str, source: str) -> list[pa.Scalar]:
    """The value of each partition column for the object at ``key``, typed as recorded.

    Raises:
        MalformedShard: the key's folders do not name the recorded partitions, or a
            value does not fit its type (origin or the manifest changed after publish).
    """
    pairs = partition_values(key)
    names = [name for name, _ in pairs]
    if names != [f.name for f in fields]:
        raise MalformedShard(
            f"{source}: its key is under {_folders(names)}, but the version records the Hive "
            f"partitions {_folders([f.name for f in fields])}; publish the version again"
        )
    out = []
    for field, (_, value) in zip(fields, pairs, strict=True):
        if value == NULL_VALUE:
            out.append(pa.scalar(None, field.type))
        elif pa.types.is_integer(field.type):
            if not _INTEGER.fullmatch(value):
                raise MalformedShard(
                    f"{source}: partition {field.name}={value!r} is not an integer, but the "
                    "version records it as int64; publish the version again"
                )
            out.append(pa.scalar(int(value), field.type))
        else:
            out.append(pa.scalar(value, field.type))
    return out


def partition_nulls(
    fields: Sequence[pa.Field], objects: Sequence[tuple[str, str, int]]
) -> list[NullCount]:
    """The nulls ``__HIVE_DEFAULT_PARTITION__`` folders put in the partition columns.

    ``fields``: the recorded partitions (:func:`partition_fields`); ``objects``:
    ``(url, key under the source prefix, rows)`` of each object. Every row of an
    object under ``NAME=__HIVE_DEFAULT_PARTITION__`` is null in column ``NAME``
    (a node adds a null there, :func:`partition_scalars`), and EdgeDataset makes a
    tensor of an ``int64`` column and a packed column of a ``string`` one, neither
    of which holds a null: the same warning as a null in the data's own columns
    (:mod:`.nulls`), from the keys alone. Each count's ``folder`` is the key up to
    that folder, to name it. Column by column, then object by object.
    """
    out = []
    for index, field in enumerate(fields):
        if not tensor_type(field.type):
            continue
        for url, key, rows in objects:
            if not rows:
                continue  # no row, no null (it said "holds 0 nulls")
            parts = key.split("/")
            # Where each key=value folder is in the key, in path order (as partition_values).
            at = [i for i, part in enumerate(parts[:-1]) if "=" in part]
            if index < len(at) and unquote(parts[at[index]].partition("=")[2]) == NULL_VALUE:
                folder = "/".join(parts[: at[index] + 1])
                out.append(NullCount(field.name, type_label(field.type), url, rows, folder))
    return out


def add_partitions(
    batch: pa.RecordBatch, fields: Sequence[pa.Field], values: Sequence[pa.Scalar]
) -> pa.RecordBatch:
    """``batch`` with one constant column per partition after its own columns."""
    if not fields:
        return batch
    arrays, schema = list(batch.columns), batch.schema
    for field, value in zip(fields, values, strict=True):
        arrays.append(pa.repeat(value, batch.num_rows))
        schema = schema.append(field)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
