"""Generated Arrow data for tests (importable as ``datagen``; tests/ is on pythonpath)."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pyarrow as pa

TOKEN_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32(), 64)), ("label", pa.int64())])


def token_batch(rows: int, *, seed: int = 0, start: int = 0) -> pa.RecordBatch:
    """Fixed-size token sequences with Zipf-like ids and a running label."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.2, size=rows * 64) % 50_000).astype(np.int32)
    return pa.record_batch(
        [
            pa.FixedSizeListArray.from_arrays(pa.array(ids), 64),
            pa.array(np.arange(start, start + rows, dtype=np.int64)),
        ],
        schema=TOKEN_SCHEMA,
    )


def tar_archive(members: list[tuple[str, bytes]]) -> bytes:
    """A tar file (WebDataset's shard format) of ``(name, bytes)`` members, in order."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return sink.getvalue()
