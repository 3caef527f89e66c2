"""The epoch order: which samples each rank and worker yields, in which order, exactly once.

Two parts, each a pure function, so every rank and machine computes the same
order without talking to the others (staging plans, which decide what to
copy into which region's cache, are another thing: ``cache/planner.py``):

* the **global order** of the epoch — every lane's sequence of samples, a
  function of the components' rows, seed, epoch and the shuffle knobs only
  (:mod:`edgecache.clients.shuffle`);
* its **consumption** — what is left of the epoch, which part of it each rank
  takes, the rank's canonical batches and which worker yields which
  (:mod:`edgecache.clients.partition`).

:class:`EpochOrder` puts them together: ``batch(n)`` says which rows of which
windows canonical batch ``n`` holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgecache.clients.partition import RankBatches, Remaining, Span
from edgecache.clients.shuffle import Component, Extent, GlobalOrder

__all__ = ["Batch", "Component", "EpochOrder", "Extent", "Piece", "Remaining", "runs"]


def runs(keys: np.ndarray) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of equal consecutive values in ``keys`` (none if empty).

    Slices over run boundaries rather than ``np.split``: this runs for every batch.
    """
    if not len(keys):
        return []
    ends = [*(np.flatnonzero(np.diff(keys)) + 1).tolist(), len(keys)]
    return list(zip([0, *ends[:-1]], ends, strict=True))


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a batch: positions ``positions`` of one window's order (this epoch's pass)."""

    window: int  # index into the global order's windows
    positions: np.ndarray


@dataclass(frozen=True, slots=True)
class Batch:
    """One canonical batch: its number, its pieces, and the lane spans it covers."""

    number: int
    pieces: tuple[Piece, ...]
    spans: tuple[Span, ...]

    @property
    def size(self) -> int:
        """Samples in the batch."""
        return sum(len(p.positions) for p in self.pieces)


class EpochOrder:
    """The order of one epoch for one rank: the global order and this rank's batches of it."""

    def __init__(
        self,
        components: Sequence[Component],
        *,
        seed: int,
        epoch: int,
        world_size: int = 1,
        rank: int = 0,
        batch_size: int = 1,
        drop_last: bool = False,
        lanes: int = 4,
        shuffle_windows: int = 16,
        shuffle: bool = True,
        remaining: Remaining | None = None,
        interleave: bool = True,
        passes_in_turn: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..world_size-1, got {rank=} {world_size=}")
        if batch_size < 1 or lanes < 1 or shuffle_windows < 1:
            raise ValueError(f"{batch_size=}, {lanes=} and {shuffle_windows=} must be positive")
        self.seed, self.epoch = seed, epoch
        self.world_size, self.rank = world_size, rank
        self.batch_size, self.drop_last = batch_size, drop_last
        self.order = GlobalOrder(
            components,
            seed=seed,
            epoch=epoch,
            lanes=lanes,
            shuffle_windows=shuffle_windows,
            shuffle=shuffle,
            interleave=interleave,
            passes_in_turn=passes_in_turn,
        )
        self.lane_lengths = [lane.length for lane in self.order.lanes]
        for lane in self.order.lanes:  # a batch's blocks, and the next batch's, stay kept
            block_rows = max(1, lane.length // max(lane.blocks, 1))
            lane.cache_blocks = max(8, 4 + 2 * (batch_size // block_rows))
        self.remaining = remaining or Remaining.whole(self.lane_lengths)
        self.ranks = RankBatches(self.remaining, world_size, rank, batch_size, drop_last)

    @property
    def batch_count(self) -> int:
        """Batches this rank yields (equal on every rank with drop_last)."""
        return self.ranks.batch_count

    @property
    def samples(self) -> int:
        """Samples this rank yields."""
        return self.ranks.samples

    @property
    def total(self) -> int:
        """Samples in the epoch (all ranks)."""
        return self.order.total

    def batch(self, number: int) -> Batch:
        """Which positions of which windows canonical batch ``number`` holds."""
        spans = self.ranks.batch(number)
        lanes = self.order.lanes
        positions = np.concatenate(
            [lanes[s.lane].positions(s.lo, s.hi) for s in spans] or [np.zeros(0, np.int64)]
        )
        units, offsets = self.order.samples_at(positions)
        windows = self.order.unit_window[units]
        ordering = np.argsort(windows, kind="stable")
        windows, offsets = windows[ordering], offsets[ordering]
        # One piece per run of equal windows.
        pieces = tuple(Piece(int(windows[a]), offsets[a:b]) for a, b in runs(windows))
        return Batch(number, pieces, tuple(spans))

    def batches_for(self, worker: int, workers: int, start: int = 0) -> range:
        """Canonical batch numbers worker ``worker`` of ``workers`` yields, from ``start``."""
        return self.ranks.batches_for(worker, workers, start)

    def remaining_after(self, steps: int) -> Remaining:
        """What is left once every rank yielded ``steps`` batches of this order (lockstep)."""
        return self.remaining.after(self.world_size, self.batch_size, self.drop_last, steps)

    def sample_ids(self, batch: Batch) -> list[tuple[int, int, int]]:
        """(component, shard, row) of every sample of ``batch``, in batch order."""
        out: list[tuple[int, int, int]] = []
        windows = self.order.windows
        for piece in batch.pieces:
            order = self.order.window_order(piece.window)
            rows = windows.row_start[piece.window] + order[piece.positions]
            comp, shard = int(windows.component[piece.window]), int(windows.shard[piece.window])
            out.extend((comp, shard, int(r)) for r in rows)
        return out
