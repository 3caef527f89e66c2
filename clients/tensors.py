"""Arrow rows → batch tensors, with one copy, straight into the batch's memory.

A batch is assembled from pieces of decoded chunks. Its columns are views of
one block of memory (:mod:`edgecache.clients.batch_memory`: reused buffers,
pinned memory, or a DataLoader worker's ring shared with the trainer), laid
out once per batch, and each piece's rows are gathered from the chunk's
Arrow buffers directly into their slice of it (``numpy.take(..., out=...,
mode="clip")``, the rows checked to be in range first): one copy, none more.
Within a batch, rows are ordered by where they come from, so each chunk's
rows land in one contiguous slice; the order inside a batch does not matter
to training, and it is still deterministic.

Column kinds (:func:`column_kinds`, then :func:`with_forms` for the
dataset's ``binary=`` and ``ragged=``):

* numbers and booleans → ``[batch]`` tensors;
* fixed-size lists of numbers or booleans (nested too) → ``[batch, d1, d2, …]``;
* variable-length lists of numbers or booleans → a ``[batch, longest]`` tensor
  padded with zeros, plus ``<name>_lengths`` (``[batch]``, int64) — or,
  ``ragged="packed"``, a :class:`~edgecache.clients.packed.Packed` of the values;
* binary (fixed-size too) and strings → a :class:`~edgecache.clients.packed.Packed`
  (one uint8 tensor of the values plus offsets; the default) or, ``binary="list"``,
  a Python list of ``bytes`` / ``str``;
* anything else (structs, nested lists of strings, timestamps, dates, durations,
  decimals) → a Python list of what pyarrow's ``to_pylist`` gives (``datetime``,
  ``Decimal``, …), pickled per sample by DataLoader workers.

A null raises ValueError naming the column in every tensor or ``Packed``
column (a null list too: read as an empty one, it was a sample quietly
changed); Python-list columns give ``None``.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import pyarrow as pa

from edgecache.clients.batch_memory import BatchMemory, FreshMemory, layout
from edgecache.clients.packed import Packed

__all__ = [
    "BinaryForm",
    "ColumnKind",
    "Gather",
    "RaggedForm",
    "RowTable",
    "assemble",
    "chunk_views",
    "column_kinds",
    "with_forms",
]

BinaryForm = Literal["packed", "list"]
RaggedForm = Literal["padded", "packed"]


@dataclass(frozen=True, slots=True)
class ColumnKind:
    """How one column becomes part of a batch.

    ``kind``: ``"fixed"``, ``"ragged"`` (padded), ``"packed"`` or ``"list"``;
    ``item`` says what a variable-length value is: ``"binary"``, ``"string"``
    or ``"list"`` (of numbers), whichever form it takes.
    """

    name: str
    kind: str
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None
    item: str = ""


def _fixed_shape(field_type: pa.DataType) -> tuple[tuple[int, ...], pa.DataType]:
    shape: list[int] = []
    while pa.types.is_fixed_size_list(field_type):
        shape.append(field_type.list_size)
        field_type = field_type.value_type
    return tuple(shape), field_type


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _bytes_like(t: pa.DataType) -> str:
    """``"binary"`` / ``"string"`` for binary and string types of any layout, else ``""``."""
    types = pa.types
    if types.is_binary(t) or types.is_large_binary(t) or types.is_binary_view(t):
        return "binary"
    if types.is_fixed_size_binary(t):
        return "binary"
    if types.is_string(t) or types.is_large_string(t) or types.is_string_view(t):
        return "string"
    return ""


def _unviewed(column: pa.Array) -> pa.Array:
    """A string_view / binary_view column as plain string / binary (others as they are).

    Versions published from Polars' files keep view columns; Arrow has no take for
    them ("no kernel matching input types (string_view, int64)"), and the packed
    form reads offsets, which views have none of. One copy of a chunk's column.
    """
    if pa.types.is_string_view(column.type):
        return column.cast(pa.string())
    if pa.types.is_binary_view(column.type):
        return column.cast(pa.binary())
    return column


def column_kinds(schema: pa.Schema, columns: Sequence[str] | None) -> list[ColumnKind]:
    """Decide each requested column's kind (default forms); unknown column names are an error."""
    names = list(columns) if columns is not None else schema.names
    missing = [n for n in names if n not in schema.names]
    if missing:
        raise KeyError(f"columns {missing} are not in the dataset; it has {schema.names}")
    kinds = []
    for name in names:
        shape, inner = _fixed_shape(schema.field(name).type)
        if _numeric(inner):
            kinds.append(ColumnKind(name, "fixed", shape, np.dtype(inner.to_pandas_dtype())))
        elif (
            (pa.types.is_list(inner) or pa.types.is_large_list(inner))
            and not shape
            and _numeric(inner.value_type)
        ):
            dtype = np.dtype(inner.value_type.to_pandas_dtype())
            kinds.append(ColumnKind(name, "ragged", (), dtype, "list"))
        elif not shape and _bytes_like(inner):
            kinds.append(ColumnKind(name, "packed", (), np.dtype(np.uint8), _bytes_like(inner)))
        elif not shape and pa.types.is_dictionary(inner) and _bytes_like(inner.value_type):
            # Strings stored as a dictionary (pandas categoricals in Parquet): packed from
            # the dictionary's values through the indices, like any string column; as lists
            # they were one pickled object per sample in workers.
            item = _bytes_like(inner.value_type)
            kinds.append(ColumnKind(name, "packed", (), np.dtype(np.uint8), item))
        else:
            kinds.append(ColumnKind(name, "list"))
    return kinds


