"""Nulls in the columns a reader turns into tensors, found at publish rather than mid-epoch.

EdgeDataset makes a tensor of every number or boolean column (and of fixed-size
lists of them, nested too), a ``Packed`` of binary and string columns and a
padded tensor of variable-length lists of numbers, by default, and none of
them holds a null: a null there raises ValueError when the batch holding it
is assembled, which can be hours into training. Publish can tell beforehand, at no extra read:

* a Parquet object read from its footer alone has each column chunk's
  ``null_count`` statistic (:func:`parquet_nulls`); a column without it in any
  row group is not judged (the file is not read for it);
* an object read whole (CSV, JSON Lines, Arrow, or any format under a transform
  that may drop rows) has its batches, counted after the transform
  (:func:`batch_nulls`).

A null is not refused: a transform may fill it, or the reader may leave the column
out. Publish warns, naming the column, the object and the count.

Counts are of null values: a null row, and each null item inside a fixed-size list
(Parquet's ``null_count`` of the list's leaf column counts both the same way).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from edgecache.cache.preprocess.arrow_types import param_names, param_pairs, quote_name
from edgecache.cache.preprocess.compressed import compression_of

__all__ = [
    "NullCount",
    "batch_nulls",
    "carried",
    "null_warnings",
    "parquet_nulls",
    "tensor_type",
]


def _number(kind: pa.DataType) -> bool:
    while pa.types.is_fixed_size_list(kind):
        kind = kind.value_type
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def _bytes(kind: pa.DataType) -> bool:
    """Binary and strings (dictionary-encoded too): a ``Packed`` by default, no null."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return (
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
    )


def _ragged(kind: pa.DataType) -> bool:
    """Variable-length lists of numbers or booleans: padded tensors by default, no null."""
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _number(kind.value_type)


def tensor_type(kind: pa.DataType) -> bool:
    """Whether EdgeDataset's default form of a ``kind`` column holds no null.

    Numbers and booleans, and fixed-size lists of them (nested too): the columns
    :func:`edgecache.clients.tensors.column_kinds` reads as ``fixed``; binary and
    strings (a ``Packed``, ``binary="packed"``); variable-length lists of numbers
    (padded, ``ragged="padded"``). Counting the first alone, publish said nothing
    of the others, whose first null raised ValueError mid-epoch all the same.
    """
    return _number(kind) or _bytes(kind) or _ragged(kind)


def _array_nulls(column: pa.Array) -> int:
    """Null values in such a column: null rows, and null items of its lists."""
    count = column.null_count
    while pa.types.is_fixed_size_list(column.type) or _ragged(column.type):
        column = column.flatten()  # the items of the rows that are not null
        count += column.null_count
    return count


def batch_nulls(batch: pa.RecordBatch) -> dict[str, int]:
    """Each such column's null values in ``batch`` (columns without any left out)."""
    out: dict[str, int] = {}
    for field, column in zip(batch.schema, batch.columns, strict=True):
        if tensor_type(field.type) and (count := _array_nulls(column)):
            out[field.name] = out.get(field.name, 0) + count
    return out


