"""A raw origin object → stored chunk frames, on the node's preprocessing cores, and its cost.

:class:`~edgecache.edge.node.EdgeNode` runs :func:`encode_raw_shard` on its
shard pool, one shard per thread, handing the shard's parts (chunk
compression, a batch's images, slices of text) to a second pool so that one
shard spreads over the cores too. Both pools' threads call
:func:`lower_priority` so staging yields the CPU to training reads. The CPU
time each shard took feeds :class:`StagingRate`, the source bytes/s the
planner counts on for this node. ``bench.staging`` measures this function
alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass

from edgecache.cache.codec import CodecOptions, ShardEncoder
from edgecache.cache.errors import MalformedShard, ManifestError
from edgecache.cache.manifest import manifest_schema
from edgecache.cache.preprocess import ShardContext, Transform, preprocess
from edgecache.cache.preprocess.context import MeteredPool
from edgecache.cache.row_grid import chunk_rows
from edgecache.v1 import manifest_pb2

__all__ = [
    "STAGING_NICE",
    "Encoded",
    "ShardAbandoned",
    "StagingRate",
    "encode_raw_shard",
    "lower_priority",
]


class ShardAbandoned(Exception):
    """A shard's preprocessing given up because the node is closing (see encode_raw_shard)."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """A preprocessed shard: its frames, the CPU it took, the samples its transform skipped."""

    frames: list[bytes]
    cpu_seconds: float
    skipped: int
    notes: tuple[str, ...]


def encode_raw_shard(
    data: bytes,
    manifest: manifest_pb2.Manifest,
    shard: manifest_pb2.Shard,
    url: str,
    transform: Transform,
    parts: Executor,
    abandon: threading.Event | None = None,
) -> Encoded:
    """Parse, transform and encode one raw shard (runs on a shard pool; its parts on ``parts``).

    ``abandon`` set (the node closing after its grace period) ends the work at
    the next batch with :class:`ShardAbandoned`: a shard's work runs on a pool
    thread that cancelling its task does not stop, and the node's exit waited
    for it, past the grace period and a pod's termination period (a large
    shard at a high zstd level: a minute).
    """
    started = time.thread_time()
    metered = MeteredPool(parts)
    schema = manifest_schema(manifest)
    try:
        options = CodecOptions.from_spec(manifest.preprocess)
    except ValueError as exc:  # published unchecked (before publish checked it) or by a newer one
        raise ManifestError(
            f"{manifest.dataset}@{manifest.version} cannot be encoded: {exc}; publish it again "
            "with settings in range (or upgrade this node if a newer edgecache published it)"
        ) from exc
    # Enough chunks in flight to keep every parts thread busy, few enough to bound memory;
    # rows per chunk on the grid readers cut their shuffle windows by.
    encoder = ShardEncoder(
        schema,
        options,
        pool=metered,
        in_flight=2 * metered.threads,
        chunk_rows=chunk_rows(manifest, schema),
    )
    context = ShardContext()
    frames: list[bytes] = []
    for batch in preprocess(
        data,
        fmt=manifest.source_format,
        source=url,
        spec=manifest.preprocess,
        schema=schema,
        transform=transform,
        context=context,
        pool=metered,
        key=shard.source_key,  # its Hive partition values, when the version records them
    ):
        if abandon is not None and abandon.is_set():
            raise ShardAbandoned(
                f"{manifest.dataset}@{manifest.version} shard from {url}: abandoned, the node "
                "is shutting down (nothing of it is kept)"
            )
        frames.extend(encoder.add(batch))
    frames.extend(encoder.finish())
    if encoder.rows != shard.row_count:
        raise MalformedShard(_row_count_mismatch(manifest, url, encoder.rows, shard.row_count))
    cpu = time.thread_time() - started + metered.cpu_seconds
    return Encoded(frames, cpu, context.skipped, tuple(context.notes))


def _row_count_mismatch(manifest: manifest_pb2.Manifest, url: str, rows: int, recorded: int) -> str:
    """Why a shard gave other rows than its version recorded, and what to do.

    An MDS version's counts come from its index.json (publish reads no shard), so
    there the likelier cause is an index written before its shards were.
    """
    if manifest.source_format == manifest_pb2.SOURCE_FORMAT_MDS:
        return (
            f"{url} holds {rows} samples in its header but the version recorded {recorded} "
            "from its index.json: the index is stale (or the shard was replaced); rewrite "
            "index.json (MDSWriter, or streaming's merge_index) and publish a new version"
        )
    return (
        f"{url} gave {rows} rows but the version recorded {recorded}; origin changed under "
        "an immutable version — publish a new version"
    )


class StagingRate:
    """Source bytes/s the node can preprocess, from the CPU time of its recent shards.

    Rate per core (bytes over thread CPU seconds, over the last ``window``
    shards, so a dataset of another kind soon shows) times the threads that
    can run at once (the preprocessing threads, at most the usable cores).
    """

    def __init__(self, threads: int, window: int = 64) -> None:
        self.threads = threads
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, source_bytes: int, cpu_seconds: float) -> None:
        """One preprocessed shard."""
        if cpu_seconds > 0:
            self._recent.append((source_bytes, cpu_seconds))

    def cpu_seconds_per_gb(self) -> float:
        """Thread CPU seconds per 1e9 source bytes (0: nothing preprocessed yet)."""
        total = sum(b for b, _ in self._recent)
        return sum(c for _, c in self._recent) / total * 1e9 if total else 0.0

    def bytes_per_second(self) -> float:
        """Source bytes/s on all threads (0: nothing preprocessed yet)."""
        per_gb = self.cpu_seconds_per_gb()
        return self.threads * 1e9 / per_gb if per_gb else 0.0


STAGING_NICE = 10  # added to the process's nice value for staging's preprocessing threads


def lower_priority() -> None:
    """Lower the calling thread's CPU priority by STAGING_NICE (Linux: nice is per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        me = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, me, min(os.getpriority(os.PRIO_PROCESS, me) + STAGING_NICE, 19)
        )
