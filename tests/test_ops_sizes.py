"""Version sizes for the planner: stored bytes where a cache holds a copy, estimates otherwise."""

from __future__ import annotations

from edgecache.cache.planner import VersionSize
from edgecache.clients.ops import Holding, version_sizes
from edgecache.v1 import manifest_pb2 as pb


def manifest(dataset: str, version: int, source: list[int]) -> pb.Manifest:
    m = pb.Manifest(dataset=dataset, version=version)
    for size in source:
        m.shards.add(source_size=size)
    return m


def test_stored_where_held_estimated_from_the_dataset_elsewhere() -> None:
    manifests = {
        "tokens@1": manifest("tokens", 1, [100, 100]),
        "tokens@2": manifest("tokens", 2, [150, 150]),
        "text@1": manifest("text", 1, [1000]),
        "text@2": manifest("text", 2, [2000]),
        "new@1": manifest("new", 1, [400]),
    }
    held = {
        "eu": {
            ("tokens", 1): Holding(shards=2, stored_bytes=234, complete=True),  # Parquet grows
            ("text", 1): Holding(shards=1, stored_bytes=400, complete=True),  # text shrinks
            ("text", 2): Holding(shards=1, stored_bytes=10, complete=False),  # partial: no size
        }
    }
    sizes = version_sizes(manifests, held)
    assert sizes[("tokens", 1)] == VersionSize(stored=234, source=200)
    assert sizes[("tokens", 2)] == VersionSize(stored=351, source=300)  # 1.17 x source
    assert sizes[("text", 2)] == VersionSize(stored=800, source=2000)  # 0.4 x source
    overall = (1.17 + 0.4) / 2  # a dataset never held: the mean ratio of all held
    assert sizes[("new", 1)] == VersionSize(stored=int(400 * overall), source=400)


def test_nothing_held_means_source_bytes() -> None:
    sizes = version_sizes({"a@1": manifest("a", 1, [10, 20])}, {})
    assert sizes[("a", 1)] == VersionSize(stored=30, source=30)


def test_held_versions_no_job_reads_still_give_the_ratio() -> None:
    """The schedule reads tokens@2 only; tokens@1, held, says how much it grows once stored."""
    manifests = {"tokens@2": manifest("tokens", 2, [150, 150])}
    others = {"tokens@1": manifest("tokens", 1, [100, 100])}
    held = {"eu": {("tokens", 1): Holding(shards=2, stored_bytes=80, complete=True)}}
    sizes = version_sizes(manifests, held, others=others)
    assert sizes == {("tokens", 2): VersionSize(stored=120, source=300)}  # 0.4 x source
