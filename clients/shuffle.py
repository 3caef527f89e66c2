"""The global order of an epoch: which sample sits at each position of each lane.

A pure function of the components' rows, the seed, the epoch and three knobs
(``shuffle_windows``, ``lanes``, the window size); never of the world size,
the batch size or the number of DataLoader workers, so any of those may
change between a checkpoint and its resume. How ranks and workers consume it
is :mod:`edgecache.clients.partition`.

1. **Passes.** A component (one dataset version, or the rows of it that a
   ``rows=`` split keeps) is read in *passes*. A pass permutes the shards,
   cuts each shard into *windows* of ``window_rows`` consecutive rows and
   permutes the rows of each window. A window is what is read from a node
   and decoded at once; its rows depend on the manifest only, never on how a
   node chunked the shard, so any node can serve any part of the order.
   Windows lie on a grid from each shard's first row that, for rows of a
   fixed width, is the grid the encoder cut the chunks by: a window is then
   exactly one chunk (:mod:`edgecache.cache.row_grid`).
2. **The epoch sequence.** Epoch ``e`` takes samples ``[e*n, (e+1)*n)`` of
   the component's endless sequence of passes (``n`` its samples per epoch:
   all its rows, or its share of a mixture, :mod:`edgecache.clients.mixture`).
   When the epoch holds parts of two or more passes of a component, each part
   is spread over every stream at its own stretch of each (:func:`_keys`), so
   the streams read the passes in turn, not side by side (state format 6).
   Mixture components are interleaved window by window in proportion, so a
   stretch of many windows holds each component at its weight; a batch, which
   draws from ``per_lane`` windows, holds each in whole windows' worth: a
   component of weight ``p`` has a share of a batch of variance about
   ``p(1-p)/per_lane`` (all or nothing with one window per batch).
3. **Streams and lanes.** From a window chosen at random each epoch (and
   around), the sequence is cut into ``lanes * shuffle_windows`` *streams* of
   equal length (inside a window where need be: both streams read it, at the
   same time, so one reader decodes it once, but two DataLoader workers whose
   lanes the streams are each decode it; fewer
   streams when there are fewer than ``MIN_STREAM_WINDOWS`` windows for each,
   :func:`streams_per_lane`: small versions get less mixing, not reads that
   cannot spread over the epoch or that ranks share; a version of 10 windows
   gives each batch one window, whatever ``shuffle_windows`` says). Stream
   ``s`` belongs to lane ``s % lanes``, so each lane's streams are spread
   evenly over the whole sequence. A stream is read one window at a time,
   even streams front to back and odd ones back to front, so the two windows
   where streams meet are read at the same time.
4. **Blocks.** A lane's sequence is a series of *blocks*: block ``b`` takes
   the next few rows (``rows_per_stream``) of every stream of the lane and
   interleaves them: each stream's rows keep their order and are spread evenly
   over the block, and the streams take turns in a random order (every stream's
   rows of a window are already a random choice of it). Consecutive samples,
   hence every batch, are drawn from all ``shuffle_windows`` streams of the
   lane in proportion — from far-apart places in the data — while each stream
   has only one window open at a time, two only across the one place where it
   moves on: memory is about ``lanes * shuffle_windows`` windows. (A block
   permuted at random, as before state format 5, put a window's last rows
   anywhere in the block: every stream held two windows for the whole block,
   and the streams of a version whose windows are equal move on in the same
   block, so the windows held doubled at every move.)

With ``shuffle=False`` nothing is permuted and each lane has one stream: a
lane reads its part of the data in order.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = [
    "BLOCK_ROWS",
    "MIN_STREAM_WINDOWS",
    "Component",
    "Extent",
    "GlobalOrder",
    "Lane",
    "Units",
    "rng",
    "streams_per_lane",
]

BLOCK_ROWS = 1024  # rows a block aims at: a block draws about BLOCK_ROWS // K from each stream
MIN_STREAM_WINDOWS = 8  # fewer streams than shuffle_windows when the data has too few windows


def rng(*key: int | str) -> np.random.Generator:
    """A generator seeded from integers and strings, stable across machines and numpy versions."""
    text = b":".join(str(k).encode() for k in key)
    digest = hashlib.sha256(b"edgecache-order:" + text).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


@dataclass(frozen=True, slots=True)
class Extent:
    """Rows ``[row_start, row_start + rows)`` of shard ``shard``: part of a component."""

    shard: int
    row_start: int
    rows: int


@dataclass(frozen=True)
class Component:
    """One dataset version as the order sees it: which rows, how many per epoch, window size.

    ``key`` (``name@N``) seeds its permutations, so components never share them.
    """

    key: str
    extents: tuple[Extent, ...]
    window_rows: int
    samples: int  # samples it contributes to each epoch

    @property
    def rows(self) -> int:
        """Rows one pass holds."""
        return sum(e.rows for e in self.extents)


class Units:
    """The read units of an epoch, in epoch-sequence order.

    Unit ``u`` is positions ``[take_from, take_to)`` of the permuted order of one
    window (``rows`` rows from ``row_start`` of ``shard`` of ``component``, in pass
    ``pass_``), and occupies epoch positions ``[start, start + take_to - take_from)``.
    A window split between two streams, or between two epochs, is two units.
    """

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.component = columns["component"]
        self.pass_ = columns["pass_"]
        self.shard = columns["shard"]
        self.row_start = columns["row_start"]
        self.rows = columns["rows"]
        self.take_from = columns["take_from"]
        self.take_to = columns["take_to"]
        self.start = np.concatenate(([0], np.cumsum(self.take_to - self.take_from)))[:-1]

    def __len__(self) -> int:
        return len(self.shard)

    def of(self, positions: np.ndarray) -> np.ndarray:
        """The unit holding each epoch position."""
        return np.searchsorted(self.start, positions, side="right") - 1

    def select(self, index: np.ndarray) -> Units:
        """The units at ``index`` (their epoch positions are recomputed)."""
        return Units({name: getattr(self, name)[index] for name in _UNIT_COLUMNS})


_UNIT_COLUMNS = ("component", "pass_", "shard", "row_start", "rows", "take_from", "take_to")


def _windows(component: Component) -> Units:
    """The component's windows in canonical order (shards in order, rows in order).

    Windows lie on each shard's grid of ``window_rows`` rows from its first
    row, cut where an extent starts or ends: the grid the encoder cuts
    fixed-width rows into chunks by (:mod:`edgecache.cache.row_grid`), so such
    a window is one chunk, decoded once and held alone.
    """
    size = component.window_rows
    shard = np.array([e.shard for e in component.extents], dtype=np.int64)
    start = np.array([e.row_start for e in component.extents], dtype=np.int64)
    end = start + np.array([e.rows for e in component.extents], dtype=np.int64)
    first_cell = start // size
    counts = np.where(end > start, (end - 1) // size - first_cell + 1, 0)
    total = int(counts.sum())
    which = np.repeat(np.arange(len(counts)), counts)
    cell = first_cell[which] + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    row_start = np.maximum(cell * size, start[which])
    rows = np.minimum((cell + 1) * size, end[which]) - row_start
    zeros = np.zeros(total, dtype=np.int64)
    return Units(
        {
            "component": zeros,
            "pass_": zeros.copy(),
            "shard": shard[which],
            "row_start": row_start,
            "rows": rows,
            "take_from": zeros.copy(),
            "take_to": rows.copy(),
        }
    )


def _clip(units: Units, lo: int, hi: int) -> tuple[Units, np.ndarray]:
    """The part of ``units`` at positions ``[lo, hi)`` (cut at the edges), and which they were."""
    size = units.take_to - units.take_from
    end = units.start + size
    keep = np.nonzero((end > lo) & (units.start < hi))[0]
    out = units.select(keep)
    out.take_from = out.take_from + np.maximum(lo - units.start[keep], 0)
    out.take_to = out.take_to - np.maximum(end[keep] - hi, 0)
    return Units({name: getattr(out, name) for name in _UNIT_COLUMNS}), keep


def component_epoch(
    component: Component, index: int, seed: int, epoch: int, shuffle: bool
) -> Units:
    """Samples ``[epoch*n, (epoch+1)*n)`` of the component's endless sequence of passes.

    A pass visits the component's windows in a random order (the rows of each
    window in a random order too), so any stretch of a pass is a random
    choice of the component's *windows*, each taken whole — not a random
    sample of its rows: an epoch whose share is a window or two holds only
    those windows' rows (one class an epoch, for a component stored one class
    a window); the next epochs continue the pass. An under-weighted component continues where the
    last epoch stopped; an over-weighted one runs through several passes; no
    row repeats before a pass is complete. Within each pass the epoch's
    windows are then put back in canonical order: streams cut from that
    order are evenly spread over where the data is stored
    (:class:`GlobalOrder`), whatever its stored order correlates with.
    """
    rows, n = component.rows, component.samples
    if n == 0 or rows == 0:
        return _empty()
    canonical = _windows(component)
    lo, hi = epoch * n, (epoch + 1) * n
    parts = []
    for pass_ in range(lo // rows, (hi - 1) // rows + 1):
        visit = np.arange(len(canonical))
        if shuffle and n != rows:  # all of a pass is all windows: no need to choose
            visit = rng(seed, component.key, "pass", pass_).permutation(len(canonical))
        taken, keep = _clip(
            canonical.select(visit), max(lo - pass_ * rows, 0), min(hi - pass_ * rows, rows)
        )
        taken = taken.select(np.argsort(visit[keep], kind="stable"))
        taken.pass_[:] = pass_
        parts.append(taken)
    out = _concat(parts)
    out.component[:] = index
    return out


def _empty() -> Units:
    return Units({name: np.zeros(0, dtype=np.int64) for name in _UNIT_COLUMNS})


def _concat(parts: Sequence[Units]) -> Units:
    if not parts:
        return _empty()
    return Units({n: np.concatenate([getattr(p, n) for p in parts]) for n in _UNIT_COLUMNS})


def _keys(units: Units, n: int, streams: int, passes_in_turn: bool) -> np.ndarray:
    """Where each unit of a component goes in the epoch sequence, as a fraction of it.

    The middle of its span as a fraction of the component's epoch samples. When the
    epoch holds parts of two or more passes of the component (over-weighted, or the
    epoch where its next pass starts) and ``passes_in_turn``, each part is spread over
    every stream instead, at the part's own stretch of each stream: the ``k``-th
    ``streams``-th of a part (in its canonical order) goes to stream ``k``, from the
    part's share of the epoch before it on. Streams are read side by side, so the
    passes are then read one after another, and a row's second pass comes a pass
    later; cut one after the other, the passes were read at the same time (stream
    ``s`` the start of one pass while stream ``s + streams/2`` read the same windows
    of the next): a row came twice in a few batches, or in one.
    """
    size = units.take_to - units.take_from
    middle = units.start + size / 2
    if not passes_in_turn or len(units) == 0 or units.pass_[0] == units.pass_[-1]:
        return middle / max(n, 1)
    first = np.concatenate(([0], np.flatnonzero(np.diff(units.pass_)) + 1))  # each part
    part = np.repeat(np.arange(len(first)), np.diff(np.append(first, len(units))))
    part_start = units.start[first]
    part_len = np.append(part_start[1:], n) - part_start
    u = (middle - part_start[part]) / part_len[part] * streams  # stream + place in it
    stream = np.floor(u)
    return (stream + (part_start[part] + (u - stream) * part_len[part]) / n) / streams


def _interleave(
    parts: Sequence[Units], samples: Sequence[int], streams: int, passes_in_turn: bool
) -> Units:
    """Components' units merged so each stretch of the sequence holds each at its share.

    Each unit is placed where :func:`_keys` puts it; ties go to the earlier component.
    """
    keys = [
        _keys(units, n, streams, passes_in_turn) for units, n in zip(parts, samples, strict=True)
    ]
    if len(parts) == 1 and np.all(np.diff(keys[0]) >= 0):
        return parts[0]
    owners = [np.full(len(units), index) for index, units in enumerate(parts)]
    merged = _concat(parts)
    order = np.lexsort((np.concatenate(owners), np.concatenate(keys)))
    return merged.select(order)


def _split_at(units: Units, bounds: np.ndarray) -> tuple[Units, np.ndarray, np.ndarray]:
    """Units cut at the epoch positions ``bounds``; each piece's stream (bound index) and unit."""
    size = units.take_to - units.take_from
    total = int(size.sum())
    cuts = np.union1d(np.concatenate((units.start, [total])), bounds)
    cuts = cuts[(cuts >= 0) & (cuts <= total)]
    heads = cuts[:-1]
    source = units.of(heads)
    out = units.select(source)
    out.take_from = out.take_from + (heads - units.start[source])
    out.take_to = out.take_from + np.diff(cuts)
    stream = np.searchsorted(bounds, heads, side="right") - 1
    return Units({name: getattr(out, name) for name in _UNIT_COLUMNS}), stream, source


