"""Generated benchmark datasets, shaped like the two workloads edgecache serves."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

TOKENS_PER_SAMPLE = 2048
IMAGE_BYTES = 100 << 10


def tokens(total_bytes: int, *, seed: int = 0, batch_rows: int = 1024) -> list[pa.RecordBatch]:
    """LLM token samples: 2048 int32 ids (Zipf over a 50k vocabulary) and a label."""
    rng = np.random.default_rng(seed)
    rows = max(total_bytes // (TOKENS_PER_SAMPLE * 4), 1)
    out = []
    for start in range(0, rows, batch_rows):
        n = min(batch_rows, rows - start)
        ids = (rng.zipf(1.2, size=n * TOKENS_PER_SAMPLE) % 50_000).astype(np.int32)
        out.append(
            pa.record_batch(
                {
                    "input_ids": pa.FixedSizeListArray.from_arrays(
                        pa.array(ids), TOKENS_PER_SAMPLE
                    ),
                    "label": pa.array(np.arange(start, start + n, dtype=np.int64)),
                }
            )
        )
    return out


def images(total_bytes: int, *, seed: int = 0, batch_rows: int = 64) -> list[pa.RecordBatch]:
    """Image-like samples: ~100 KiB of half-noise, half-gradient bytes and an int label."""
    rng = np.random.default_rng(seed)
    rows = max(total_bytes // IMAGE_BYTES, 1)
    gradient = (np.arange(IMAGE_BYTES // 2) // 97 % 256).astype(np.uint8).tobytes()
    out = []
    for start in range(0, rows, batch_rows):
        n = min(batch_rows, rows - start)
        noise = rng.integers(0, 256, size=(n, IMAGE_BYTES // 2), dtype=np.uint8)
        blobs = [noise[i].tobytes() + gradient for i in range(n)]
        out.append(
            pa.record_batch(
                {
                    "image": pa.array(blobs, type=pa.binary()),
                    "label": pa.array(rng.integers(0, 1000, size=n, dtype=np.int64)),
                }
            )
        )
    return out
