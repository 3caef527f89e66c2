"""Nulls in the columns a reader turns into tensors, found at publish rather than mid-epoch.

EdgeDataset makes a tensor of every number or boolean column (and of fixed-size
lists of them, nested too), a ``Packed`` of binary and string columns and a
padded tensor of variable-length lists of numbers, by default, and none of
them holds a null: a null there raises ValueError when the batch holding it
is assembled, which can be hours into training. Publish can tell beforehand, at no extra read:

* a Parquet object read from its footer alone has each column chunk's
  ``null_count`` statistic (:func:`parquet_nulls`); a column without it in any
  row group is not judged (the file is not read for it). A variable-length
  list's ``null_count`` counts its empty lists too, so a list column is judged
  from the footer's definition-level histograms instead (:func:`_list_nulls`);
* an object read whole (CSV, JSON Lines, Arrow, or any format under a transform
  that may drop rows) has its batches, counted after the transform
  (:func:`batch_nulls`);
* a Hive partition folder ``NAME=__HIVE_DEFAULT_PARTITION__`` makes every row of
  the objects under it null in column ``NAME``, from the keys alone
  (:func:`edgecache.cache.preprocess.partitions.partition_nulls`).

A null is not refused: a transform may fill it, or the reader may leave the column
out. Publish warns, naming the column, the object and the count.

Counts are of null values: a null row, and each null item inside a list (Parquet's
``null_count`` of a fixed-size list's leaf column counts both the same way).
"""

from __future__ import annotations

