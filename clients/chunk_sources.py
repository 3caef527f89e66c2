"""Where a read's chunks come from: a node's ReadShard stream, or the local LMDB cache.

Each yields ``(first row, record batch)`` for the chunks covering a range of
rows of one shard, verified and decoded; chunks across the range's edges are
decoded once for the reads on both sides (:class:`~edgecache.clients.edge_chunks.EdgeChunks`).
:class:`~edgecache.clients.node_pool.NodePool` picks the source, fails over
between them and parks streams (:mod:`~edgecache.clients.parked_streams`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import pyarrow as pa

from edgecache.cache.codec import decode_chunk
from edgecache.cache.errors import ChunkCorrupt, ShardNotCached
from edgecache.cache.frame import Buffer, read_header, verify_frame
from edgecache.cache.keys import ShardKey
from edgecache.clients.edge_chunks import EdgeChunks
from edgecache.clients.endpoints import Endpoint
from edgecache.clients.local_stores import EVICTED_OR_NOT_STAGED, restage_advice
from edgecache.clients.parked_streams import Parked
from edgecache.clients.read_target import ShardRange

if TYPE_CHECKING:
    from edgecache.cache.store import CacheStore
    from edgecache.clients.node_pool import NodePool

__all__ = ["Stream", "chained", "goes_past", "grpc_rows", "local_rows", "not_in_cache"]


@dataclass
class Stream:
    """A ReadShard call being read: the watchdog's view of it."""

    call: grpc.Call | None
    stop: threading.Event | None = None  # set when the reader that opened it stops
    last: float = field(default_factory=time.monotonic)
    started: bool = False
    parked: bool = False  # left open for the next window's read: not stalled
    until: int = 0  # the row the stream was asked to go to (0: the shard's end)

    def touch(self) -> None:
        """It delivered (or was taken up again) just now."""
        self.last = time.monotonic()


def grpc_rows(
    pool: NodePool,
    endpoint: Endpoint,
    rows: ShardRange,
    edges: EdgeChunks | None = None,
    stop: threading.Event | None = None,
    handle: list[Stream] | None = None,
) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """The chunks of ``rows`` from ``endpoint``, verified and decoded.

    Chunks across an edge of ``rows`` are shared with the read beside it
    through ``edges``; the stream is put in ``handle`` (for parking).
    """
    target, shard = rows.target, rows.shard
    row_start, row_end = rows.row_start, rows.row_end
    call = pool.read_shard_call(endpoint)(rows.request(), metadata=pool.metadata)
    stream = Stream(call, stop, until=rows.row_end)
    if handle is not None:
        handle.append(stream)
    pool.track(stream)
    if stop is not None and stop.is_set():
        call.cancel()  # stopped while it was being opened: cancel() did not see it
    stats = pool.stats[endpoint.text]
    expected: int | None = None  # where the next chunk must start
    try:
        for chunk in call:
            stream.last, stream.started = time.monotonic(), True
            stats.bytes += len(chunk.frame)
            header = read_header(chunk.frame)
            # The checksum covers the frame; the row numbers beside it are checked
            # for consistency, so a damaged first_row cannot misplace rows either.
            placed = (
                chunk.first_row <= row_start < chunk.first_row + header.rows
                if expected is None
                else chunk.first_row == expected
            )
            if header.checksum != chunk.checksum or header.rows != chunk.rows or not placed:
                raise ChunkCorrupt(
                    f"{target} shard {shard} chunk {chunk.index} from "
                    f"{endpoint.text}: checksum or row numbers differ from the frame's"
                )
            first, frame = chunk.first_row, chunk.frame
            expected = end = first + header.rows
            if edges is None or not edges.across(rows.shard_id, first, end, row_start, row_end):
                yield first, decode_chunk(frame, target.schema)
            else:  # across an edge of this read: the read beside it needs it too
                # Our own copy is verified once, here, whichever read decodes it.
                verify_frame(frame)

                def decode(frame: Buffer = frame) -> pa.RecordBatch:
                    return decode_chunk(frame, target.schema, verify=False)

                batch = edges.decode(
                    (
                        target.dataset,
                        target.version,
                        shard,
                        first,
                        header.rows,
                        header.checksum,
                    ),
                    header.rows,
                    min(end, row_end) - max(first, row_start),
                    decode,
                )
                yield first, batch
    finally:
        pool.untrack(stream)
        call.cancel()


