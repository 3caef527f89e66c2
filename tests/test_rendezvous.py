from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from edgecache.cache.rendezvous import owned_shards, owner, rank

nodes_st = st.lists(
    st.text("abcdefgh:0123456789.", min_size=1, max_size=12), min_size=1, max_size=6, unique=True
)


@given(nodes=nodes_st, shards=st.integers(1, 200))
def test_every_shard_has_exactly_one_owner(nodes: list[str], shards: int) -> None:
    owned = [s for n in nodes for s in owned_shards(nodes, n, "ds", 3, shards)]
    assert sorted(owned) == list(range(shards))


@given(nodes=nodes_st, extra=st.text("xyz", min_size=1, max_size=5), shards=st.integers(1, 200))
def test_adding_a_node_only_moves_shards_to_it(nodes: list[str], extra: str, shards: int) -> None:
    if extra in nodes:
        return
    for s in range(shards):
        before, after = owner(nodes, "ds", 1, s), owner([*nodes, extra], "ds", 1, s)
        assert after in (before, extra)


def test_balanced_and_order_independent() -> None:
    nodes = [f"eu-{i}:7070" for i in range(4)]
    counts = Counter(owner(nodes, "tokens", 1, s) for s in range(4000))
    assert min(counts.values()) > 800
    assert rank(nodes, "t", 1, 5) == rank(list(reversed(nodes)), "t", 1, 5)
