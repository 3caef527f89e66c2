"""How ranks and DataLoader workers consume the global order, and what is left of an epoch.

The global order (:mod:`edgecache.clients.shuffle`) gives every lane a
sequence of samples. What is *left* of an epoch is, per lane, a list of
intervals of lane positions (:class:`Remaining`): the whole lane when an epoch
starts, less what ranks consumed when a run is resumed.

* **Ranks.** Rank ``r`` of ``W`` takes the ``r``-th of ``W`` contiguous parts
  of what is left of each lane, as equal as they can be, and the parts a lane
  cannot split evenly are handed to the ranks in turn across lanes
  (:func:`rank_cuts`), so the ranks' shares of the epoch differ by at most
  one sample: their batch counts match (DDP steps in lockstep). Ranks read
  disjoint stretches of every stream: no window is read by more than the two
  ranks that meet in it.
* **Canonical batches.** A rank cuts each lane part into full batches and
  takes one from each lane in turn; the leftovers of all lanes (fewer than
  ``batch_size`` each) are then put together and cut again, so a rank yields
  at most one partial batch per epoch; a rank one batch short of the others
  (exactly ``k * batch_size`` samples where another has one more) splits its
  last batch in two, so every rank steps as often. With ``drop_last`` every
  rank yields the same number of full batches (the smallest any rank has)
  and none twice.
* **Workers.** DataLoader worker ``k`` of ``n`` yields canonical batches
  ``k, k+n, …``; the DataLoader's round-robin restores canonical order, so a
  rank yields the same batches for any ``n``. Full batches of lane ``l`` are
  canonical numbers ``l mod lanes`` (while every lane has batches left), so
  when ``n`` divides ``lanes`` a worker reads only its own lanes' windows.
* **Elastic resume.** After ``steps`` batches in lockstep (DDP), every rank's
  consumption is known from rank 0's count alone: :meth:`Remaining.after`
  removes it. The result is resumed at any world size and batch size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = ["RankBatches", "Remaining", "Span", "rank_cuts"]

Interval = tuple[int, int]


def _slice(intervals: Sequence[Interval], lo: int, hi: int) -> list[Interval]:
    """Offsets ``[lo, hi)`` of the concatenation of ``intervals``, as intervals."""
    out: list[Interval] = []
    offset = 0
    for a, b in intervals:
        size = b - a
        first, last = max(lo - offset, 0), min(hi - offset, size)
        if first < last:
            out.append((a + first, a + last))
        offset += size
        if offset >= hi:
            break
    return out


def _merge(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[0] < i[1]):
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def rank_cuts(sizes: Sequence[int], world_size: int, rank: int) -> list[int]:
    """Where rank ``rank``'s part of each lane starts (``rank = world_size``: each lane's end).

    Lane ``l`` of ``s = q * W + m`` samples gives every rank ``q`` and one more to
    ``m`` ranks. Those ``m`` go to the ranks in turn, continuing across lanes where
    the last lane's stopped: each rank gets at most one extra per lane and the
    ranks' totals differ by at most one. Splitting each lane on its own put every
    lane's remainder on the last ranks: 1500 samples in 4 lanes over 2 ranks gave
    748 and 752, 75 and 76 batches of 10, and a DDP job hung at the epoch's end.
    """
    cuts, turn = [], 0  # turn: the rank the next lane's first extra sample goes to
    for size in sizes:
        quotient, extra = divmod(size, world_size)
        # Extras of this lane go to ranks turn, turn + 1, … (mod W): count those below rank.
        wrapped = max(0, turn + extra - world_size)
        before = max(0, min(turn + extra, world_size, rank) - turn) + min(wrapped, rank)
        cuts.append(rank * quotient + before)
        turn = (turn + extra) % world_size
    return cuts


@dataclass(frozen=True)
class Remaining:
    """What is left of an epoch: per lane, sorted disjoint intervals of lane positions."""

    lanes: tuple[tuple[Interval, ...], ...]

    @staticmethod
    def whole(lengths: Sequence[int]) -> Remaining:
        """All of every lane: an epoch not started."""
        return Remaining(tuple(((0, n),) if n else () for n in lengths))

    def sizes(self) -> list[int]:
        """Samples left in each lane."""
        return [sum(b - a for a, b in lane) for lane in self.lanes]

    @property
    def samples(self) -> int:
        """Samples left in all lanes."""
        return sum(self.sizes())

    def to_json(self) -> list[list[list[int]]]:
        """A plain-list form for state dicts."""
        return [[[a, b] for a, b in lane] for lane in self.lanes]

    @staticmethod
    def from_json(data: object, lengths: Sequence[int]) -> Remaining:
        """Parse :meth:`to_json`; raises ValueError unless it fits lanes of ``lengths``."""
        if not isinstance(data, list) or len(data) != len(lengths):
            raise ValueError(f"expected {len(lengths)} lanes of intervals")
        lanes = []
        for lane, length in zip(data, lengths, strict=True):
            intervals = [(int(a), int(b)) for a, b in lane]
            if (
                any(not 0 <= a < b <= length for a, b in intervals)
                or _merge(intervals) != intervals
            ):
                raise ValueError(f"intervals {intervals} do not fit a lane of {length} samples")
            lanes.append(tuple(intervals))
        return Remaining(tuple(lanes))

    def after(
        self,
        world_size: int,
        batch_size: int,
        drop_last: bool,
        steps: int,
        *,
        per_lane: bool = False,
    ) -> Remaining:
        """What is left once every rank of ``world_size`` yielded ``steps`` batches (lockstep).

        A rank with fewer batches than ``steps`` yielded all of its own.
        ``per_lane``: the ranks split each lane on their own (states of format 3).
        """
        left: list[list[Interval]] = [[] for _ in self.lanes]
        for rank in range(world_size):
            batches = RankBatches(self, world_size, rank, batch_size, drop_last, per_lane=per_lane)
            taken = batches.consumed(min(steps, batches.batch_count))
            for lane, (part, used) in enumerate(zip(batches.parts, taken, strict=True)):
                size = sum(b - a for a, b in part)
                left[lane] += _slice(part, used, size)
        return Remaining(tuple(tuple(_merge(lane)) for lane in left))


def _cut(spans: list[Span], lo: int, hi: int) -> list[Span]:
    """Samples ``[lo, hi)`` of a batch made of ``spans``, in order."""
    out, offset = [], 0
    for span in spans:
        size = span.hi - span.lo
        a, b = max(lo - offset, 0), min(hi - offset, size)
        if a < b:
            out.append(Span(span.lane, span.lo + a, span.lo + b))
        offset += size
    return out


@dataclass(frozen=True, slots=True)
class Span:
    """Lane positions ``[lo, hi)`` of lane ``lane``: part of one batch."""

    lane: int
    lo: int
    hi: int


class RankBatches:
    """One rank's canonical batches over what is left of an epoch."""

    def __init__(
        self,
        remaining: Remaining,
        world_size: int,
        rank: int,
        batch_size: int,
        drop_last: bool,
        *,
        per_lane: bool = False,
    ) -> None:
        """Rank ``rank``'s part of ``remaining``, cut into canonical batches.

        ``per_lane``: split each lane on its own, remainders on the last ranks, as
        states of format 3 were consumed (only to resume them); else :func:`rank_cuts`.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..world_size-1, got {rank=} {world_size=}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.remaining, self.world_size, self.rank = remaining, world_size, rank
        self.batch_size, self.drop_last, self.per_lane = batch_size, drop_last, per_lane
        sizes = remaining.sizes()
        if per_lane:
            starts = [rank * n // world_size for n in sizes]
            ends = [(rank + 1) * n // world_size for n in sizes]
        else:
            starts = rank_cuts(sizes, world_size, rank)
            ends = rank_cuts(sizes, world_size, rank + 1)
        self.parts = [
            _slice(lane, lo, hi) for lane, lo, hi in zip(remaining.lanes, starts, ends, strict=True)
        ]
        self.lengths = [sum(b - a for a, b in part) for part in self.parts]
        self.full = [n // batch_size for n in self.lengths]
        self.full_total = sum(self.full)
        self.leftover = sum(n % batch_size for n in self.lengths)
        # Shares differ by at most one sample, so batch counts (ceil(share / batch)) differ
        # only when one rank holds exactly k full batches and another k full and one
        # sample: DDP would hang at the epoch's end on the rank with the extra step. Such
        # a rank splits its last batch in two (batch_size - 1, then 1), so every rank
        # steps as often and every sample is still read once.
        self.split_last = (
            not drop_last
            and not per_lane
            and batch_size > 1
            and sum(self.lengths) >= batch_size
            and self._own_count(False) < self._most_batches(sizes)
        )

    def _most_batches(self, sizes: Sequence[int]) -> int:
        """The most batches any rank has without drop_last: ceil(largest share / batch).

        :func:`rank_cuts` makes shares differ by at most one: the largest is
        ceil(total / world_size).
        """
        largest = -(-sum(sizes) // self.world_size)
        return -(-largest // self.batch_size)

    def _own_count(self, drop_last: bool) -> int:
        tail = (
            self.leftover // self.batch_size if drop_last else -(-self.leftover // self.batch_size)
        )
        return self.full_total + tail

    @cached_property
    def batch_count(self) -> int:
        """Batches this rank yields (equal on every rank with drop_last)."""
        if not self.drop_last:
            return self._own_count(False) + self.split_last
        return min(
            RankBatches(
                self.remaining, self.world_size, r, self.batch_size, False, per_lane=self.per_lane
            )._own_count(True)
            for r in range(self.world_size)
        )

    @property
    def samples(self) -> int:
        """Samples this rank yields."""
        if not self.drop_last:
            return sum(self.lengths)
        return self.batch_count * self.batch_size

    def _depth(self, number: int) -> tuple[int, int]:
        """(depth, lane) of full batch ``number``: lanes take turns, one batch each."""
        lo, hi = 0, max(self.full, default=0)
        while lo < hi:  # the largest depth d with number >= (batches above depth d)
            mid = (lo + hi + 1) // 2
            if sum(min(f, mid) for f in self.full) <= number:
                lo = mid
            else:
                hi = mid - 1
        skip = number - sum(min(f, lo) for f in self.full)
        lanes = [lane for lane, f in enumerate(self.full) if f > lo]
        return lo, lanes[skip]

    def _tail(self) -> list[tuple[int, int, int]]:
        """(lane, first part offset, last) of every lane's leftover, in lane order."""
        return [
            (lane, self.full[lane] * self.batch_size, n)
            for lane, n in enumerate(self.lengths)
            if n > self.full[lane] * self.batch_size
        ]

    def batch(self, number: int) -> list[Span]:
        """The lane positions of canonical batch ``number``."""
        if not 0 <= number < self.batch_count:
            raise IndexError(f"batch {number} of {self.batch_count}")
        last = self.batch_count - 2  # with split_last: the batch split in two
        if self.split_last and number >= last:
            spans = self._batch(last)
            keep = self.batch_size - 1
            return _cut(spans, 0, keep) if number == last else _cut(spans, keep, keep + 1)
        return self._batch(number)

    def _batch(self, number: int) -> list[Span]:
        if number < self.full_total:
            depth, lane = self._depth(number)
            lo = depth * self.batch_size
            pieces = [(lane, lo, lo + self.batch_size)]
        else:
            lo = (number - self.full_total) * self.batch_size
            hi = lo + self.batch_size
            pieces, offset = [], 0
            for lane, first, last in self._tail():
                size = last - first
                a, b = max(lo - offset, 0), min(hi - offset, size)
                if a < b:
                    pieces.append((lane, first + a, first + b))
                offset += size
        return [
            Span(lane, a, b) for lane, lo, hi in pieces for a, b in _slice(self.parts[lane], lo, hi)
        ]

    def reached(self, number: int) -> list[float]:
        """Lane positions where canonical batches from ``number`` on first read each lane.

        ``inf`` for a lane they read no more of. A lane's part is read front to back
        across canonical batches, so no batch from ``number`` on reads a position of
        that lane before this: whoever reads them (a worker, a rank's later batch).
        """
        out: list[float] = []
        for part, length, used in zip(self.parts, self.lengths, self.consumed(number), strict=True):
            if used >= length:
                out.append(math.inf)
                continue
            for a, b in part:
                if used < b - a:
                    out.append(a + used)
                    break
                used -= b - a
        return out

    def consumed(self, steps: int) -> list[int]:
        """Samples of each lane part used by the first ``steps`` canonical batches."""
        if self.split_last and steps >= self.batch_count - 1:
            used = self._consumed(self.batch_count - 1)  # through the batch split in two
            if steps == self.batch_count - 1:  # its last sample is the last batch, not read
                used[self._batch(self.batch_count - 2)[-1].lane] -= 1
            return used
        return self._consumed(steps)

    def _consumed(self, steps: int) -> list[int]:
        used = [0] * len(self.parts)
        full = min(steps, self.full_total)
        if full:
            depth, _ = self._depth(full - 1)
            skip = full - sum(min(f, depth) for f in self.full)
            at_depth = [lane for lane, f in enumerate(self.full) if f > depth][:skip]
            for lane, f in enumerate(self.full):
                batches = min(f, depth) + (1 if lane in at_depth else 0)
                used[lane] = batches * self.batch_size
        tail = max(0, min(steps - self.full_total, self.batch_count - self.full_total))
        left = tail * self.batch_size
        for lane, first, last in self._tail():
            take = min(left, last - first)
            used[lane] = first + take if take else used[lane]
            left -= take
        return used

    def batches_for(self, worker: int, workers: int, start: int = 0) -> range:
        """Canonical batch numbers worker ``worker`` of ``workers`` yields, resuming at ``start``.

        Worker 0 takes ``start``, worker 1 ``start + 1``, …: the DataLoader asks
        workers in that order, so it yields ``start, start + 1, …`` in order.
        """
        return range(start + worker, self.batch_count, workers)
