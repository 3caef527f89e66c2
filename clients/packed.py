"""Variable-length values of a batch as two tensors: the values concatenated, and offsets.

Why: a binary or string column as a Python list of ``bytes`` is one object
per sample, which a DataLoader worker pickles through a pipe for every batch
(the worker boundary cost nearly everything: 0.15x the speed of reading in
the main process, docs/benchmarks.md). Two tensors cross it through shared
memory instead, are copied into once (straight from the Arrow buffers), pin
and move to a GPU like any tensor (a GPU JPEG decoder takes uint8 tensors),
and still give each sample's bytes cheaply:

.. code-block:: python

    images = batch["image"]  # Packed: values uint8 [total], offsets int64 [B + 1]
    len(images)  # B
    images[3]  # bytes of sample 3 (str for a string column)
    images.view(3)  # the same as a uint8 tensor view, no copy
    images.tolist()  # list of bytes, as binary="list" would give
    tokens.padded()  # a packed numeric list column as [B, longest] + lengths

A ``Packed`` reads like a sequence (``len``, indexing, iteration, ``==``
with a list) but is deliberately not a ``collections.abc.Sequence``:
DataLoader's collate and pin functions would otherwise take it apart into a
list of items again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch

__all__ = ["Packed", "PackedKind"]

PackedKind = Literal["binary", "string", "list"]


# Unsigned dtypes (torch >= 2.3) → the signed dtype of their width, for what torch
# implements only for the signed ones.
_SIGNED_TWIN = {
    getattr(torch, f"uint{bits}"): getattr(torch, f"int{bits}")
    for bits in (16, 32, 64)
    if hasattr(torch, f"uint{bits}")
}


class Packed:
    """Variable-length values: item ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    ``kind`` says what an item is: ``"binary"`` → ``bytes``, ``"string"`` →
    ``str`` (UTF-8), ``"list"`` → a 1-D tensor of the list's numbers.
    """

    __slots__ = ("_bounds", "kind", "offsets", "values")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, kind: PackedKind) -> None:
        if offsets.dim() != 1 or len(offsets) < 1:
            raise ValueError(f"offsets must be 1-D with at least one entry, got {offsets.shape}")
        self.values, self.offsets, self.kind = values, offsets, kind
        self._bounds: np.ndarray | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (Packed, (self.values, self.offsets, self.kind))

    # --------------------------------------------------------------- reading

    def _offsets(self) -> np.ndarray:
        """The offsets as numpy (on the CPU), for cheap per-item slicing."""
        if self._bounds is None:
            self._bounds = self.offsets.cpu().numpy()
        return self._bounds

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> torch.Tensor:
        """Each item's length (bytes, or list entries), int64 ``[len]``."""
        return self.offsets[1:] - self.offsets[:-1]

    def view(self, index: int) -> torch.Tensor:
        """Item ``index`` as a view into ``values`` (no copy)."""
        bounds = self._offsets()
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} items")
        index %= n
        return self.values[int(bounds[index]) : int(bounds[index + 1])]

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            if self.kind == "list":  # tensors, as single items are
                return [self.view(i) for i in range(*index.indices(len(self)))]
            return self.tolist()[index]
        item = self.view(index)
        if self.kind == "list":
            return item
        data = item.cpu().numpy().tobytes()
        return data.decode() if self.kind == "string" else data

    def __iter__(self) -> Iterator[Any]:
        """The items as indexing gives them: bytes, str, or 1-D tensor views of a list."""
        if self.kind == "list":
            return (self.view(i) for i in range(len(self)))
        return iter(self.tolist())

    def tolist(self) -> list[Any]:
        """Every item: ``bytes`` / ``str``, or lists of numbers for a ``"list"`` column."""
        bounds = self._offsets()
        if self.kind == "list":
            flat = self.values.cpu().numpy().tolist()
            return [
                flat[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
            ]
        data = self.values.cpu().numpy().data
        out = [
            bytes(data[a:b]) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        ]
        return [b.decode() for b in out] if self.kind == "string" else out

    def padded(self, value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``[len, longest]`` tensor padded with ``value``, and the lengths (ragged="padded")."""
        lengths = self.lengths().cpu()
        longest = int(lengths.max()) if len(lengths) else 0
        out = torch.full((len(self), longest), value, dtype=self.values.dtype)
        total = int(lengths.sum())
        if total:
            first = int(self._offsets()[0])
            rows = torch.repeat_interleave(torch.arange(len(self)), lengths)
            row_starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
            values = self.values.cpu()[first : first + total]
            # torch has no index_put for uint16/32/64 on CPU ("not implemented for
            # 'UInt16'"): token ids stored as list<uint16> failed here. Their signed twin
            # of the same width moves the same bits.
            twin = _SIGNED_TWIN.get(out.dtype)
            if twin is not None:
                out.view(twin)[rows, torch.arange(total) - row_starts] = values.view(twin)
            else:
                out[rows, torch.arange(total) - row_starts] = values
        return out.to(self.values.device), lengths

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Packed):
            return (
                self.kind == other.kind
                and torch.equal(self.offsets - self.offsets[0], other.offsets - other.offsets[0])
                and self.tolist() == other.tolist()
            )
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable tensors: like lists, not hashable

    def __repr__(self) -> str:
        total = int(self._offsets()[-1] - self._offsets()[0]) if len(self.offsets) else 0
        return f"Packed({self.kind}, {len(self)} items, {total} values of {self.values.dtype})"

    # --------------------------------------------------------------- moving

    def pin_memory(self, device: Any = None) -> Packed:
        """Both tensors in pinned memory (DataLoader's ``pin_memory=True`` calls this)."""
        return Packed(self.values.pin_memory(), self.offsets.pin_memory(), self.kind)

    def is_pinned(self) -> bool:
        """Whether both tensors are in pinned host memory."""
        return bool(self.values.is_pinned() and self.offsets.is_pinned())

    def to(self, *args: Any, **kwargs: Any) -> Packed:
        """The values moved (or converted) like ``Tensor.to``; the offsets follow to its device."""
        values = self.values.to(*args, **kwargs)
        offsets = self.offsets.to(values.device, non_blocking=bool(kwargs.get("non_blocking")))
        return Packed(values, offsets, self.kind)

    def cpu(self) -> Packed:
        """Both tensors on the CPU (itself when they are), like ``Tensor.cpu``."""
        if self.values.device.type == "cpu" and self.offsets.device.type == "cpu":
            return self
        return Packed(self.values.cpu(), self.offsets.cpu(), self.kind)

    @property
    def device(self) -> torch.device:
        """Where the values are."""
        return self.values.device