def with_forms(
    kinds: Sequence[ColumnKind], *, binary: BinaryForm = "packed", ragged: RaggedForm = "padded"
) -> list[ColumnKind]:
    """``kinds`` with binary/string columns and numeric lists in the forms asked for."""
    if binary not in ("packed", "list"):
        raise ValueError(f"binary must be 'packed' or 'list', got {binary!r}")
    if ragged not in ("padded", "packed"):
        raise ValueError(f"ragged must be 'padded' or 'packed', got {ragged!r}")
    out = []
    for k in kinds:
        if k.item in ("binary", "string"):
            k = replace(k, kind="packed" if binary == "packed" else "list")
        elif k.item == "list":
            k = replace(k, kind="ragged" if ragged == "padded" else "packed")
        out.append(k)
    names = {k.name for k in out}
    for k in out:
        if k.kind == "ragged" and f"{k.name}_lengths" in names:
            raise ValueError(
                f"column {k.name!r} padded comes with its lengths as {k.name + '_lengths'!r}, "
                "which is also a column of the data: leave one out of columns=, or read "
                "the lists with ragged='packed' (no lengths column)"
            )
    return out


@dataclass(frozen=True, slots=True)
class Gather:
    """Rows ``rows`` (offsets within ``batch``) of one decoded chunk.

    ``views`` may hold what every gather from the chunk reuses (see
    :func:`chunk_views`; a chunk is gathered from by many batches), and
    ``checked`` says the rows were checked to be within the chunk.
    """

    batch: pa.RecordBatch
    rows: np.ndarray
    views: Mapping[str, np.ndarray | RowTable] | None = None
    checked: bool = False


def chunk_views(
    batch: pa.RecordBatch, kinds: Sequence[ColumnKind]
) -> dict[str, np.ndarray | RowTable]:
    """What every :class:`Gather` from a decoded chunk reuses, worked out once.

    Numpy views of its fixed columns (``[rows, *shape]``), and the
    :class:`RowTable` of each variable-length one.
    """
    views: dict[str, np.ndarray | RowTable] = {}
    for k in kinds:
        if k.kind == "fixed":
            views[k.name] = _values(batch.column(k.name), k)
        elif k.kind in ("ragged", "packed"):
            views[k.name] = _row_table(batch.column(k.name), k)
    return views


def _values(column: pa.Array, kind: ColumnKind) -> np.ndarray:
    """A column's flat values as a ``[rows, *shape]`` numpy view (zero-copy where possible)."""
    if column.null_count:
        raise ValueError(
            f"column {kind.name!r} has nulls, which a tensor of numbers cannot hold; leave it "
            "out (columns=[...] without it) or publish a version with the nulls filled in"
        )
    array = column
    for _ in kind.shape:
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=not pa.types.is_boolean(array.type))
    return values.reshape((len(column), *kind.shape))


