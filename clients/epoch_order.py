"""The epoch order: which samples each rank and worker yields, in which order, exactly once.

Everything here is a pure function of (manifest, seed, epoch, world size, rank,
batch size, drop_last, lanes), so every rank and every machine computes the
same order without talking to each other. (Staging plans, which decide what
to copy into which region's cache, are another thing: ``cache/planner.py``.)

The order of one epoch:

1. Shards are permuted (seeded by ``seed`` and ``epoch``).
2. Each shard is cut into *windows* of ``window_rows`` consecutive rows; the
   rows of a window are permuted (seeded by seed, epoch, shard, window). A
   window is the unit of shuffling memory: at most one window per lane is
   decoded at a time. Windows depend on row counts only, never on how a node
   chunked the shard, so any node can serve any part of the order.
3. Concatenated, that is the global sample sequence; rank ``r`` of ``W`` takes
   the contiguous slice ``[r*N//W, (r+1)*N//W)`` of it.
4. A rank's windows are dealt round-robin to ``lanes`` lanes; each lane's
   sample stream is cut into batches, and the rank's *canonical batch
   sequence* takes one batch from each lane in turn. Consecutive batches
   therefore come from different windows (and usually different shards).
5. DataLoader worker ``k`` of ``n`` yields canonical batches ``k, k+n, …``;
   the DataLoader's round-robin puts them back in canonical order. The order
   a rank yields is therefore the same for any number of workers, and a
   single cursor (batches yielded) is a complete, portable resume state.
   When ``n`` divides ``lanes`` each worker reads only its own lanes' windows.

With ``drop_last`` the partial batch at the end of each lane is dropped and
every rank yields the same number of batches (the smallest any rank has), as
DDP needs; no sample is ever yielded twice.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["Batch", "EpochOrder", "Piece", "Window", "window_rows_for"]


def _rng(*key: int) -> np.random.Generator:
    """A generator seeded from integers, stable across machines and numpy versions."""
    # The prefix is part of every seed: changing it would change every order ever
    # saved in a resume state, so it keeps the module's old name.
    digest = hashlib.sha256(b"edgecache-plan:" + b":".join(str(k).encode() for k in key))
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest.digest()[:16], "little")))


def window_rows_for(row_bytes: float, window_bytes: int) -> int:
    """Rows per shuffle window for rows of about ``row_bytes``."""
    return int(min(max(window_bytes // max(row_bytes, 1.0), 1), 1 << 20))


@dataclass(frozen=True, slots=True)
class Window:
    """A shuffle window: rows ``[row_start, row_start + rows)`` of one shard.

    The slice ``[take_from, take_to)`` of their permuted order belongs to this rank.
    """

    shard: int
    index: int  # window number within the shard
    row_start: int
    rows: int
    take_from: int
    take_to: int
    seed: int
    epoch: int
    shuffle: bool = True

    def order(self) -> np.ndarray:
        """Row offsets (within the window) in this epoch's order, the rank's slice only."""
        if not self.shuffle:
            return np.arange(self.take_from, self.take_to)
        perm = _rng(self.seed, self.epoch, self.shard, self.index).permutation(self.rows)
        return perm[self.take_from : self.take_to]

    @property
    def samples(self) -> int:
        """How many of the window's samples this rank yields."""
        return self.take_to - self.take_from


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a batch: positions ``[start, stop)`` of one window's order."""

    window: int  # index into EpochOrder.windows
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Batch:
    """One canonical batch: its number and the window pieces that make it up."""

    number: int
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        """Samples in the batch."""
        return sum(p.stop - p.start for p in self.pieces)