def local_rows(
    pool: NodePool, endpoint: Endpoint, rows: ShardRange, edges: EdgeChunks | None = None
) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """The chunks of ``rows`` from the local cache of ``endpoint``, decoded in place.

    The store verifies each chunk's checksum as it hands out the view; the
    batches point into the LMDB map, which the store keeps alive while any of
    them is referenced.
    """
    target, shard = rows.target, rows.shard
    row_start, row_end = rows.row_start, rows.row_end
    store = pool.store(endpoint)
    kept = pool.local_digest(endpoint, target.dataset, target.version)
    if target.digest and kept is not None and kept != target.digest:
        # Another copy of the version than the one this dataset reads (its manifest came
        # from a node of another region, or the registry changed under this cache): its
        # rows are other rows. Read elsewhere, as for a shard this cache lacks.
        raise ShardNotCached(
            f"the cache at {store.path} holds {target} with digest {kept}, not {target.digest} "
            "as this dataset read it: the version was changed in the registry after that "
            f"cache took it. Evict it there (edgecache evict {target} --region <its region>) "
            "and stage it again; meanwhile reads go to the next endpoint"
        )
    try:
        opened = store.read_shard(ShardKey(target.dataset, target.version, shard))
    except ShardNotCached as exc:
        raise ShardNotCached(not_in_cache(store, endpoint, rows)) from exc
    with opened as reader:
        first = 0
        for index, count in enumerate(reader.info.chunk_rows):
            if first + count > row_start and first < row_end:
                view = reader.chunk(index)
                pool.stats[endpoint.text].bytes += len(view)
                # Copy-free decode points into LMDB; the store keeps the snapshot alive
                # while any of these batches are referenced.
                if edges is None or not edges.across(
                    rows.shard_id, first, first + count, row_start, row_end
                ):
                    yield first, decode_chunk(view, target.schema, verify=False)
                else:  # across an edge of this read: the read beside it needs it too

                    def decode(view: Buffer = view) -> pa.RecordBatch:
                        return decode_chunk(view, target.schema, verify=False)

                    checksum = reader.info.checksums[index]
                    key = (target.dataset, target.version, shard, first, count, checksum)
                    taken = min(first + count, row_end) - max(first, row_start)
                    yield first, edges.decode(key, count, taken, decode)
            first += count
            if first >= row_end:
                break


def not_in_cache(store: CacheStore, endpoint: Endpoint, rows: ShardRange) -> str:
    """Why ``rows`` cannot be read from a local cache, and what to do: its node let them go."""
    target = rows.target
    held = sum(
        v.shard_count
        for v in store.versions()
        if (v.dataset, v.version) == (target.dataset, target.version)
    )
    if held:
        # A region's replicas split a version's shards: a replica's cache lacks the others'
        # by design, and "evicted" sent an operator to stage what was staged already.
        state = (
            f"holds {held} shard{'s' if held != 1 else ''} of {target} but not shard "
            f"{rows.shard}: another replica of "
            "its node's region owns that shard (replicas split a version's shards; reads of it "
            "go on at the next endpoint), or its node evicted it (for space, or corrupt) or has "
            "not staged it yet"
        )
    else:
        state = f"holds no shard of {target}: {EVICTED_OR_NOT_STAGED}"
    return f"the cache at {store.path} {state}. " + restage_advice(str(target), endpoint.text)


def goes_past(stream: Stream, row: int) -> bool:
    """Whether ``stream`` was asked for rows beyond ``row`` (so parking it is worth it)."""
    return stream.until == 0 or stream.until > row


def chained(parked: Parked) -> Generator[tuple[int, pa.RecordBatch], None, None]:
    """A parked stream as a generator that closes the stream when it is closed."""
    try:
        yield from parked.resume()
    finally:
        parked.close()