def _pylist(column: pa.Array, rows: np.ndarray) -> list[object]:
    """Python values of ``rows``; binary and strings copied once, straight from the buffers."""
    column = _unviewed(column)
    t = column.type
    if column.null_count == 0 and (pa.types.is_binary(t) or pa.types.is_string(t)):
        offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[
            column.offset : column.offset + len(column) + 1
        ]
        data = memoryview(column.buffers()[2] or b"")
        blobs = [bytes(data[offsets[i] : offsets[i + 1]]) for i in rows]
        return [b.decode() for b in blobs] if pa.types.is_string(t) else list(blobs)
    return column.take(pa.array(rows)).to_pylist()


def _check_rows(gather: Gather) -> None:
    """Every row index must be within its chunk (gathers copy with ``mode="clip"``)."""
    rows = gather.rows
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= gather.batch.num_rows):
        raise IndexError(
            f"row indices {int(rows.min())}..{int(rows.max())} are outside the chunk's "
            f"{gather.batch.num_rows} rows"
        )


@dataclass(slots=True)
class _Ranges:
    """Where the variable-length values of a gather's rows lie in one flat source array."""

    source: np.ndarray  # the chunk column's values, flat
    starts: np.ndarray  # int64, per row
    lengths: np.ndarray  # int64, per row
    total: int  # the sum of lengths


@dataclass(frozen=True, slots=True)
class RowTable:
    """Where each row of a chunk's variable-length column lies among its flat values (views).

    Worked out once per decoded chunk (:func:`chunk_views`), not for each batch
    that gathers rows from it: a batch gathers from a dozen chunks, and this
    was a dozen numpy and pyarrow calls per chunk and batch.
    """

    source: np.ndarray  # the column's values, flat
    bounds: np.ndarray  # where row i's values start (bounds[i]) and end (bounds[i + 1])
    index: np.ndarray | None = None  # dictionary columns: each row's dictionary entry
    # ``bounds`` as Python ints, where the values are bytes of _LARGE_VALUE or more a row
    # on average and not a dictionary's (images, documents): see _byte_spans.
    large: list[int] | None = None

    def ranges(self, rows: np.ndarray) -> _Ranges:
        """The values of ``rows``, without copying them."""
        at = rows if self.index is None else self.index[rows].astype(np.int64)
        starts = self.bounds[at].astype(np.int64)
        lengths = self.bounds[at + 1] - starts
        return _Ranges(self.source, starts, lengths, int(lengths.sum()))


def _flat(buffer: pa.Buffer | None) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint8) if buffer is not None else np.empty(0, np.uint8)


def _no_nulls(column: pa.Array, kind: ColumnKind) -> None:
    if column.null_count:
        raise ValueError(
            f"column {kind.name!r} has nulls, which a packed column cannot hold; read it "
            "with binary='list' (None for each null) or fill them in preprocessing"
        )


