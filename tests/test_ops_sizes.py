"""Version sizes for the planner: stored bytes where a cache holds a copy, estimates otherwise."""

from __future__ import annotations

import pyarrow as pa

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


def with_schema(m: pb.Manifest, schema: pa.Schema, rows: int, compression: int) -> pb.Manifest:
    m.arrow_schema = schema.serialize().to_pybytes()
    m.preprocess.compression = compression  # type: ignore[assignment]
    for shard in m.shards:
        shard.row_count = rows
    return m


TOKENS = pa.schema([("ids", pa.list_(pa.int32(), 2048)), ("label", pa.int64())])


def test_an_uncompressed_version_is_sized_by_its_rows_not_by_a_compressed_ones_ratio() -> None:
    # A helper's walk: big@1, published --compression none (8 MiB stored from 3.6 MiB of
    # Parquet), was planned at 2.4 MiB from another version's byte-split ratio, called
    # feasible, and its staging failed on the full cache.
    rows = 128
    manifests = {
        "dt@1": with_schema(manifest("dt", 1, [1000, 1000]), TOKENS, rows, pb.COMPRESSION_ZSTD),
        "big@1": with_schema(manifest("big", 1, [1000, 1000]), TOKENS, rows, pb.COMPRESSION_NONE),
    }
    held = {"eu": {("dt", 1): Holding(shards=2, stored_bytes=1300, complete=True)}}
    sizes = version_sizes(manifests, held)
    assert sizes[("big", 1)] == VersionSize(stored=2 * rows * (2048 * 4 + 8), source=2000)
    # The same dataset held with the same codec says more than a row width: its ratio.
    manifests["big@2"] = with_schema(manifest("big", 2, [500]), TOKENS, rows, pb.COMPRESSION_NONE)
    held["us"] = {("big", 2): Holding(shards=1, stored_bytes=1500, complete=True)}
    assert version_sizes(manifests, held)[("big", 1)] == VersionSize(stored=6000, source=2000)


def test_the_ratio_of_the_same_codec_comes_before_the_dataset_s_other_codec() -> None:
    manifests = {
        "a@1": manifest("a", 1, [100]),  # zstd (unspecified: before the choice)
        "b@1": manifest("b", 1, [100]),
        "a@2": manifest("a", 2, [100]),
    }
    manifests["b@1"].preprocess.compression = pb.COMPRESSION_NONE
    manifests["a@2"].preprocess.compression = pb.COMPRESSION_NONE
    held = {
        "eu": {
            ("a", 1): Holding(shards=1, stored_bytes=40, complete=True),
            ("b", 1): Holding(shards=1, stored_bytes=300, complete=True),
        }
    }
    # a@2 is uncompressed, without a fixed-width schema: b@1's ratio (none), not a@1's (zstd).
    assert version_sizes(manifests, held)[("a", 2)] == VersionSize(stored=300, source=100)
