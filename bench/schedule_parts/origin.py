"""The origin side: one Parquet prefix per dataset version in moto's S3, published.

Runs on the origin side of the link (inside the origin namespace), so writing,
uploading and publishing talk to moto locally and never cross the link. The
registry (manifests, and later the controller's lease and record) is a
directory on local disk that both sides see: only data crosses the link.

    python -m bench.schedule_parts.origin --endpoint URL --bucket B --registry file:///… \
        --source DIR --versions web@1,web@2,code@1 --version-mib 48 --shard-mib 8

Prints one JSON object: per version its shards, rows and bytes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.wan.origin import publish, s3_client, s3_env, write_tokens
from edgecache.cache.names import parse_spec

__all__ = ["prepare"]


def prepare(
    endpoint: str,
    bucket: str,
    registry: str,
    source: Path,
    versions: list[str],
    raw_mib: int,
    shard_mib: int,
) -> dict[str, dict[str, object]]:
    """Write, upload and publish every version, in order (``name@1`` before ``name@2``)."""
    os.environ.update(s3_env(endpoint))
    client = s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    out: dict[str, dict[str, object]] = {}
    for seed, spec in enumerate(versions, start=1):
        parsed = parse_spec(spec)
        prefix = f"{parsed.dataset}/v{parsed.version}"
        sizes = write_tokens(source / prefix, raw_mib, shard_mib, seed)
        for path in sorted((source / prefix).iterdir()):
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
        manifest = publish(registry, f"s3://{bucket}/{prefix}/", parsed.dataset)
        if manifest.version != parsed.version:
            raise RuntimeError(f"{spec} was published as {parsed.dataset}@{manifest.version}")
        out[spec] = {
            **sizes,
            "source_bytes": sum(s.source_size for s in manifest.shards),
            "digest": manifest.digest,
            "source_url": manifest.source_url,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--registry", required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--versions", required=True, help="comma-separated name@N, in order")
    parser.add_argument("--version-mib", type=int, required=True, help="raw MiB per version")
    parser.add_argument("--shard-mib", type=int, required=True, help="raw MiB per shard")
    args = parser.parse_args()
    published = prepare(
        args.endpoint,
        args.bucket,
        args.registry,
        args.source,
        args.versions.split(","),
        args.version_mib,
        args.shard_mib,
    )
    print(json.dumps(published))


if __name__ == "__main__":
    main()