def _row_table(column: pa.Array, kind: ColumnKind) -> RowTable:
    """Where the values of each row of a binary, string or list-of-numbers column lie."""
    if kind.item == "list":
        if column.null_count:  # read as an empty list, it was a sample quietly changed
            raise ValueError(
                f"column {kind.name!r} has nulls (a null list), which a tensor of numbers "
                "cannot hold; leave it out (columns=[...] without it) or publish a version "
                "with the nulls filled in (an empty list, say)"
            )
        if column.values.null_count:
            raise ValueError(
                f"column {kind.name!r} has null list entries; tensors cannot hold them"
            )
        # offsets are sliced with the array; values are not
        return RowTable(column.values.to_numpy(zero_copy_only=False), np.asarray(column.offsets))
    _no_nulls(column, kind)
    if pa.types.is_fixed_size_binary(column.type):
        width = column.type.byte_width
        bounds = (column.offset + np.arange(len(column) + 1, dtype=np.int64)) * width
        return RowTable(_flat(column.buffers()[1]), bounds)
    column = _unviewed(column)
    index = None
    if pa.types.is_dictionary(column.type):  # the values through the indices
        index = column.indices.to_numpy(zero_copy_only=False)
        column = _unviewed(column.dictionary)  # a dictionary of views has no offsets either
        if column.null_count:
            raise ValueError(
                f"column {kind.name!r} has nulls in its dictionary, which a packed column "
                "cannot hold; read it with binary='list'"
            )
    width = (
        np.int64
        if pa.types.is_large_binary(column.type) or pa.types.is_large_string(column.type)
        else np.int32
    )
    bounds = np.frombuffer(column.buffers()[1], dtype=width)[
        column.offset : column.offset + len(column) + 1
    ]
    large = None
    if index is None and len(bounds) > 1:
        if int(bounds[-1]) - int(bounds[0]) >= _LARGE_VALUE * (len(bounds) - 1):
            large = bounds.tolist()
    return RowTable(_flat(column.buffers()[2]), bounds, index, large)


def _ranges(gather: Gather, kind: ColumnKind) -> _Ranges:
    """The values of a gather's rows of a variable-length column, from its chunk's table."""
    table = gather.views.get(kind.name) if gather.views is not None else None
    if not isinstance(table, RowTable):
        table = _row_table(gather.batch.column(kind.name), kind)
    return table.ranges(gather.rows)


# Bytes per row, on average, from which rows are copied whole (memcpy-sized) rather than
# gathered through an index array.
_LARGE_VALUE = 512


def _copy_ranges(ranges: _Ranges, out: np.ndarray) -> None:
    """Each row's values, one after the other, into ``out`` (as long as their total)."""
    lengths, total = ranges.lengths, ranges.total
    if not total:
        return
    if total >= _LARGE_VALUE * len(lengths):  # one memcpy each beats an index array
        # memoryview slice assignment copies with the GIL held. numpy drops the GIL
        # around each copy and must take it back after, and with the pipeline's other
        # threads running Python each take-back can wait out a switch interval: two
        # threads copying 100 KiB rows that way ran at 0.03-0.05 GB/s beside two busy
        # threads, against 1.1-1.4 GB/s like this (a memcpy of a row is microseconds).
        width = ranges.source.itemsize
        source = ranges.source.view(np.uint8).data  # a memoryview
        target = out.view(np.uint8).data
        position = 0
        starts, sizes = (ranges.starts * width).tolist(), (lengths * width).tolist()
        for start, length in zip(starts, sizes, strict=True):
            target[position : position + length] = source[start : start + length]
            position += length
        return
    before = np.cumsum(lengths) - lengths
    index = np.arange(total, dtype=np.int64) + np.repeat(ranges.starts - before, lengths)
    np.take(ranges.source, index, out=out[:total], mode="clip")


_NOT_WRITABLE = "The given NumPy array is not writable"


# Per gather: its chunk's flat bytes, and where each of its rows' values starts and ends.
_Spans = list[tuple[np.ndarray, list[int], list[int]]]


def _byte_spans(gathers: Sequence[Gather], kind: ColumnKind) -> _Spans | None:
    """Where a batch's large byte values lie, as Python ints; None unless every chunk has them.

    A batch of images gathers two or three rows from each of a dozen chunks: per
    gather, the numpy calls of :meth:`RowTable.ranges` and :func:`_copy_ranges`
    (indexing, casts, sums, ``tolist``) cost more than indexing a list of ints per
    row (~10 % of an images epoch over ``lmdb://`` at ``num_workers=0``).
    """
    spans: _Spans = []
    for g in gathers:
        table = g.views.get(kind.name) if g.views is not None else None
        if not isinstance(table, RowTable) or table.large is None:
            return None
        bounds, rows = table.large, g.rows.tolist()
        spans.append((table.source, [bounds[r] for r in rows], [bounds[r + 1] for r in rows]))
    return spans