def _leaves(kind: pa.DataType) -> int:
    """How many Parquet leaf columns an Arrow column of ``kind`` is stored as."""
    if pa.types.is_struct(kind):
        return sum(_leaves(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _leaves(kind.key_type) + _leaves(kind.item_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _leaves(kind.value_type)
    return 1


def parquet_nulls(data: bytes | memoryview, schema: pa.Schema) -> dict[str, int]:
    """Null values per column of a Parquet object, from its footer's statistics alone.

    ``data`` is the object, or its footer framed as one (``PAR1`` + footer);
    ``schema`` the Arrow schema the footer gives. Only columns stored as one leaf
    (numbers, strings, lists of them) are counted, and only when every row group
    has the statistic: where a writer left it out, nothing is said. A compressed
    object (``.parquet.gz``) is not judged: its footer is not at hand.
    """
    if compression_of(memoryview(data)[:10]) is not None:
        return {}
    meta = pq.read_metadata(pa.BufferReader(pa.py_buffer(data)))
    widths = [_leaves(field.type) for field in schema]
    if sum(widths) != meta.num_columns or len(set(schema.names)) != len(schema.names):
        return {}  # not the layout expected: say nothing rather than misname a column
    out: dict[str, int] = {}
    leaf = 0
    for field, width in zip(schema, widths, strict=True):
        first, leaf = leaf, leaf + width
        # A list's leaf counts its empty lists as nulls too: not judged from the footer.
        if width != 1 or pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            continue
        total = 0
        for group in range(meta.num_row_groups):
            stats = meta.row_group(group).column(first).statistics
            if stats is None or not stats.has_null_count:
                break
            total += stats.null_count
        else:
            out[field.name] = total
    return out


def carried(
    counts: Mapping[str, int],
    transform: str,
    params: Mapping[str, str],
    source: pa.Schema,
    result: pa.Schema,
) -> dict[str, int]:
    """Source columns' null counts as the columns of ``result`` (the transformed schema).

    For transforms that keep every row (those a footer can answer for): ``identity``
    keeps each column; ``columns`` selects, then renames (a cast keeps a null a
    null); any other (``images``) is trusted only for a column it passes through,
    of the same name and type as the source's. Only tensor columns are kept.
    """
    name = transform or "identity"
    if name == "identity":
        origin = {n: n for n in result.names}
    elif name == "columns":
        chosen = param_names(params.get("select", ""))
        renamed = {old: new for old, new, eq in param_pairs(params.get("rename", "")) if eq}
        origin = {renamed.get(n, n): n for n in (chosen or source.names)}
    else:
        origin = {
            f.name: f.name
            for f in result
            if f.name in source.names and source.field(f.name).type == f.type
        }
    out = {}
    for field in result:
        count = counts.get(origin.get(field.name, ""), 0)
        if count and tensor_type(field.type):
            out[field.name] = count
    return out


@dataclass(frozen=True, slots=True)
class NullCount:
    """``count`` null values in tensor column ``column`` (of type ``kind``) of object ``url``."""

    column: str
    kind: str
    url: str
    count: int


_SELECT_CHARS = 300  # a longer select= is said in words: a command must be pasted whole


def _select_advice(others: Sequence[str], nulled: Sequence[str]) -> str:
    """How to publish a version without the ``nulled`` columns, keeping ``others``.

    A command in a message is pasted as it is, so the ``select=`` names every
    column kept (quoted for the shell where a name needs it), never an ellipsis;
    past ``_SELECT_CHARS`` it is said in words instead.
    """
    if not others:
        return ""
    select = "select=" + ",".join(quote_name(n) for n in others)
    if len(select) <= _SELECT_CHARS:
        return f"of the version (--transform columns --param {shlex.quote(select)}) or "
    but = ", ".join(repr(n) for n in nulled)
    return (
        f"of the version (--transform columns with a select= param naming every one of its "
        f"{len(others) + len(nulled)} columns but {but}) or "
    )


def _forms(kind: str) -> tuple[str, str]:
    """What EdgeDataset makes of a ``kind`` column (as NullCount spells it), and a keeping form.

    The second is the reader's form of such a column that keeps nulls, where there is one.
    """
    if kind.startswith(("list<", "large_list<")):
        return "EdgeDataset pads it into a tensor (ragged='padded', the default)", ""
    if "string" in kind or "binary" in kind:
        return (
            "EdgeDataset reads it as a packed column (binary='packed', the default)",
            "read it with binary='list' (None for each null), ",
        )
    return "EdgeDataset makes a tensor of it", ""


def null_warnings(found: Sequence[NullCount], columns: Sequence[str]) -> list[str]:
    """One warning per column with nulls: where, how many, why it matters, what to do.

    ``columns``: the version's columns, to spell a ``select=`` that leaves them out.
    """
    by_column: dict[str, list[NullCount]] = {}
    for each in found:
        by_column.setdefault(each.column, []).append(each)
    version = _select_advice([n for n in columns if n not in by_column], list(by_column))
    out = []
    for column, counts in by_column.items():
        total = sum(c.count for c in counts)
        listed = ", ".join(f"{c.url}: {c.count:,}" for c in counts[:3])
        more = f" and {len(counts) - 3} more" if counts[3:] else ""
        objects = f"{len(counts)} object{'s' if len(counts) != 1 else ''}"
        form, keeps = _forms(counts[0].kind)
        out.append(
            f"column {column!r} ({counts[0].kind}) holds {total:,} null"
            f"{'s' if total != 1 else ''} in {objects} ({listed}{more}); "
            f"{form}, which holds no null, so the batch holding one raises "
            "ValueError mid-epoch. Fill the nulls at the source and publish again, "
            f"{keeps}or leave the column out {version}of the reader "
            "(EdgeDataset columns=[...] without it)"
        )
    return out
