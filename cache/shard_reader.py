"""Zero-copy, verified reads of one cached shard, and the lifetime rules for its views.

LMDB hands out views into its memory map that stay correct only while their
read transaction is open. A :class:`ShardReader` owns one transaction; when it
closes, every view it handed out is released, so a late use raises instead of
reading a page a writer has since recycled. A view that is still exported
(wrapped by a pyarrow buffer, say) cannot be released: its transaction is then
kept open by the store until the export is gone.

That holds for slices too: a view handed out is a memoryview of a pyarrow
buffer that holds LMDB's own view, so ``memoryview(view)[a:b]`` (what
decoding an uncompressed chunk keeps) keeps LMDB's view exported. Handing
out LMDB's view itself, a slice of it shared its buffer without exporting
it: the transaction ended under batches still pointing into its pages, and
once the node evicted the shard and wrote over them those batches read
other data.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Self

import lmdb
import pyarrow as pa

from edgecache.cache.codec import decode_chunk
from edgecache.cache.errors import ChunkCorrupt, StoreError
from edgecache.cache.frame import verify_frame
from edgecache.cache.keys import ShardKey, chunk_key

if TYPE_CHECKING:
    from edgecache.cache.store import CacheStore, ShardInfo

__all__ = ["ClosingContext", "ShardReader", "release_all"]


class ClosingContext:
    """``with obj:`` calls ``obj.close()`` on the way out."""

    def close(self) -> None:
        """Release what the object holds."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def release_all(views: list[memoryview]) -> bool:
    """Release views; False if any is still exported (and so must stay mapped)."""
    ok = True
    for view in views:
        try:
            view.release()
        except BufferError:
            ok = False
    return ok


class ShardReader(ClosingContext):
    """Zero-copy, verified access to one shard inside one read transaction.

    Views from :meth:`chunk` and batches from :meth:`batches` are valid until
    the ``with`` block ends; copy (``bytes(view)``) anything that must outlive it.
    """

    def __init__(
        self,
        store: CacheStore,
        txn: lmdb.Transaction,
        key: ShardKey,
        info: ShardInfo,
        verify: bool,
    ) -> None:
        self._store = store
        self._txn: lmdb.Transaction | None = txn
        self._raw_key = key.encode()
        self._views: list[memoryview] = []  # handed out: released first, so a late use raises
        self._lmdb_views: list[memoryview] = []  # LMDB's own: exported while a slice lives
        self._verify = verify
        self._thread = threading.get_ident()  # the store counts open readers per thread
        self.info = info

    def chunk(self, index: int) -> memoryview:
        """The verified frame of chunk ``index``, as a view into the LMDB map."""
        if self._txn is None:
            raise StoreError(f"the reader of {self.info.key} is closed; open it again")
        if not 0 <= index < self.info.chunk_count:
            raise IndexError(
                f"{self.info.key} has {self.info.chunk_count} chunks; chunk {index} does not exist"
            )
        found = self._txn.get(chunk_key(self._raw_key, index), db=self._store._dbs[b"chunks"])
        view = found if isinstance(found, memoryview) else None  # None: gone
        if view is not None:
            self._lmdb_views.append(view)
        if self._verify or view is None:
            # Every way the entry can be wrong is damage: drop the shard so the next
            # read is a miss and fetches it again, and never hand these bytes out.
            try:
                self._check(index, view)
            except ChunkCorrupt as exc:
                self._store._corrupt_chunk(self.info.key)
                raise ChunkCorrupt(f"{self.info.key} chunk {index}: {exc}") from exc
        assert view is not None  # _check raised otherwise
        # Every slice of ``handed`` holds the pyarrow buffer, which holds an export of
        # ``view``: LMDB's view cannot be released (nor the snapshot end) while any does.
        handed = memoryview(pa.py_buffer(view))
        self._views.append(handed)
        return handed

    def _check(self, index: int, view: memoryview | None) -> None:
        """Raise :class:`ChunkCorrupt` unless chunk ``index`` is whole and as the record says."""
        info = self.info
        if view is None:  # gone, which a complete shard's chunk never is
            raise ChunkCorrupt("the chunk is missing from the store")
        if damage := info.damage():
            raise ChunkCorrupt(damage)
        header = verify_frame(view)  # magic, format, codec, lengths, then the checksum
        if header.checksum != info.checksums[index]:
            raise ChunkCorrupt(
                f"chunk checksum {header.checksum:016x} differs from the shard "
                f"record's {info.checksums[index]:016x}"
            )
        if header.rows != info.chunk_rows[index]:
            raise ChunkCorrupt(
                f"chunk holds {header.rows} rows, the shard record says {info.chunk_rows[index]}"
            )

    def __iter__(self) -> Iterator[memoryview]:
        for index in range(self.info.chunk_count):
            yield self.chunk(index)

    def batches(self, schema: pa.Schema | None = None, start: int = 0) -> Iterator[pa.RecordBatch]:
        """Decode the shard's chunks in order (checksums already verified here)."""
        for index in range(start, self.info.chunk_count):
            yield decode_chunk(self.chunk(index), schema, verify=False)

    def close(self) -> None:
        """End the read transaction, or defer it while a view is still exported."""
        if self._txn is None:
            return
        txn, self._txn = self._txn, None
        views = self._views + self._lmdb_views
        self._views, self._lmdb_views = [], []
        if release_all(views):
            txn.abort()
        else:
            self._store._linger(txn, views)
        self._store._read_ended(self._thread)

    def __del__(self) -> None:
        if self._txn is not None and os.getpid() == self._store._pid:
            self.close()
