"""Rendezvous (highest-random-weight) hashing: which replica of a region owns a shard.

Replicas of a region split a version's shards between them, so a region's
capacity grows with its replicas. Every shard has one owner, the node with
the highest hash of (node, dataset, version, shard); adding or removing a node
moves only the shards it gains or loses. ``edgecache warm`` stages each shard
on its owner only, and EdgeDataset asks the owner first among equally near
nodes.

A node is hashed by its name: the id it reports (``Status.node_id``, the
``node_id`` setting), given in ``names`` (address → id), so that every side
agrees however it dials the node. Hashed by the address as dialled, a reader
on the host (``localhost:7072``) and the warm inside a compose network
(``eu-west-2:7070``) split the shards differently, and the reader's misses
went to origin and were cached twice. An address ``names`` lacks (a node
that did not answer) stands for itself.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import xxhash

__all__ = [
    "owner",
    "owned_shards",
    "rank",
    "region_names",
    "shared_id_text",
    "shared_ids",
    "unique_names",
]

log = logging.getLogger(__name__)


def _score(node: str, dataset: str, version: int, shard: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{node}|{dataset}@{version}/{shard}".encode())


def rank(
    nodes: Sequence[str],
    dataset: str,
    version: int,
    shard: int,
    *,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """``nodes`` from most to least preferred for one shard (hashed by their ``names``)."""
    named = names or {}

    def key(node: str) -> tuple[int, str, str]:
        name = named.get(node, node)
        return -_score(name, dataset, version, shard), name, node

    return sorted(nodes, key=key)


def owner(
    nodes: Sequence[str],
    dataset: str,
    version: int,
    shard: int,
    *,
    names: Mapping[str, str] | None = None,
) -> str:
    """The node that holds the shard."""
    if not nodes:
        raise ValueError("no nodes to choose an owner from")
    return rank(nodes, dataset, version, shard, names=names)[0]


def owned_shards(
    nodes: Sequence[str],
    node: str,
    dataset: str,
    version: int,
    shards: int,
    *,
    names: Mapping[str, str] | None = None,
) -> list[int]:
    """The shards of a version that ``node`` owns among ``nodes``."""
    return [s for s in range(shards) if owner(nodes, dataset, version, s, names=names) == node]


def unique_names(ids: Mapping[str, str]) -> dict[str, str]:
    """``ids`` (address → the id its node reports, one region's) less ids several report.

    Two nodes reporting one id would claim the same shards and leave others to
    no one: those split by address instead, and the clash is logged, once per
    process (one warm works out the split several times: it was said thrice).
    """
    shared = shared_ids(ids)
    now = time.monotonic()
    for node_id, addresses in shared.items():
        said = _said.get((node_id, tuple(addresses)))
        if said is None or now - said > SAY_AGAIN_SECONDS:
            if len(_said) > 256:  # a long-running process: forget the old ones
                _said.clear()
            _said[(node_id, tuple(addresses))] = now
            log.warning("%s", shared_id_text(addresses, node_id))
    return {a: n for a, n in ids.items() if n not in shared}


# Each clash logged, and when: said again after SAY_AGAIN_SECONDS (a controller or a reader
# runs for days: a clash mended and back is news).
_said: dict[tuple[str, tuple[str, ...]], float] = {}
SAY_AGAIN_SECONDS = 600.0


def shared_ids(ids: Mapping[str, str]) -> dict[str, list[str]]:
    """Each id that several of ``ids``' nodes (one region's) report → their addresses, sorted."""
    nodes: dict[str, list[str]] = defaultdict(list)
    for address, node_id in ids.items():
        nodes[node_id].append(address)
    return {n: sorted(a) for n, a in nodes.items() if len(a) > 1}


def shared_id_text(addresses: Iterable[str], node_id: str) -> str:
    """What is wrong when several nodes report one id, and what to do."""
    return (
        f"nodes {', '.join(sorted(addresses))} all report node id {node_id!r}: give each a "
        "node_id of its own (--node-id, EDGECACHE_NODE_ID); until then they split shards by "
        "the address each is dialled at, which readers dialling other addresses do not share"
    )


def region_names(reported: Iterable[tuple[str, str, str]]) -> dict[str, str]:
    """Address → the id it splits shards by, from (region, address, id) as nodes report them.

    Each region's ids are made unique apart (:func:`unique_names`): staging
    (from a status round) and readers (from each node's Status) both take them
    so, and agree. An empty id (an old node) is left out: its address stands.
    """
    by_region: dict[str, dict[str, str]] = defaultdict(dict)
    for region, address, node_id in reported:
        if node_id:
            by_region[region][address] = node_id
    return {a: n for ids in by_region.values() for a, n in unique_names(ids).items()}