class EpochOrder:
    """The order of one epoch for one rank: its windows, lanes and canonical batches."""

    def __init__(
        self,
        shard_rows: Sequence[int],
        *,
        window_rows: int,
        seed: int,
        epoch: int,
        world_size: int = 1,
        rank: int = 0,
        batch_size: int = 1,
        drop_last: bool = False,
        lanes: int = 8,
        shuffle: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..world_size-1, got {rank=} {world_size=}")
        if batch_size < 1 or window_rows < 1 or lanes < 1:
            raise ValueError(f"{batch_size=}, {window_rows=} and {lanes=} must be positive")
        self.shard_rows = list(shard_rows)
        self.window_rows = window_rows
        self.seed, self.epoch = seed, epoch
        self.world_size, self.rank = world_size, rank
        self.batch_size, self.drop_last, self.lanes = batch_size, drop_last, lanes
        self.shuffle = shuffle
        self.total = sum(self.shard_rows)
        self.windows = self._rank_windows(rank)

    def _shard_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.shard_rows))
        return _rng(self.seed, self.epoch).permutation(len(self.shard_rows))

    def _rank_windows(self, rank: int) -> list[Window]:
        lo = rank * self.total // self.world_size
        hi = (rank + 1) * self.total // self.world_size
        out: list[Window] = []
        position = 0
        for shard in self._shard_order():
            rows = self.shard_rows[shard]
            if position + rows <= lo:  # whole shard before this rank's slice
                position += rows
                continue
            for index, start in enumerate(range(0, rows, self.window_rows)):
                size = min(self.window_rows, rows - start)
                first, last = max(lo - position, 0), min(hi - position, size)
                if first < last:
                    out.append(
                        Window(
                            int(shard),
                            index,
                            start,
                            size,
                            first,
                            last,
                            self.seed,
                            self.epoch,
                            self.shuffle,
                        )
                    )
                position += size
                if position >= hi:
                    return out
        return out

    @cached_property
    def _lane_offsets(self) -> list[list[int]]:
        """Per lane, the lane-stream position where each of its windows starts (and the end)."""
        return [
            list(
                itertools.accumulate(
                    (w.samples for w in self.windows[lane :: self.lanes]), initial=0
                )
            )
            for lane in range(self.lanes)
        ]

    @cached_property
    def _lane_samples(self) -> list[int]:
        return [offsets[-1] for offsets in self._lane_offsets]

    def _full_batches(self) -> int:
        return sum(n // self.batch_size for n in self._lane_samples)

    @cached_property
    def batch_count(self) -> int:
        """Batches this rank yields this epoch (equal on every rank with drop_last)."""
        if not self.drop_last:
            return sum(-(-n // self.batch_size) for n in self._lane_samples)
        others = (
            EpochOrder(
                self.shard_rows,
                window_rows=self.window_rows,
                seed=self.seed,
                epoch=self.epoch,
                world_size=self.world_size,
                rank=r,
                batch_size=self.batch_size,
                drop_last=False,
                lanes=self.lanes,
                shuffle=self.shuffle,
            )._full_batches()
            for r in range(self.world_size)
            if r != self.rank
        )
        return min([self._full_batches(), *others])

    @cached_property
    def _sequence(self) -> list[tuple[int, int]]:
        """(lane, batch number within the lane) of each canonical batch."""
        per_lane = [
            (n // self.batch_size) if self.drop_last else -(-n // self.batch_size)
            for n in self._lane_samples
        ]
        out: list[tuple[int, int]] = []
        depth = 0
        while len(out) < sum(per_lane):
            for lane, count in enumerate(per_lane):
                if depth < count:
                    out.append((lane, depth))
            depth += 1
        return out[: self.batch_count]

    @property
    def samples(self) -> int:
        """Samples this rank yields this epoch."""
        return sum(self.batch(i).size for i in range(self.batch_count))

    def batch(self, number: int) -> Batch:
        """The pieces of canonical batch ``number``."""
        lane, depth = self._sequence[number]
        offsets = self._lane_offsets[lane]
        start = depth * self.batch_size
        stop = min(start + self.batch_size, offsets[-1])
        pieces: list[Piece] = []
        k = bisect.bisect_right(offsets, start) - 1  # the lane's window holding `start`
        while start < stop:
            lo, hi = start - offsets[k], min(stop, offsets[k + 1]) - offsets[k]
            if lo < hi:
                pieces.append(Piece(lane + k * self.lanes, lo, hi))
            start = offsets[k] + hi
            k += 1
        return Batch(number, tuple(pieces))

    def batches_for(self, worker: int, workers: int, start: int = 0) -> range:
        """Canonical batch numbers worker ``worker`` of ``workers`` yields, resuming at ``start``.

        Worker 0 takes ``start``, worker 1 ``start + 1``, …: the DataLoader asks
        workers in that order, so it yields ``start, start + 1, …`` in order.
        """
        return range(start + worker, self.batch_count, workers)
