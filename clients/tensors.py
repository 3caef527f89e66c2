"""Arrow rows → batch tensors, with one copy, straight into (pinned) memory.

A batch is assembled from pieces of decoded chunks. Its tensors are allocated
once (from torch's pinned host allocator when pinning), and each piece's rows
are gathered from the chunk's Arrow buffers directly into their slice of the
batch tensor (``numpy.take(..., out=..., mode="clip")``, the rows checked to be in
range first): one copy, none more. Within a
batch, rows are ordered by where they come from, so each chunk's rows land in
one contiguous slice; the order inside a batch does not matter to training,
and it is still deterministic.

Column kinds:

* numbers and booleans → ``[batch]`` tensors;
* fixed-size lists of numbers (nested too) → ``[batch, d1, d2, …]``;
* variable-length lists of numbers → a ``[batch, longest]`` tensor padded with
  zeros, plus ``<name>_lengths`` (``[batch]``, int64);
* anything else (strings, binary, structs) → a Python list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["ColumnKind", "Gather", "assemble", "column_kinds", "fixed_views"]


@dataclass(frozen=True, slots=True)
class ColumnKind:
    """How one column becomes part of a batch."""

    name: str
    kind: str  # "fixed", "ragged" or "list"
    shape: tuple[int, ...] = ()  # per-sample shape of fixed columns
    dtype: np.dtype | None = None


def _fixed_shape(field_type: pa.DataType) -> tuple[tuple[int, ...], pa.DataType]:
    shape: list[int] = []
    while pa.types.is_fixed_size_list(field_type):
        shape.append(field_type.list_size)
        field_type = field_type.value_type
    return tuple(shape), field_type


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def column_kinds(schema: pa.Schema, columns: Sequence[str] | None) -> list[ColumnKind]:
    """Decide each requested column's kind; unknown column names are an error."""
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
            kinds.append(
                ColumnKind(name, "ragged", (), np.dtype(inner.value_type.to_pandas_dtype()))
            )
        else:
            kinds.append(ColumnKind(name, "list"))
    return kinds


@dataclass(frozen=True, slots=True)
class Gather:
    """Rows ``rows`` (offsets within ``batch``) of one decoded chunk.

    ``views`` may hold the chunk's fixed columns as numpy views already (see
    :func:`fixed_views`; a chunk is gathered from by many batches), and
    ``checked`` says the rows were checked to be within the chunk.
    """

    batch: pa.RecordBatch
    rows: np.ndarray
    views: Mapping[str, np.ndarray] | None = None
    checked: bool = False


def fixed_views(batch: pa.RecordBatch, kinds: Sequence[ColumnKind]) -> dict[str, np.ndarray]:
    """Numpy views of ``batch``'s fixed columns, ``[rows, *shape]`` each, for :class:`Gather`."""
    return {k.name: _values(batch.column(k.name), k) for k in kinds if k.kind == "fixed"}


def _values(column: pa.Array, kind: ColumnKind) -> np.ndarray:
    """A column's flat values as a ``[rows, *shape]`` numpy view (zero-copy where possible)."""
    if column.null_count:
        raise ValueError(
            f"column {kind.name!r} has nulls; tensors cannot hold them — fill them in the "
            "version's preprocessing or read the column as a list"
        )
    array = column
    for _ in kind.shape:
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=not pa.types.is_boolean(array.type))
    return values.reshape((len(column), *kind.shape))


def _pylist(column: pa.Array, rows: np.ndarray) -> list[object]:
    """Python values of ``rows``; binary and strings copied once, straight from the buffers."""
    t = column.type
    if column.null_count == 0 and (pa.types.is_binary(t) or pa.types.is_string(t)):
        offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[
            column.offset : column.offset + len(column) + 1
        ]
        data = memoryview(column.buffers()[2])
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


def assemble(
    gathers: Sequence[Gather],
    kinds: Sequence[ColumnKind],
    *,
    pin_memory: bool,
) -> dict[str, object]:
    """One batch: every requested column, rows in ``gathers`` order."""
    import torch

    for g in gathers:
        if not g.checked:
            _check_rows(g)
    size = sum(len(g.rows) for g in gathers)
    out: dict[str, object] = {}
    for kind in kinds:
        if kind.kind == "fixed":
            tensor = torch.empty(
                (size, *kind.shape),
                dtype=torch.from_numpy(np.empty(0, dtype=kind.dtype)).dtype,
                pin_memory=pin_memory,
            )
            target = tensor.numpy()
            offset = 0
            for g in gathers:
                if g.views is not None and kind.name in g.views:
                    source = g.views[kind.name]
                else:
                    source = _values(g.batch.column(kind.name), kind)
                # mode="clip" writes straight into ``out``; the default ("raise") gathers
                # into a temporary and copies it over (2-3x slower). Clipping never
                # happens: every row was checked to be in range above.
                np.take(
                    source, g.rows, axis=0, out=target[offset : offset + len(g.rows)], mode="clip"
                )
                offset += len(g.rows)
            out[kind.name] = tensor
        elif kind.kind == "ragged":
            lists = [g.batch.column(kind.name).take(pa.array(g.rows)) for g in gathers]
            lengths = np.concatenate(
                [np.asarray(c.value_lengths().fill_null(0)) for c in lists]
            ).astype(np.int64)
            longest = int(lengths.max(initial=0))
            tensor = torch.zeros(
                (size, longest),
                dtype=torch.from_numpy(np.empty(0, dtype=kind.dtype)).dtype,
                pin_memory=pin_memory,
            )
            target = tensor.numpy()
            row = 0
            for c in lists:
                flat = c.flatten().to_numpy(zero_copy_only=False)
                starts = np.asarray(c.offsets)[:-1] - c.offsets[0].as_py()
                for start, length in zip(
                    starts, np.asarray(c.value_lengths().fill_null(0)), strict=True
                ):
                    target[row, :length] = flat[start : start + length]
                    row += 1
            out[kind.name] = tensor
            out[f"{kind.name}_lengths"] = torch.from_numpy(lengths)
        else:
            values: list[object] = []
            for g in gathers:
                values.extend(_pylist(g.batch.column(kind.name), g.rows))
            out[kind.name] = values
    return out