def _copy_spans(spans: _Spans, out: np.ndarray) -> None:
    """Every span's bytes, one after the other, into ``out`` (exactly their total long).

    One ``torch.cat`` (the GIL dropped once a batch) where torch's intra-op pool is one
    thread, row by row with the GIL held otherwise (:func:`_copy_all` says why).
    """
    import torch

    if torch.get_num_threads() == 1:
        with warnings.catch_warnings():
            # Values read from LMDB are read-only memory, which torch warns must not be
            # written through a tensor. These tensors are only the copy's sources.
            warnings.filterwarnings("ignore", _NOT_WRITABLE, UserWarning)
            pieces = [
                torch.from_numpy(source[start:end])
                for source, starts, ends in spans
                for start, end in zip(starts, ends, strict=True)
            ]
        if pieces:
            torch.cat(pieces, out=torch.from_numpy(out))
        return
    target = out.data
    position = 0
    for source, starts, ends in spans:
        data = source.data
        for start, end in zip(starts, ends, strict=True):
            target[position : position + end - start] = data[start:end]
            position += end - start


def _copy_all(parts: Sequence[_Ranges], out: np.ndarray) -> None:
    """Every part's rows, one part after the other, into ``out`` (exactly their total long).

    Large byte values (images, documents) are copied by one ``torch.cat`` per batch where
    torch's intra-op pool is one thread (DataLoader workers set it so): the GIL is dropped
    once for the whole batch, so the process's fetch threads run Python meanwhile (+11-15 %
    images samples/s at ``num_workers=0`` with one intra-op thread, measured on 2 cores).
    With more threads, torch splits the copy over an OpenMP team that doubles its CPU
    (40 % slower epochs here), so the rows are copied with the GIL held instead
    (:func:`_copy_ranges`).
    """
    import torch

    total = len(out)
    rows = sum(len(p.lengths) for p in parts)
    if (
        out.dtype == np.uint8
        and total >= _LARGE_VALUE * rows > 0
        and all(p.source.dtype == np.uint8 for p in parts)
        and torch.get_num_threads() == 1
    ):
        _copy_spans(
            [(p.source, p.starts.tolist(), (p.starts + p.lengths).tolist()) for p in parts], out
        )
        return
    position = 0
    for part in parts:
        _copy_ranges(part, out[position:])
        position += part.total


