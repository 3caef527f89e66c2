"""Helpers for edge node tests: raw shards in origin, a published version, a client stub."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from edgecache.cache.codec import decode_chunk
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.edge.server import CHANNEL_OPTIONS
from edgecache.v1 import edge_pb2, edge_pb2_grpc
from edgecache.v1 import manifest_pb2 as pb

ROWS_PER_SHARD = 3000


def shard_table(index: int, rows: int = ROWS_PER_SHARD) -> pa.Table:
    rng = np.random.default_rng(index)
    ids = rng.integers(0, 50_000, size=rows * 32, dtype=np.int32)
    return pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), 32),
            "label": pa.array(np.arange(index * rows, (index + 1) * rows, dtype=np.int64)),
        }
    )


def write_parquet_shards(root: Path, count: int, rows: int = ROWS_PER_SHARD) -> list[pa.Table]:
    root.mkdir(parents=True, exist_ok=True)
    tables = [shard_table(i, rows) for i in range(count)]
    for i, table in enumerate(tables):
        pq.write_table(table, root / f"part-{i:05d}.parquet", row_group_size=1000)
    return tables


def publish(registry_url: str, source_url: str, dataset: str, **spec: object) -> pb.Manifest:
    preprocess = preprocess_spec(**{"chunk_bytes": 64 << 10, **spec})  # type: ignore[arg-type]
    return Registry.run(registry_url, lambda reg: reg.publish(source_url, dataset, spec=preprocess))


def stub(address: str) -> edge_pb2_grpc.EdgeCacheStub:
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return edge_pb2_grpc.EdgeCacheStub(channel)


def read_shard_table(
    client: edge_pb2_grpc.EdgeCacheStub, dataset: str, version: int, shard: int, start: int = 0
) -> pa.Table:
    batches = []
    for chunk in client.ReadShard(
        edge_pb2.ReadShardRequest(dataset=dataset, version=version, shard=shard, start_chunk=start)
    ):
        batches.append(decode_chunk(chunk.frame))
    return pa.Table.from_batches(batches)
