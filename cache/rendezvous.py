"""Rendezvous (highest-random-weight) hashing: which replica of a region owns a shard.

Replicas of a region split a version's shards between them, so a region's
capacity grows with its replicas. Every shard has one owner, the node with
the highest hash of (node, dataset, version, shard); adding or removing a node
moves only the shards it gains or loses. ``edgecache warm`` stages each shard
on its owner only, and EdgeDataset asks the owner first among equally near
nodes. Nodes are named as in the topology file, so both sides agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

__all__ = ["owner", "owned_shards", "rank"]


def _score(node: str, dataset: str, version: int, shard: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{node}|{dataset}@{version}/{shard}".encode())


def rank(nodes: Sequence[str], dataset: str, version: int, shard: int) -> list[str]:
    """``nodes`` from most to least preferred for one shard."""
    return sorted(nodes, key=lambda n: (-_score(n, dataset, version, shard), n))


def owner(nodes: Sequence[str], dataset: str, version: int, shard: int) -> str:
    """The node that holds the shard."""
    if not nodes:
        raise ValueError("no nodes to choose an owner from")
    return rank(nodes, dataset, version, shard)[0]


def owned_shards(
    nodes: Sequence[str], node: str, dataset: str, version: int, shards: int
) -> list[int]:
    """The shards of a version that ``node`` owns among ``nodes``."""
    return [s for s in range(shards) if owner(nodes, dataset, version, s) == node]