class Lane:
    """One lane: its streams merged block by block into a sequence of epoch positions.

    Block ``b`` takes rows ``[b*L//B, (b+1)*L//B)`` of each stream of length
    ``L`` (``B`` blocks), so the streams advance together and block starts
    are exact integers: the order is the same on every machine.
    """

    def __init__(
        self,
        index: int,
        starts: np.ndarray,
        lengths: np.ndarray,
        backward: np.ndarray,
        *,
        rows_per_stream: int,
        seed: int,
        epoch: int,
        shuffle: bool,
        interleave: bool = True,
    ) -> None:
        self.index = index
        self.interleave = interleave
        # Blocks kept worked out: a batch's spans and positions need the blocks it
        # covers, which :class:`EpochOrder` raises for batches of many blocks.
        self.cache_blocks = 8
        self.starts, self.lengths = starts.astype(np.int64), lengths.astype(np.int64)
        self.backward = backward.astype(bool)
        self.length = int(self.lengths.sum())
        longest = int(self.lengths.max(initial=0))
        self.blocks = -(-longest // rows_per_stream) if longest else 0
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def block_start(self, block: int | np.ndarray) -> int | np.ndarray:
        """Lane position where block ``block`` starts (``blocks`` gives the lane's length)."""
        b = np.asarray(block, dtype=np.int64)
        starts = (b[..., None] * self.lengths) // max(self.blocks, 1)
        total = starts.sum(axis=-1)
        return int(total) if np.ndim(block) == 0 else total

    @cached_property
    def _block_starts(self) -> np.ndarray:
        return np.asarray(self.block_start(np.arange(self.blocks + 1)))

    def block_of(self, position: int) -> int:
        """The block holding lane position ``position``."""
        return int(np.searchsorted(self._block_starts, position, side="right") - 1)

    def block(self, b: int) -> np.ndarray:
        """Epoch positions of block ``b``, in lane order."""
        return self._block(b)[0]

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block ``b``'s epoch positions in lane order, where each row of it lands, and ``base``.

        The second array gives, for the block's rows taken stream by stream (each
        stream's in reading order), its offset in the block; row ``r`` (reading order)
        of stream ``s`` is entry ``base[s] + r`` of it.
        """
        cached = self._cache.get(b)
        if cached is not None:
            self._cache.move_to_end(b)
            return cached
        blocks = max(self.blocks, 1)
        lo = (b * self.lengths) // blocks
        hi = ((b + 1) * self.lengths) // blocks
        counts = hi - lo
        streams = np.repeat(np.arange(len(counts)), counts)
        index = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - lo, counts)
        back = self.backward[streams]
        positions = self.starts[streams] + np.where(back, self.lengths[streams] - 1 - index, index)
        lands = np.arange(len(positions))
        if self.shuffle:
            generator = rng(self.seed, self.epoch, "block", self.index, b)
            if self.interleave:
                # Each stream's rows are spread evenly over the block, in reading order,
                # the streams taking turns in a random order: every stretch of the block
                # draws from each stream in proportion, and a stream moves from one window
                # to the next at one place in the block, not all over it (the old window
                # can be dropped as soon as the lane is read past that place).
                # From the raw bit stream, which numpy keeps stable across releases.
                noise = (generator.bit_generator.random_raw(len(positions)) >> 11) * 2.0**-53
                key = (index - np.repeat(lo, counts) + noise) / np.repeat(counts, counts)
                order = np.argsort(key, kind="stable")
            else:  # the order before state format 5, for resuming such a state
                order = generator.permutation(len(positions))
            positions = positions[order]
            lands[order] = np.arange(len(order))
        found = self._cache[b] = (positions, lands, np.cumsum(counts) - counts - lo)
        while len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)
        return found

    def _lane_position(self, b: int, stream: int, row: int) -> int:
        """Where row ``row`` (reading order) of ``stream``, which block ``b`` holds, lies."""
        _, lands, base = self._block(b)
        return int(self._block_starts[b]) + int(lands[int(base[stream]) + row])

    def positions(self, lo: int, hi: int) -> np.ndarray:
        """Epoch positions at lane positions ``[lo, hi)``."""
        if lo >= hi:
            return np.zeros(0, dtype=np.int64)
        parts = []
        b = self.block_of(lo)
        while lo < hi:
            start = int(self._block_starts[b])
            end = int(self._block_starts[b + 1])
            parts.append(self.block(b)[lo - start : min(hi, end) - start])
            lo = min(hi, end)
            b += 1
        return np.concatenate(parts)

    def span(self, stream: int, lo: int, hi: int) -> tuple[int, int]:
        """Lane positions from the first holding one of rows ``[lo, hi)`` to just past the last.

        (Of the blocks holding them, in an order whose blocks are permuted at random.)

        ``lo`` and ``hi`` count from the first epoch position of the lane's
        ``stream``-th stream (read from its end when it runs backward).
        """
        length = int(self.lengths[stream])
        if self.backward[stream]:
            lo, hi = length - hi, length - lo
        if hi <= lo:
            raise ValueError(f"no rows in [{lo}, {hi}) of stream {stream}")
        first = ((lo + 1) * self.blocks - 1) // length
        last = (hi * self.blocks - 1) // length
        if self.shuffle and not self.interleave:  # rows anywhere in their blocks
            return int(self._block_starts[first]), int(self._block_starts[last + 1])
        # Interleaved (or not shuffled), a stream's rows keep their reading order.
        return (
            self._lane_position(first, stream, lo),
            self._lane_position(last, stream, hi - 1) + 1,
        )


def streams_per_lane(windows: int, lanes: int, shuffle_windows: int, shuffle: bool) -> int:
    """Streams each lane has, hence windows each batch draws from: ``shuffle_windows`` at most.

    Fewer when the epoch has fewer than ``MIN_STREAM_WINDOWS * lanes *
    shuffle_windows`` windows (each stream holds at least ``MIN_STREAM_WINDOWS``):
    a version of 10 windows gives every batch one window, whatever
    ``shuffle_windows`` asks (EdgeDataset warns, naming a ``window_bytes`` that
    restores it). One without ``shuffle``.
    """
    if not shuffle:
        return 1
    return max(1, min(shuffle_windows, windows // (MIN_STREAM_WINDOWS * lanes)))


class GlobalOrder:
    """Every lane's sequence of samples for one epoch (see the module docstring)."""

    def __init__(
        self,
        components: Sequence[Component],
        *,
        seed: int,
        epoch: int,
        lanes: int,
        shuffle_windows: int,
        shuffle: bool = True,
        interleave: bool = True,
        passes_in_turn: bool = True,
    ) -> None:
        if lanes < 1 or shuffle_windows < 1:
            raise ValueError(f"{lanes=} and {shuffle_windows=} must be positive")
        self.components = list(components)
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.lane_count = lanes
        parts = [component_epoch(c, i, seed, epoch, shuffle) for i, c in enumerate(self.components)]
        # At least MIN_STREAM_WINDOWS windows a stream: reads stay spread over the
        # epoch, and ranks (which take a stretch of every stream) rarely share one.
        windows = sum(len(p) for p in parts)
        self.per_lane = streams_per_lane(windows, lanes, shuffle_windows, shuffle)
        streams = lanes * self.per_lane
        # (Without shuffle, a lane reads its part of the data in order, passes as they come.)
        in_turn = passes_in_turn and shuffle
        merged = _interleave(parts, [c.samples for c in self.components], streams, in_turn)
        self.total = int((merged.take_to - merged.take_from).sum())
        if shuffle and len(merged):  # where the streams are cut changes every epoch
            phase = int(rng(seed, epoch, "phase").integers(len(merged)))
            merged = merged.select(np.roll(np.arange(len(merged)), -phase))
        # Streams of equal length. A window cut in two by a stream end is read once
        # for both streams: they read it at the same time (see ``backward`` below).
        # Cut inside windows, streams move to their next window at different times,
        # so reads do not come in bursts.
        bounds = np.arange(streams + 1, dtype=np.int64) * self.total // streams
        self.windows = merged  # what is read and decoded at once: unit_window says which
        self.units, self.unit_stream, self.unit_window = _split_at(merged, bounds)
        firsts = np.searchsorted(self.unit_window, np.arange(len(merged)), side="left")
        self._window_units = np.append(firsts, len(self.units))
        smallest = min((c.window_rows for c in self.components), default=1)
        rows_per_stream = max(1, min(BLOCK_ROWS // self.per_lane, smallest))
        # Even streams are read front to back, odd ones back to front: where two
        # streams meet, both read their windows there at the same time (both at the
        # start of the epoch, or both at its end), so the chunk across that edge is
        # decoded once.
        backward = (np.arange(streams) % 2 == 1) & shuffle
        self.lanes = [
            Lane(
                lane,
                bounds[lane:streams:lanes],
                np.diff(bounds)[lane:streams:lanes],
                backward[lane::lanes],
                rows_per_stream=rows_per_stream,
                seed=seed,
                epoch=epoch,
                shuffle=shuffle,
                interleave=interleave,
            )
            for lane in range(lanes)
        ]
        self._bounds = bounds
        self._starts: dict[tuple[int, int, int], list[int]] | None = None
        self._window_spans: dict[int, list[tuple[int, int]]] = {}
        self._ends: dict[tuple[int, int, int], list[int]] | None = None

    def unit_span(self, unit: int) -> tuple[int, int, int]:
        """(lane, first, end): lane positions ``[first, end)`` hold every sample of ``unit``.

        ``first`` holds its first sample and ``end - 1`` its last (other streams'
        samples lie between them); no other lane position holds one.
        """
        stream = int(self.unit_stream[unit])
        lane = self.lanes[stream % self.lane_count]
        lo = int(self.units.start[unit]) - int(self._bounds[stream])
        hi = lo + int(self.units.take_to[unit] - self.units.take_from[unit])
        return (lane.index, *lane.span(stream // self.lane_count, lo, hi))

    def window_units_spans(self, window: int) -> list[tuple[int, int, int]]:
        """(lane, first, end) of each stream's part of ``window`` (see :meth:`unit_span`)."""
        units = range(int(self._window_units[window]), int(self._window_units[window + 1]))
        return [self.unit_span(u) for u in units]

    def window_spans(self, window: int) -> list[tuple[int, int]]:
        """(lane, end) for each stream that reads ``window``.

        No position of that lane from ``end`` on holds a sample of the window.
        Kept once worked out: a reader asks for every window it holds, per batch.
        """
        found = self._window_spans.get(window)
        if found is None:
            units = range(int(self._window_units[window]), int(self._window_units[window + 1]))
            found = self._window_spans[window] = [self.unit_span(u)[::2] for u in units]
        return found

    def neighbours(self, window: int) -> list[int]:
        """Windows right before and right after ``window`` in its shard, read whole this epoch.

        A read of one meets a read of the other at their shared edge (only whole
        windows are read edge to edge; an empty list for part of a window).
        """
        w = self.windows
        if self._starts is None:
            whole = np.flatnonzero((w.take_from == 0) & (w.take_to == w.rows))
            starts: dict[tuple[int, int, int], list[int]] = {}
            ends: dict[tuple[int, int, int], list[int]] = {}
            for i in whole.tolist():
                comp, shard, first = int(w.component[i]), int(w.shard[i]), int(w.row_start[i])
                starts.setdefault((comp, shard, first), []).append(i)
                ends.setdefault((comp, shard, first + int(w.rows[i])), []).append(i)
            self._starts, self._ends = starts, ends
        if w.take_from[window] != 0 or w.take_to[window] != w.rows[window]:
            return []
        comp, shard, first = (
            int(w.component[window]),
            int(w.shard[window]),
            int(w.row_start[window]),
        )
        after = self._starts.get((comp, shard, first + int(w.rows[window])), [])
        before = self._ends.get((comp, shard, first), []) if self._ends else []
        return before + after

    def window_order(self, window: int) -> np.ndarray:
        """Row offsets within window ``window``, in this pass's order (the whole window)."""
        w = self.windows
        rows = int(w.rows[window])
        if not self.shuffle:
            return np.arange(rows)
        component = self.components[int(w.component[window])]
        return rng(
            self.seed,
            component.key,
            "window",
            int(w.pass_[window]),
            int(w.shard[window]),
            int(w.row_start[window]),
        ).permutation(rows)

    def samples_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unit, position in the unit's window order) of each epoch position."""
        unit = self.units.of(positions)
        return unit, self.units.take_from[unit] + (positions - self.units.start[unit])