import shlex
import struct
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
    """Binary and strings (dictionary-encoded and views too): a ``Packed`` by default, no null.

    Views (``string_view``, which Polars writes) are read as the plain types are.
    """
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return (
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_binary_view(kind)
        or pa.types.is_fixed_size_binary(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_string_view(kind)
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


# The largest footer whose statistics publish reads (a footer of 3.3 MB, 300 columns in
# 100 row groups, took about a second in Python; typical ones are a few KB: milliseconds).
FOOTER_JUDGED = 512 << 10


def parquet_nulls(data: bytes | memoryview, schema: pa.Schema) -> dict[str, int]:
    """Null values per column of a Parquet object, from its footer alone.

    ``data`` is the object, or its footer framed as one (``PAR1`` + footer);
    ``schema`` the Arrow schema the footer gives. Only columns stored as one leaf
    (numbers, strings, lists of them) are counted: from the ``null_count``
    statistic, or for a variable-length list from :func:`_list_nulls`, and only
    when every row group answers: where a writer left it out, nothing is said. A
    compressed object (``.parquet.gz``) is not judged: its footer is not at hand;
    nor is one whose footer is over ``FOOTER_JUDGED``.
    """
    if compression_of(memoryview(data)[:10]) is not None:
        return {}
    if int.from_bytes(memoryview(data)[-8:-4], "little") > FOOTER_JUDGED:
        return {}  # decoded in Python (see _Footer): a very wide or long file is not judged
    meta = pq.read_metadata(pa.BufferReader(pa.py_buffer(data)))
    widths = [_leaves(field.type) for field in schema]
    if sum(widths) != meta.num_columns or len(set(schema.names)) != len(schema.names):
        return {}  # not the layout expected: say nothing rather than misname a column
    out: dict[str, int] = {}
    footer = _Footer(data)
    leaf = 0
    for field, width in zip(schema, widths, strict=True):
        first, leaf = leaf, leaf + width
        if width != 1:
            continue
        counts = [footer.null_count(g, first) for g in range(meta.num_row_groups)]
        if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            if counts and all(c == 0 for c in counts):
                out[field.name] = 0  # no level below the leaf's own: not even an empty list
                continue
            if (found := _list_nulls(meta, first, footer)) is not None:
                out[field.name] = found
        elif None not in counts:
            out[field.name] = sum(c for c in counts if c is not None)
    return out


def _list_nulls(meta: pq.FileMetaData, leaf: int, footer: _Footer) -> int | None:
    """Null values of a variable-length list column, stored as Parquet leaf ``leaf``.

    The leaf's ``null_count`` statistic counts every level recorded below the
    leaf's own: a null list, an empty list and a null item alike (pyarrow writes
    ``[[1, 2], [], [3]]`` and ``[[1, 2], None, [3]]`` with the same statistics, and
    the same ``num_values``), so it cannot tell. The column chunk's
    ``SizeStatistics`` can (Parquet format 2.10; pyarrow writes them by default,
    but does not show them, so the footer's Thrift is read here): its
    definition-level histogram counts the entries that stop at each
    level, and an entry stopping at an optional node is a null there, at a
    repeated node an empty list. Summed over the levels of optional nodes, it
    counts null lists and null items, as :func:`_array_nulls` does.

    Why the histograms rather than the column's validity read from a row group:
    they answer exactly, from the footer publish has fetched already (two small
    ranged reads), at no extra read. A column whose schema has no optional node
    (a non-nullable list of non-nullable items) holds no null whatever the
    statistics say (and a writer may leave such a histogram out). Where a row
    group lacks the histogram (an older writer) the footer cannot tell, and the
    column is not judged (None) rather than guessed: a warning for empty lists
    would be wrong, and the column's data is not at hand here (only the footer).
    """
    levels = footer.null_levels(leaf)
    if levels is None or len(levels) != meta.schema.column(leaf).max_definition_level:
        return None  # not the schema pyarrow read: say nothing
    nulls = [level for level, optional in enumerate(levels) if optional]
    if not nulls:
        return 0
    total = 0
    for group in range(meta.num_row_groups):
        histogram = footer.definition_levels(group, leaf)
        if histogram is None or len(histogram) != len(levels) + 1:
            return None
        total += sum(histogram[level] for level in nulls)
    return total


class _Footer:
    """What pyarrow does not show of a Parquet footer: repetitions and level histograms.

    That is each node's repetition along a leaf's path, and each column chunk's
    ``SizeStatistics.definition_level_histogram``, and the ``null_count``
    statistics (see :meth:`null_count` for why not pyarrow's). The footer
    (``FileMetaData``) is Thrift's compact protocol; it is decoded here once, on
    first use (it is in memory already, and small). Anything it cannot decode is
    not judged.
    """

    _REQUIRED, _OPTIONAL = 0, 1  # FieldRepetitionType; 2 is REPEATED

    def __init__(self, data: bytes | memoryview) -> None:
        raw = memoryview(data)
        length = int.from_bytes(raw[-8:-4], "little")
        self._raw = bytes(raw[-8 - length : -8])
        self._meta: dict[int, object] | None = None
        self._paths: list[list[int]] | None = None

    def _decoded(self) -> dict[int, object]:
        if self._meta is None:
            try:
                self._meta, _ = _thrift_struct(self._raw, 0, 0)
            except (IndexError, ValueError, struct.error):
                self._meta = {}
        return self._meta

    def null_levels(self, leaf: int) -> list[bool] | None:
        """For each definition level below the leaf's own, whether stopping there is a null.

        Each optional or repeated node on the leaf's path (the root left out) is one
        level: stopping at an optional node is a null there, at a repeated node an
        empty list. None when the schema cannot be read.
        """
        if self._paths is None:
            elements = self._decoded().get(2)
            self._paths = []
            if isinstance(elements, list) and elements:
                try:
                    self._walk(elements, 1, elements[0].get(5, 0), [])
                except (AttributeError, IndexError, TypeError, RecursionError):
                    self._paths = []  # a damaged or hostile schema: not judged
        if leaf >= len(self._paths):
            return None
        return [kind == self._OPTIONAL for kind in self._paths[leaf] if kind != self._REQUIRED]

    def _walk(self, elements: list, at: int, children: int, path: list[int]) -> int:
        """Record each leaf's path of repetitions under ``children`` nodes from ``at``."""
        for _ in range(children):
            node = elements[at]
            here = [*path, node.get(3, self._REQUIRED)]
            if node.get(5):  # num_children: a group
                at = self._walk(elements, at + 1, node[5], here)
            else:
                assert self._paths is not None
                self._paths.append(here)
                at += 1
        return at

    def null_count(self, group: int, leaf: int) -> int | None:
        """A column chunk's ``Statistics.null_count``, if written.

        Read here, not through pyarrow: pyarrow aborts the whole process (a C++
        exception it does not catch, no Python error) making the metadata of a
        damaged chunk that its footer reader otherwise accepts (a physical type not
        the schema's, a level histogram of the wrong size). Reading such an object's
        data fails later with an error naming it.
        """
        try:
            count = self._decoded()[4][group][1][leaf][3][12][3]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return None
        return count if isinstance(count, int) and count >= 0 else None

    def definition_levels(self, group: int, leaf: int) -> list[int] | None:
        """``SizeStatistics.definition_level_histogram`` of a column chunk, if written."""
        try:
            chunk = self._decoded()[4][group][1][leaf]  # type: ignore[index]
            histogram = chunk[3][16][3]
        except (KeyError, IndexError, TypeError):
            return None
        counts = isinstance(histogram, list) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in histogram
        )
        return histogram if counts else None  # a list of other items: a damaged footer


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _zigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


_DEPTH = 32  # deeper than any Parquet footer nests: a damaged one, not recursed into


def _thrift_value(raw: bytes, at: int, kind: int, depth: int) -> tuple[object, int]:
    """One compact-protocol value of type ``kind`` at ``at``: ``(value, next offset)``."""
    if kind in (1, 2):  # a boolean field holds its value in its type
        return kind == 1, at
    if kind == 3:
        return raw[at], at + 1
    if kind in (4, 5, 6):
        value, at = _varint(raw, at)
        return _zigzag(value), at
    if kind == 7:
        return struct.unpack_from("<d", raw, at)[0], at + 8
    if kind == 8:
        size, at = _varint(raw, at)
        return raw[at : at + size], at + size
    if kind in (9, 10):  # list, set
        head = raw[at]
        at += 1
        size, item = head >> 4, head & 0x0F
        if size == 15:
            size, at = _varint(raw, at)
        items: list[object] = []
        for _ in range(size):
            if item in (1, 2):  # a boolean item is one byte
                items.append(raw[at] == 1)
                at += 1
            else:
                each, at = _thrift_value(raw, at, item, depth)
                items.append(each)
        return items, at
    if kind == 12:
        return _thrift_struct(raw, at, depth + 1)
    raise ValueError(f"Thrift type {kind} is not in a Parquet footer")


def _thrift_struct(raw: bytes, at: int, depth: int) -> tuple[dict[int, object], int]:
    """A compact-protocol struct at ``at`` as ``{field id: value}``, and the next offset."""
    if depth > _DEPTH:
        raise ValueError("Thrift nested too deep")
    out: dict[int, object] = {}
    field = 0
    while True:
        head = raw[at]
        at += 1
        if head == 0:  # stop
            return out, at
        kind, delta = head & 0x0F, head >> 4
        if delta:
            field += delta
        else:
            value, at = _varint(raw, at)
            field = _zigzag(value)
        out[field], at = _thrift_value(raw, at, kind, depth)


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
    """``count`` null values in tensor column ``column`` (of type ``kind``) of object ``url``.

    ``folder``: for a Hive partition column, the object's key up to its
    ``NAME=__HIVE_DEFAULT_PARTITION__`` folder, which makes every row null (the
    advice then differs: the data has no such column to fill or select out).
    """

    column: str
    kind: str
    url: str
    count: int
    folder: str = ""


_SELECT_CHARS = 300  # a longer select= is said in words: a command must be pasted whole


def _select_advice(
    others: Sequence[str],
    nulled: Sequence[str],
    transform: str = "identity",
    params: Mapping[str, str] | None = None,
) -> str:
    """How to publish a version without the ``nulled`` columns, keeping ``others``.

    A command in a message is pasted as it is, so the ``select=`` names every
    column kept (quoted for the shell where a name needs it), never an ellipsis;
    past ``_SELECT_CHARS`` it is said in words instead. It is said in terms of
    the publish's own transform: under ``columns`` its params as a whole (select
    runs before rename, so it names the source's columns; a rename or a cast of
    a column left out goes too), pasted in place of those given; under any
    other transform (``images``, ``tokens``, a plugin), which has no select and
    cannot be given a second transform, nothing: the source and the reader are
    the ways out. A ``columns`` select added to such a publish was refused
    ("--transform given twice"), and one of the renamed names missed.
    """
    if not others or transform not in ("identity", "columns"):
        return ""
    given = dict(params or {})
    if transform == "identity":
        parts = ["select=" + ",".join(quote_name(n) for n in others)]
        where = "--transform columns "
        after = ""
    else:
        rename = {old: new for old, new, _ in param_pairs(given.get("rename", ""))}
        back = {new: old for old, new in rename.items()}
        parts = ["select=" + ",".join(quote_name(back.get(n, n)) for n in others)]
        kept = {old: new for old, new in rename.items() if new in others}
        if kept:
            parts.append(
                "rename=" + ",".join(f"{quote_name(o)}={quote_name(n)}" for o, n in kept.items())
            )
        cast = given.get("cast", "")
        if cast:
            if {k for k, _, _ in param_pairs(cast)} - set(others):
                return _in_words(others, nulled, "with the cast= of the columns left out dropped")
            parts.append(f"cast={cast}")
        where = ""
        after = " in place of the --param ones given"
    command = where + " ".join(f"--param {shlex.quote(p)}" for p in parts)
    if len(command) <= _SELECT_CHARS:
        return f"of the version ({command}{after}) or "
    return _in_words(others, nulled, "")


def _in_words(others: Sequence[str], nulled: Sequence[str], also: str) -> str:
    """The select advice said in words: too long to paste, or a cast to rewrite."""
    but = ", ".join(repr(n) for n in nulled)
    also = f", {also}" if also else ""
    return (
        f"of the version (--transform columns with a select= param naming every one of its "
        f"{len(others) + len(nulled)} columns but {but}{also}) or "
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


def null_warnings(
    found: Sequence[NullCount],
    columns: Sequence[str],
    transform: str = "identity",
    params: Mapping[str, str] | None = None,
) -> list[str]:
    """One warning per column with nulls: where, how many, why it matters, what to do.

    ``columns``: the version's columns, to spell a ``select=`` that leaves them out,
    under the publish's ``transform`` and its ``params`` (:func:`_select_advice`).
    A partition column's nulls (a ``folder`` given) are told their folder and the
    ways out of it instead: no ``select=`` reaches a column made of folders.
    """
    by_column: dict[str, list[NullCount]] = {}
    for each in found:
        by_column.setdefault(each.column, []).append(each)
    in_data = [n for n, counts in by_column.items() if not counts[0].folder]
    version = _select_advice([n for n in columns if n not in by_column], in_data, transform, params)
    out = []
    for column, counts in by_column.items():
        total = sum(c.count for c in counts)
        listed = ", ".join(f"{c.url}: {c.count:,}" for c in counts[:3])
        more = f" and {len(counts) - 3} more" if counts[3:] else ""
        objects = f"{len(counts)} object{'s' if len(counts) != 1 else ''}"
        form, keeps = _forms(counts[0].kind)
        where = _partition_cause(column, counts) if counts[0].folder else ""
        fix = (
            _partition_fix(column, counts, keeps)
            if counts[0].folder
            else f"Fill the nulls at the source and publish again, {keeps}or leave the "
            f"column out {version}"
        )
        out.append(
            f"column {column!r} ({counts[0].kind}) holds {total:,} null"
            f"{'s' if total != 1 else ''} in {objects} ({listed}{more}){where}; "
            f"{form}, which holds no null, so the batch holding one raises "
            f"ValueError mid-epoch. {fix}of the reader (EdgeDataset columns=[...] without it)"
        )
    return out


def _partition_cause(column: str, counts: Sequence[NullCount]) -> str:
    """Why a partition column holds nulls: the folder, as its keys spell it."""
    folder = counts[0].folder.rsplit("/", 1)[-1]
    return (
        f": they sit under the folder {folder}, Hive's, Spark's and pyarrow's name for a "
        f"null {column}, and publish makes a column of each key=value folder"
    )


def _partition_fix(column: str, counts: Sequence[NullCount], keeps: str) -> str:
    """What to do about a partition column's nulls: name them, leave them out, or the column.

    The data has no such column to fill or to select out (``--transform columns``
    sees the data's columns; the folders are added after it), so the way out is
    the folder itself: an ``--exclude`` pattern that matches the objects under
    it (keys under other folders first need a ``*/`` before it). ``keeps``: the
    reader's form that keeps nulls, as :func:`_forms` gives it.
    """
    folder = counts[0].folder.rsplit("/", 1)[-1]
    escaped = "".join(f"[{c}]" if c in "*?[" else c for c in folder)
    patterns = []
    if any("/" not in c.folder for c in counts):
        patterns.append(f"{escaped}/*")
    if any("/" in c.folder for c in counts):
        patterns.append(f"*/{escaped}/*")
    exclude = " ".join(f"--exclude {shlex.quote(p)}" for p in patterns)
    them = "them" if len(counts) != 1 else "it"
    return (
        f"Give those objects a {column} at the source (move {them} to a {column}=VALUE "
        f"folder) and publish again, leave {them} out ({exclude}), publish with "
        f"--partitioning none to make no column of the folders, {keeps}or leave the column out "
    )
