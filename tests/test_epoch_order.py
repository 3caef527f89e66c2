"""Property tests of the epoch order: exact-once, determinism, resumption, equal DDP steps."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from edgecache.clients.epoch_order import EpochOrder


def samples_of(order: EpochOrder, numbers) -> list[tuple[int, int]]:  # noqa: ANN001
    out = []
    for n in numbers:
        for piece in order.batch(n).pieces:
            window = order.windows[piece.window]
            for offset in window.order()[piece.start : piece.stop]:
                out.append((window.shard, window.row_start + int(offset)))
    return out


configs = st.fixed_dictionaries(
    {
        "shard_rows": st.lists(st.integers(0, 300), min_size=1, max_size=8),
        "window_rows": st.integers(1, 64),
        "seed": st.integers(0, 2**32),
        "epoch": st.integers(0, 5),
        "world_size": st.integers(1, 4),
        "batch_size": st.integers(1, 40),
        "lanes": st.integers(1, 9),
    }
)


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_every_sample_exactly_once_across_ranks(cfg: dict) -> None:
    seen: Counter = Counter()
    for rank in range(cfg["world_size"]):
        order = EpochOrder(**cfg, rank=rank)
        got = samples_of(order, range(order.batch_count))
        partial = [n for n in range(order.batch_count) if order.batch(n).size < cfg["batch_size"]]
        assert len(partial) <= cfg["lanes"]  # at most the end of each lane
        seen.update(got)
    expected = {(s, r) for s, rows in enumerate(cfg["shard_rows"]) for r in range(rows)}
    assert set(seen) == expected and all(c == 1 for c in seen.values())


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_drop_last_gives_equal_full_batches_and_no_repeats(cfg: dict) -> None:
    counts, seen = set(), Counter()
    for rank in range(cfg["world_size"]):
        order = EpochOrder(**cfg, rank=rank, drop_last=True)
        counts.add(order.batch_count)
        assert all(order.batch(n).size == cfg["batch_size"] for n in range(order.batch_count))
        seen.update(samples_of(order, range(order.batch_count)))
    assert len(counts) == 1
    assert all(c == 1 for c in seen.values())


@settings(max_examples=100, deadline=None)
@given(cfg=configs, workers=st.integers(1, 5), cut=st.floats(0, 1))
def test_workers_partition_the_canonical_sequence_and_resume_anywhere(
    cfg: dict, workers: int, cut: float
) -> None:
    order = EpochOrder(**cfg)
    owned = [order.batches_for(k, workers) for k in range(workers)]
    assert sorted(n for w in owned for n in w) == list(range(order.batch_count))
    # the DataLoader's round-robin over workers yields canonical order
    interleaved = [
        w[i] for i in range(max(map(len, owned), default=0)) for w in owned if i < len(w)
    ]
    assert interleaved == list(range(order.batch_count))
    start = int(cut * order.batch_count)
    resumed = [order.batches_for(k, workers, start) for k in range(workers)]
    yielded = [
        w[i] for i in range(max(map(len, resumed), default=0)) for w in resumed if i < len(w)
    ]
    assert yielded == list(range(start, order.batch_count))


def test_order_is_deterministic_and_changes_with_epoch() -> None:
    args = dict(shard_rows=[100] * 10, window_rows=16, seed=17, batch_size=8)
    a = samples_of(EpochOrder(**args, epoch=0), range(20))
    b = samples_of(EpochOrder(**args, epoch=0), range(20))
    c = samples_of(EpochOrder(**args, epoch=1), range(20))
    assert a == b and a != c


def test_lanes_keep_workers_on_their_own_windows() -> None:
    order = EpochOrder([1000] * 8, window_rows=50, seed=1, epoch=0, batch_size=10, lanes=8)
    for workers in (1, 2, 4, 8):
        for k in range(workers):
            numbers = order.batches_for(k, workers)[
                : order.batch_count // 2
            ]  # before lanes run dry
            lanes = {order.batch(n).pieces[0].window % 8 for n in numbers}
            assert lanes <= {lane for lane in range(8) if lane % workers == k}
