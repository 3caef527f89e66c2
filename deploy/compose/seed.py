"""Write a small generated token dataset to the compose stack's MinIO (s3://edgecache/raw/)."""

import asyncio
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from edgecache.cache.storage import Stores

PREFIX = "s3://edgecache/raw/sample-tokens"


async def main() -> None:
    """Write eight shards of 4,096 samples."""
    stores = Stores()
    s3 = stores.for_url(PREFIX)
    try:
        for i in range(8):
            rng = np.random.default_rng(i)
            ids = (rng.zipf(1.2, 2048 * 4096) % 50_000).astype(np.int32)
            table = pa.table(
                {
                    "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), 2048),
                    "label": pa.array(np.arange(4096 * i, 4096 * (i + 1), dtype=np.int64)),
                }
            )
            buffer = io.BytesIO()
            pq.write_table(table, buffer, compression="zstd")
            await s3.put(f"{PREFIX}/part-{i:05d}.parquet", buffer.getvalue())
    finally:
        await stores.close()


if __name__ == "__main__":
    asyncio.run(main())
