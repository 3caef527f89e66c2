"""Property tests of the epoch order: exact-once, determinism, resumption, elasticity, mixtures."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from edgecache.clients.epoch_order import Component, EpochOrder, Extent, Remaining
from edgecache.clients.mixture import allocate, split_extents


def component(shard_rows: list[int], window_rows: int, key: str = "d@1", samples=None):  # noqa: ANN001, ANN201
    extents = tuple(Extent(s, 0, n) for s, n in enumerate(shard_rows) if n)
    total = sum(shard_rows)
    return Component(key, extents, window_rows, total if samples is None else samples)


def epoch_samples(order: EpochOrder, numbers) -> list[tuple[int, int, int]]:  # noqa: ANN001
    return [s for n in numbers for s in order.sample_ids(order.batch(n))]


def everything(shard_rows: list[int]) -> set[tuple[int, int, int]]:
    return {(0, s, r) for s, rows in enumerate(shard_rows) for r in range(rows)}


configs = st.fixed_dictionaries(
    {
        "shard_rows": st.lists(st.integers(0, 300), min_size=1, max_size=8),
        "window_rows": st.integers(1, 64),
        "seed": st.integers(0, 2**32),
        "epoch": st.integers(0, 5),
        "world_size": st.integers(1, 4),
        "batch_size": st.integers(1, 40),
        "lanes": st.integers(1, 5),
        "shuffle_windows": st.integers(1, 6),
        "shuffle": st.booleans(),
    }
)


def order_of(cfg: dict, **changes: object) -> EpochOrder:
    cfg = {**cfg, **changes}
    return EpochOrder(
        [component(cfg.pop("shard_rows"), cfg.pop("window_rows"))],
        **cfg,  # type: ignore[arg-type]
    )


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_every_sample_exactly_once_across_ranks_in_as_many_batches_each(cfg: dict) -> None:
    seen: Counter = Counter()
    counts, shares = set(), []
    batch = cfg["batch_size"]
    for rank in range(cfg["world_size"]):
        order = order_of(cfg, rank=rank)
        seen.update(epoch_samples(order, range(order.batch_count)))
        sizes = [order.batch(n).size for n in range(order.batch_count)]
        counts.add(order.batch_count)
        shares.append(sum(sizes))
        # Full batches, then one partial; or, on a rank that splits its last batch so
        # that every rank steps as often (DDP), batch_size - 1 and then 1.
        split = sizes[-2:] == [batch - 1, 1] and batch > 1
        full = sizes[:-2] if split else sizes[:-1]
        assert all(s == batch for s in full), sizes
    assert set(seen) == everything(cfg["shard_rows"]) and set(seen.values()) <= {1}
    assert max(shares) - min(shares) <= 1
    if batch > 1 and min(shares) >= batch:  # a rank with nothing, or batches of one, cannot
        assert len(counts) == 1, (counts, shares)


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_drop_last_gives_equal_full_batches_and_no_repeats(cfg: dict) -> None:
    counts, seen = set(), Counter()
    for rank in range(cfg["world_size"]):
        order = order_of(cfg, rank=rank, drop_last=True)
        counts.add(order.batch_count)
        assert all(order.batch(n).size == cfg["batch_size"] for n in range(order.batch_count))
        seen.update(epoch_samples(order, range(order.batch_count)))
    assert len(counts) == 1 and set(seen.values()) <= {1}
    # nothing more is dropped than what cannot make a full batch on every rank
    total = sum(cfg["shard_rows"])
    assert total - len(seen) < cfg["world_size"] * cfg["batch_size"] * (cfg["lanes"] + 1)


@settings(max_examples=100, deadline=None)
@given(cfg=configs, workers=st.integers(1, 5), cut=st.floats(0, 1))
def test_workers_partition_the_canonical_sequence_and_resume_anywhere(
    cfg: dict, workers: int, cut: float
) -> None:
    order = order_of(cfg)
    owned = [order.batches_for(k, workers) for k in range(workers)]
    assert sorted(n for w in owned for n in w) == list(range(order.batch_count))
    interleaved = [
        w[i] for i in range(max(map(len, owned), default=0)) for w in owned if i < len(w)
    ]
    assert interleaved == list(range(order.batch_count))  # the DataLoader's round-robin
    start = int(cut * order.batch_count)
    resumed = [order.batches_for(k, workers, start) for k in range(workers)]
    yielded = [
        w[i] for i in range(max(map(len, resumed), default=0)) for w in resumed if i < len(w)
    ]
    assert yielded == list(range(start, order.batch_count))


@settings(max_examples=120, deadline=None)
@given(
    cfg=configs,
    cuts=st.lists(st.floats(0, 1), min_size=1, max_size=3),
    layouts=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 40), st.booleans()), min_size=3, max_size=3
    ),
)
def test_elastic_resume_yields_exactly_what_was_not_consumed(
    cfg: dict, cuts: list[float], layouts: list[tuple[int, int, bool]]
) -> None:
    # Train in lockstep at one world size and batch size, stop, resume at another:
    # chained, the segments yield every sample at most once, and all of them
    # when the last segment runs to the end without drop_last.
    remaining = None
    seen: Counter = Counter()
    segments = [*zip(cuts, layouts, strict=False), (1.0, (layouts[-1][0], layouts[-1][1], False))]
    for cut, (world, batch, drop) in segments:
        orders = [
            order_of(
                cfg,
                world_size=world,
                rank=r,
                batch_size=batch,
                drop_last=drop,
                remaining=remaining,
            )
            for r in range(world)
        ]
        steps = round(cut * max(o.batch_count for o in orders))
        for order in orders:  # every rank steps in lockstep; rank 0's count is enough
            seen.update(epoch_samples(order, range(min(steps, order.batch_count))))
        remaining = orders[0].remaining_after(steps)
    assert set(seen.values()) <= {1}
    assert set(seen) == everything(cfg["shard_rows"])


@settings(max_examples=60, deadline=None)
@given(cfg=configs, world=st.integers(1, 4), batch=st.integers(1, 40))
def test_the_global_order_does_not_depend_on_world_or_batch_size(
    cfg: dict, world: int, batch: int
) -> None:
    # Concatenated over ranks and batches, ranks read each lane front to back.
    a, b = order_of(cfg), order_of(cfg, world_size=world, batch_size=batch)
    for lane_a, lane_b in zip(a.order.lanes, b.order.lanes, strict=True):
        assert np.array_equal(
            lane_a.positions(0, lane_a.length), lane_b.positions(0, lane_b.length)
        )


def test_order_is_deterministic_and_changes_with_epoch() -> None:
    args = dict(seed=17, batch_size=8)
    comp = component([100] * 10, 16)
    a = epoch_samples(EpochOrder([comp], **args, epoch=0), range(20))
    b = epoch_samples(EpochOrder([comp], **args, epoch=0), range(20))
    c = epoch_samples(EpochOrder([comp], **args, epoch=1), range(20))
    assert a == b and a != c


def test_batches_mix_many_windows_of_data_stored_in_label_order() -> None:
    # 10 labels, stored sorted, 64 shards: each batch of 32 draws from many windows
    # spread over the stored order, nearly as many labels as a full permutation.
    rows = 160_000
    comp = component([rows // 64] * 64, 500)
    order = EpochOrder([comp], seed=3, epoch=0, batch_size=32, lanes=4, shuffle_windows=16)
    label = lambda s, r: (s * (rows // 64) + r) * 10 // rows  # noqa: E731
    distinct = [
        len({label(s, r) for _, s, r in order.sample_ids(order.batch(n))})
        for n in range(0, order.batch_count, 17)
    ]
    random_permutation = 10 * (1 - 0.9**32)
    assert np.mean(distinct) >= 0.9 * random_permutation
    one_window = EpochOrder([comp], seed=3, epoch=0, batch_size=32, lanes=4, shuffle_windows=1)
    assert len({label(s, r) for _, s, r in one_window.sample_ids(one_window.batch(5))}) <= 2


def test_lanes_keep_workers_on_their_own_windows() -> None:
    comp = component([1000] * 8, 50)
    order = EpochOrder([comp], seed=1, epoch=0, batch_size=10, lanes=8, shuffle_windows=4)
    for workers in (1, 2, 4, 8):
        for k in range(workers):
            numbers = order.batches_for(k, workers)[: order.batch_count // 2]
            lanes = {span.lane for n in numbers for span in order.batch(n).spans}
            assert lanes <= {lane for lane in range(8) if lane % workers == k}


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200), min_size=1, max_size=4),
    weights=st.lists(st.floats(0.01, 10), min_size=4, max_size=4),
    per_epoch=st.integers(1, 600),
    epochs=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_mixtures_give_each_component_its_share_and_continue_across_epochs(
    sizes: list[int], weights: list[float], per_epoch: int, epochs: int, seed: int
) -> None:
    weights = weights[: len(sizes)]
    shares = allocate(weights, per_epoch)
    assert sum(shares) == per_epoch
    for share, w in zip(shares, weights, strict=True):
        assert abs(share - w / sum(weights) * per_epoch) < 1 + 1e-9
    comps = [
        Component(f"c{i}@1", (Extent(0, 0, n),), 7, share)
        for i, (n, share) in enumerate(zip(sizes, shares, strict=True))
    ]
    drawn: list[list[int]] = [[] for _ in comps]
    for epoch in range(epochs):
        order = EpochOrder(comps, seed=seed, epoch=epoch, batch_size=5, lanes=2, shuffle_windows=3)
        got = epoch_samples(order, range(order.batch_count))
        assert len(got) == per_epoch
        counts = Counter(c for c, _, _ in got)
        assert all(counts[i] == share for i, share in enumerate(shares))
        for c, _, row in got:
            drawn[c].append(row)
        for rows, size in zip(drawn, sizes, strict=True):
            # A component's passes continue across epochs: after any number of
            # epochs, every row was drawn q or q + 1 times (q full passes so far),
            # so no row repeats before all rows of the component were drawn.
            full = len(rows) // size
            assert set(Counter(rows).values()) <= {full, full + 1}
            assert len(set(rows)) == min(len(rows), size)


@given(
    shard_rows=st.lists(st.integers(0, 50), min_size=1, max_size=6),
    cut=st.floats(0, 1),
)
def test_splits_never_overlap_and_cover_every_row(shard_rows: list[int], cut: float) -> None:
    def rows_of(split: tuple) -> list[tuple[int, int]]:
        return [
            (e.shard, e.row_start + i)
            for e in split_extents(shard_rows, split)
            for i in range(e.rows)
        ]

    train, val = rows_of((0.0, cut)), rows_of((cut, 1.0))
    assert not set(train) & set(val)
    assert sorted(train + val) == [(s, r) for s, n in enumerate(shard_rows) for r in range(n)]
    assert rows_of((0.0, cut)) == train  # stable


def test_remaining_round_trips_through_json() -> None:
    remaining = Remaining((((0, 5), (9, 12)), ()))
    assert Remaining.from_json(remaining.to_json(), [12, 0]) == remaining


@settings(max_examples=100, deadline=None)
@given(
    shard_rows=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    window_rows=st.integers(1, 64),
    cut=st.floats(0, 1),
    seed=st.integers(0, 2**32),
)
def test_windows_lie_on_each_shards_chunk_grid(
    shard_rows: list[int], window_rows: int, cut: float, seed: int
) -> None:
    """A window never crosses a multiple of window_rows counted from its shard's first row.

    That grid is where the encoder cuts fixed-width rows into chunks
    (cache/row_grid.py), so each window is one chunk, even for a split that
    starts inside a shard; the windows still cover the split's rows once.
    """
    extents = split_extents(shard_rows, (cut, 1.0))
    if not extents:
        return
    total = sum(e.rows for e in extents)
    order = EpochOrder([Component("d@1", extents, window_rows, total)], seed=seed, epoch=0)
    w = order.order.windows
    starts, rows = w.row_start, w.rows
    assert (rows > 0).all()
    assert (starts // window_rows == (starts + rows - 1) // window_rows).all()
    windows = zip(w.shard.tolist(), starts.tolist(), rows.tolist(), strict=True)
    covered = sorted((s, r0 + i) for s, r0, n in windows for i in range(n))
    assert covered == sorted((e.shard, e.row_start + i) for e in extents for i in range(e.rows))


@settings(max_examples=150, deadline=None)
@given(cfg=configs, interleave=st.booleans())
def test_a_units_span_runs_from_its_first_sample_to_its_last(cfg: dict, interleave: bool) -> None:
    # The pipeline drops a window once its lane is read past the span's end: a span
    # ending early would drop a window still needed, one ending late holds it longer.
    # (Blocks permuted at random, as states before format 5 read them, give the
    # blocks holding the unit: its rows may lie anywhere in them.)
    order = order_of(cfg, interleave=interleave).order
    for lane in order.lanes:
        units = order.units.of(lane.positions(0, lane.length))
        for unit in np.unique(units):
            where = np.flatnonzero(units == unit)
            _, first, end = order.unit_span(int(unit))
            if interleave or not cfg["shuffle"]:
                assert (first, end) == (where[0], where[-1] + 1)
            else:
                assert first <= where[0] and where[-1] < end
                assert lane.block_of(first) == lane.block_of(int(where[0]))
                assert lane.block_of(end - 1) == lane.block_of(int(where[-1]))


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_every_stretch_of_a_block_draws_from_its_streams_in_proportion(cfg: dict) -> None:
    # Interleaved blocks: a batch of any size, cut anywhere, holds each stream's rows
    # at its share of the block (a random permutation of the block held them at
    # random), so a stream moves to its next window at one place in the block.
    order = order_of(cfg, shuffle=True).order
    stream_of = order.unit_stream
    for lane in order.lanes:
        for b in range(lane.blocks):
            positions = lane.block(b)
            streams = stream_of[order.units.of(positions)]
            ids, counts = np.unique(streams, return_counts=True)
            for stream, count in zip(ids, counts, strict=True):
                seen = np.cumsum(streams == stream)
                expected = np.arange(1, len(positions) + 1) * count / len(positions)
                assert np.all(np.abs(seen - expected) <= 2), (b, stream)


@settings(max_examples=150, deadline=None)
@given(cfg=configs, drop_last=st.booleans())
def test_reached_is_where_the_batches_from_there_on_first_read_each_lane(
    cfg: dict, drop_last: bool
) -> None:
    # The pipeline drops a window whose samples all lie before this in every lane
    # holding some: a later batch reading one of them would read the window again.
    ranks = order_of(cfg, drop_last=drop_last).ranks
    spans = [ranks.batch(n) for n in range(ranks.batch_count)]
    for number in range(ranks.batch_count + 1):
        reached = ranks.reached(number)
        for lane in range(len(ranks.parts)):
            later = [s.lo for batch in spans[number:] for s in batch if s.lane == lane]
            if later:
                assert reached[lane] == min(later), (number, lane)
            else:  # only samples drop_last leaves out may be left (held, never read)
                assert reached[lane] == float("inf") or drop_last, (number, lane)


@settings(max_examples=60, deadline=None)
@given(
    shards=st.integers(4, 8),
    rows=st.integers(500, 1500),
    window_rows=st.integers(8, 64),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 3),
    lanes=st.integers(2, 5),
    shuffle_windows=st.integers(1, 16),
    batch_size=st.integers(8, 128),
)
def test_a_component_read_twice_an_epoch_never_repeats_a_row_in_a_batch(
    shards: int,
    rows: int,
    window_rows: int,
    seed: int,
    epoch: int,
    lanes: int,
    shuffle_windows: int,
    batch_size: int,
) -> None:
    """Two passes in one epoch are read one after the other, each over every stream.

    Cut one after the other and read side by side, stream ``s`` read the start of one
    pass while stream ``s + streams/2`` read the same windows of the next: every batch
    of 256 held dozens of rows twice. Now a row's copies lie in one stretch of the data,
    read by one stream or two neighbours, which are in different lanes (a batch is one
    lane's), and the copies come apart by most of the epoch.
    """
    comp = component([rows] * shards, window_rows, samples=2 * rows * shards)
    shape = {"seed": seed, "epoch": epoch, "batch_size": batch_size, "lanes": lanes}
    order = EpochOrder([comp], **shape, shuffle_windows=shuffle_windows)
    # A batch that is a good part of its lane holds stretches of both passes anyway.
    assume(batch_size * 16 <= min(order.lane_lengths))
    seen: Counter = Counter()
    where: dict[tuple[int, int], list[int]] = {}
    position = 0
    for n in range(order.batch_count):
        batch = [(s, r) for _, s, r in order.sample_ids(order.batch(n))]
        assert len(set(batch)) == len(batch), n
        seen.update(batch)
        for key in batch:
            where.setdefault(key, []).append(position)
            position += 1
    assert set(seen.values()) == {2}  # every row twice, as its weight asks
    gaps = np.array([b - a for a, b in where.values()])
    assert np.median(gaps) > position / 8, np.median(gaps)
    # A state saved before format 6 resumes in the order of before: the same batches.
    old = EpochOrder([comp], **shape, shuffle_windows=shuffle_windows, passes_in_turn=False)
    assert old.batch_count == order.batch_count