def assemble(
    gathers: Sequence[Gather],
    kinds: Sequence[ColumnKind],
    *,
    pin_memory: bool = False,
    memory: BatchMemory | None = None,
    extra: Mapping[str, np.ndarray] | None = None,
) -> dict[str, object]:
    """One batch: every requested column, rows in ``gathers`` order, in one block of ``memory``.

    Without ``memory``, a fresh (pinned, with ``pin_memory``) block. ``extra``
    columns (computed by the caller, one value per row) go into the block too.
    """
    import torch

    for g in gathers:
        if not g.checked:
            _check_rows(g)
    size = sum(len(g.rows) for g in gathers)
    # First what every column needs (so the batch is one block), then the copies.
    ranges: dict[str, list[_Ranges]] = {}
    spans: dict[str, tuple[_Spans, list[int]]] = {}  # packed large bytes: _byte_spans
    sizes: list[int] = []
    plans: list[tuple[ColumnKind, int]] = []  # (kind, longest or total values)
    for kind in kinds:
        itemsize = kind.dtype.itemsize if kind.dtype is not None else 0
        if kind.kind == "fixed":
            sizes.append(size * math.prod(kind.shape) * itemsize)
            plans.append((kind, 0))
        elif kind.kind == "packed" and (byte_spans := _byte_spans(gathers, kind)) is not None:
            lengths = [
                e - s for _, starts, ends in byte_spans for s, e in zip(starts, ends, strict=True)
            ]
            spans[kind.name] = (byte_spans, lengths)
            total = sum(lengths)
            sizes += [total, (size + 1) * 8]
            plans.append((kind, total))
        elif kind.kind in ("ragged", "packed"):
            parts = [_ranges(g, kind) for g in gathers]
            ranges[kind.name] = parts
            if kind.kind == "ragged":
                longest = max((int(p.lengths.max()) for p in parts if len(p.lengths)), default=0)
                sizes += [size * longest * itemsize, size * 8]
                plans.append((kind, longest))
            else:
                total = sum(p.total for p in parts)
                sizes += [total * itemsize, (size + 1) * 8]
                plans.append((kind, total))
        else:
            plans.append((kind, 0))
    extras = dict(extra or {})
    sizes += [a.nbytes for a in extras.values()]
    offsets, nbytes = layout(sizes)
    block = (memory or FreshMemory(pin_memory)).allocate(nbytes)
    area = block.array()
    places = iter(zip(offsets, sizes, strict=True))
    out: dict[str, object] = {}
    for kind, extent in plans:
        dtype = torch.from_numpy(np.empty(0, dtype=kind.dtype)).dtype if kind.dtype else None
        npdtype = kind.dtype if kind.dtype is not None else np.dtype(np.uint8)
        if kind.kind == "fixed":
            at, length = next(places)
            target = area[at : at + length].view(npdtype).reshape((size, *kind.shape))
            row = 0
            for g in gathers:
                view = g.views.get(kind.name) if g.views is not None else None
                source = (
                    view
                    if isinstance(view, np.ndarray)
                    else _values(g.batch.column(kind.name), kind)
                )
                # mode="clip" writes straight into ``out``; the default ("raise") gathers
                # into a temporary and copies it over (2-3x slower). Clipping never
                # happens: every row was checked to be in range above.
                np.take(source, g.rows, axis=0, out=target[row : row + len(g.rows)], mode="clip")
                row += len(g.rows)
            out[kind.name] = block.tensor(at, length, dtype, (size, *kind.shape))  # type: ignore[arg-type]
        elif kind.kind == "ragged":
            (at, length), (lat, llen) = next(places), next(places)
            target = area[at : at + length].view(npdtype).reshape(size, extent)
            target[...] = 0  # reused memory: the padding must be written
            all_lengths = area[lat : lat + llen].view(np.int64)
            row = 0
            for part in ranges[kind.name]:
                n = len(part.lengths)
                all_lengths[row : row + n] = part.lengths
                total = part.total
                if total:
                    flat = np.empty(total, dtype=kind.dtype)
                    _copy_ranges(part, flat)
                    before = np.cumsum(part.lengths) - part.lengths
                    within = np.arange(total) - np.repeat(before, part.lengths)
                    rows_of = np.repeat(np.arange(row, row + n), part.lengths)
                    target[rows_of, within] = flat
                row += n
            out[kind.name] = block.tensor(at, length, dtype, (size, extent))  # type: ignore[arg-type]
            out[f"{kind.name}_lengths"] = block.tensor(lat, llen, torch.int64, (size,))
        elif kind.kind == "packed":
            (at, length), (oat, olen) = next(places), next(places)
            bounds = area[oat : oat + olen].view(np.int64)
            bounds[0] = 0
            if kind.name in spans:  # large bytes: spans as ints (_byte_spans)
                byte_spans, lengths = spans[kind.name]
                bounds[1:] = list(itertools.accumulate(lengths))
                _copy_spans(byte_spans, area[at : at + length])
            else:
                row, position = 0, 0
                for part in ranges[kind.name]:
                    n = len(part.lengths)
                    np.cumsum(part.lengths, out=bounds[row + 1 : row + n + 1])
                    bounds[row + 1 : row + n + 1] += position
                    position += part.total
                    row += n
                _copy_all(ranges[kind.name], area[at : at + length].view(npdtype)[:position])
            out[kind.name] = Packed(
                block.tensor(at, length, dtype, (extent,)),  # type: ignore[arg-type]
                block.tensor(oat, olen, torch.int64, (size + 1,)),
                kind.item,  # type: ignore[arg-type]
            )
        else:
            values_list: list[object] = []
            for g in gathers:
                values_list.extend(_pylist(g.batch.column(kind.name), g.rows))
            out[kind.name] = values_list
    for name, values in extras.items():
        at, length = next(places)
        area[at : at + length] = values.view(np.uint8)
        out[name] = block.tensor(at, length, torch.from_numpy(values[:0]).dtype, values.shape)
    return out
