"""The origin side: generated Parquet shards in moto's S3, published as dataset versions.

Runs on the origin side of the link (inside the origin namespace), so the
upload and the publish talk to moto locally and never cross the link: only
what the edge node fetches does.

    python -m bench.wan.origin prepare --endpoint URL --bucket B --source DIR \
        --datasets tokens,tokens-next
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import datasets
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["CREDENTIALS", "publish", "s3_client", "s3_env", "upload", "write_tokens"]

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
PREFIX = "tokens"


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment pointing botocore (here and in node subprocesses) at ``endpoint``."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def _zipf_table(vocab: int = 50_000, exponent: float = 1.2, bits: int = 22) -> np.ndarray:
    """Inverse CDF of ``zipf(exponent) % vocab`` at 2**bits quantiles (int32 ids)."""
    ranks = np.arange(1, vocab * 100 + 1, dtype=np.float64)
    weights = np.bincount((ranks % vocab).astype(np.int64), ranks**-exponent, minlength=vocab)
    # Past the last rank the tail spreads evenly over the residues (integral of k**-s).
    weights += (len(ranks) + 0.5) ** (1 - exponent) / (exponent - 1) / vocab
    cdf = np.cumsum(weights / weights.sum())
    quantiles = (np.arange(1 << bits, dtype=np.float64) + 0.5) / (1 << bits)
    return np.minimum(np.searchsorted(cdf, quantiles), vocab - 1).astype(np.int32)


def token_batches(total_bytes: int, seed: int, table: np.ndarray) -> list[pa.RecordBatch]:
    """Samples shaped like :func:`bench.datasets.tokens` (2048 ids, Zipf 1.2 over 50k, a label).

    Same distribution, drawn through an inverse-CDF table: numpy's ``zipf``
    takes a minute per GiB here, which a five-minute benchmark cannot spend.
    """
    rng = np.random.default_rng(seed)
    tokens = datasets.TOKENS_PER_SAMPLE
    rows = max(total_bytes // (tokens * 4), 1)
    out = []
    for start in range(0, rows, 1024):
        n = min(1024, rows - start)
        ids = table[rng.integers(0, len(table), size=n * tokens)]
        out.append(
            pa.record_batch(
                {
                    "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), tokens),
                    "label": pa.array(np.arange(start, start + n, dtype=np.int64)),
                }
            )
        )
    return out


def write_tokens(root: Path, raw_mib: int, shard_mib: int, seed: int = 0) -> dict[str, int]:
    """Token Parquet shards (zstd) of about ``shard_mib`` raw each; their sizes.

    Shard ``i`` is drawn from ``seed * 1000 + i``: distinct seeds make distinct
    versions of the same shape (the scenario benchmark's six).
    """
    root.mkdir(parents=True, exist_ok=True)
    count = max(raw_mib // shard_mib, 1)
    shard_bytes = (raw_mib << 20) // count
    table = _zipf_table()
    rows = raw = 0
    for i in range(count):
        shard = pa.Table.from_batches(token_batches(shard_bytes, seed * 1000 + i, table))
        rows += shard.num_rows
        raw += sum(column.nbytes for column in shard.columns)
        pq.write_table(shard, root / f"part-{i:05d}.parquet", compression="zstd")
    parquet = sum(p.stat().st_size for p in root.iterdir())
    return {"shards": count, "rows": rows, "raw_bytes": raw, "parquet_bytes": parquet}


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client for moto at ``endpoint`` with the benchmark's credentials."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    )


def upload(endpoint: str, bucket: str, source: Path) -> None:
    """Create ``bucket`` and put every file of ``source`` under ``tokens/`` (single PUTs)."""
    client = s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    for path in sorted(source.iterdir()):
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/{path.name}", Body=path.read_bytes())


def publish(registry: str, source: str, dataset: str) -> pb.Manifest:
    """Publish ``source`` as the next version of ``dataset`` (zstd chunks)."""
    spec = preprocess_spec(compression=pb.COMPRESSION_ZSTD)
    return Registry.run(registry, lambda reg: reg.publish(source, dataset, spec=spec))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("prepare",))
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--datasets", required=True, help="comma-separated dataset names")
    args = parser.parse_args()
    os.environ.update(s3_env(args.endpoint))
    upload(args.endpoint, args.bucket, args.source)
    registry = f"s3://{args.bucket}/_edgecache"
    out = {}
    for name in args.datasets.split(","):
        manifest = publish(registry, f"s3://{args.bucket}/{PREFIX}/", name)
        out[name] = {"version": manifest.version, "shards": len(manifest.shards)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
