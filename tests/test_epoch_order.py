"""Property tests of the epoch plan: exact-once, determinism, resumption, equal DDP steps."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from edgecache.clients.plan import EpochPlan


def samples_of(plan: EpochPlan, numbers) -> list[tuple[int, int]]:  # noqa: ANN001
    out = []
    for n in numbers:
        for piece in plan.batch(n).pieces:
            window = plan.windows[piece.window]
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
        plan = EpochPlan(**cfg, rank=rank)
        got = samples_of(plan, range(plan.batch_count))
        partial = [n for n in range(plan.batch_count) if plan.batch(n).size < cfg["batch_size"]]
        assert len(partial) <= cfg["lanes"]  # at most the end of each lane
        seen.update(got)
    expected = {(s, r) for s, rows in enumerate(cfg["shard_rows"]) for r in range(rows)}
    assert set(seen) == expected and all(c == 1 for c in seen.values())


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_drop_last_gives_equal_full_batches_and_no_repeats(cfg: dict) -> None:
    counts, seen = set(), Counter()
    for rank in range(cfg["world_size"]):
        plan = EpochPlan(**cfg, rank=rank, drop_last=True)
        counts.add(plan.batch_count)
        assert all(plan.batch(n).size == cfg["batch_size"] for n in range(plan.batch_count))
        seen.update(samples_of(plan, range(plan.batch_count)))
    assert len(counts) == 1
    assert all(c == 1 for c in seen.values())


@settings(max_examples=100, deadline=None)
@given(cfg=configs, workers=st.integers(1, 5), cut=st.floats(0, 1))
def test_workers_partition_the_canonical_sequence_and_resume_anywhere(
    cfg: dict, workers: int, cut: float
) -> None:
    plan = EpochPlan(**cfg)
    owned = [plan.batches_for(k, workers) for k in range(workers)]
    assert sorted(n for w in owned for n in w) == list(range(plan.batch_count))
    # the DataLoader's round-robin over workers yields canonical order
    interleaved = [
        w[i] for i in range(max(map(len, owned), default=0)) for w in owned if i < len(w)
    ]
    assert interleaved == list(range(plan.batch_count))
    start = int(cut * plan.batch_count)
    resumed = [plan.batches_for(k, workers, start) for k in range(workers)]
    order = [w[i] for i in range(max(map(len, resumed), default=0)) for w in resumed if i < len(w)]
    assert order == list(range(start, plan.batch_count))


def test_order_is_deterministic_and_changes_with_epoch() -> None:
    args = dict(shard_rows=[100] * 10, window_rows=16, seed=17, batch_size=8)
    a = samples_of(EpochPlan(**args, epoch=0), range(20))
    b = samples_of(EpochPlan(**args, epoch=0), range(20))
    c = samples_of(EpochPlan(**args, epoch=1), range(20))
    assert a == b and a != c


def test_lanes_keep_workers_on_their_own_windows() -> None:
    plan = EpochPlan([1000] * 8, window_rows=50, seed=1, epoch=0, batch_size=10, lanes=8)
    for workers in (1, 2, 4, 8):
        for k in range(workers):
            numbers = plan.batches_for(k, workers)[: plan.batch_count // 2]  # before lanes run dry
            lanes = {plan.batch(n).pieces[0].window % 8 for n in numbers}
            assert lanes <= {lane for lane in range(8) if lane % workers == k}
