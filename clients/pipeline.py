"""The read-ahead pipeline behind EdgeDataset: windows fetched on threads, batches in order.

Threads, not processes: fetching, checksum verification, zstd and Arrow
decoding all release the GIL, and DataLoader worker processes cost more than
they give on small hosts (every batch is pickled through shared memory).
Windows are fetched in the order batches need them, up to ``prefetch_bytes``
ahead; one assembler thread builds batches in canonical order into a small
queue; a window is dropped as soon as the last batch that uses it is built.

Stopping early (a ``break``, ``close()``, garbage collection, a DataLoader
worker's exit) cancels the reads and joins every thread before it returns:
the fetch threads decode zero-copy views of an LMDB map, and the node pool
may close that store, or the channels of in-flight streams, right after.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from edgecache.clients.edge_chunks import EdgeChunks
from edgecache.clients.epoch_order import EpochOrder, Window
from edgecache.clients.node_pool import NodePool
from edgecache.clients.read_target import ReadTarget
from edgecache.clients.tensors import ColumnKind, Gather, assemble

__all__ = ["Pipeline"]

_DONE = object()
_CLOSED = object()


class _Stopped(Exception):
    """A read cut short by close(): its rows are incomplete and never used."""


@dataclass
class _Loaded:
    """A window's decoded chunks and its order."""

    firsts: list[int]
    batches: list[pa.RecordBatch]
    order: np.ndarray  # absolute row numbers, in this epoch's order (rank's slice)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Pipeline:
    """Yields assembled batches for ``numbers`` of ``order``, reading ahead on threads."""

    def __init__(
        self,
        order: EpochOrder,
        numbers: Sequence[int],
        pool: NodePool,
        target: ReadTarget,
        kinds: Sequence[ColumnKind],
        *,
        row_bytes: float,
        pin_memory: bool,
        threads: int,
        prefetch_bytes: int,
        ready_batches: int = 4,
    ) -> None:
        self.order, self.numbers, self.pool, self.target = order, list(numbers), pool, target
        self.kinds, self.pin_memory = list(kinds), pin_memory
        self.row_bytes, self.prefetch_bytes = row_bytes, prefetch_bytes
        self.wait_seconds = 0.0
        self._ready: queue.Queue[object] = queue.Queue(maxsize=ready_batches)
        self._stop = threading.Event()
        self._fetchers: set[int] = set()
        self._executor = ThreadPoolExecutor(
            threads, thread_name_prefix="edgecache-fetch", initializer=self._fetcher_started
        )
        self._assembler = threading.Thread(target=self._run, name="edgecache-assemble", daemon=True)
        self._edges: EdgeChunks | None = None
        self._close_lock = threading.Lock()
        self._closed = False

    def __iter__(self) -> Iterator[tuple[int, dict[str, object]]]:
        with self._close_lock:
            if not self._closed:  # closed before the first batch: _CLOSED is waiting
                self._assembler.start()
        try:
            while True:
                started = time.perf_counter()
                item = self._ready.get()
                self.wait_seconds += time.perf_counter() - started
                if item is _DONE:
                    return
                if item is _CLOSED:
                    raise ValueError(
                        f"reading {self.target} after its dataset was closed; "
                        "iterate the dataset again to start a new pass"
                    )
                if isinstance(item, _Failure):
                    raise item.exc
                yield item  # type: ignore[misc]
        finally:
            self.close()

    def close(self) -> None:
        """Stop reading ahead and wait until every thread of this pipeline has finished.

        Safe to call twice and from any thread. The caller may release what the
        reads use (the node pool's channels and LMDB stores) once this returns:
        the fetch threads decode zero-copy views of the LMDB map, so closing a
        store under them would crash the process. In-flight gRPC streams are
        cancelled so the joins are prompt, and a stopped read is not a failure
        (no failover is counted or logged). A thread of this pipeline that
        closes it (the garbage collector can run anywhere) is not waited for.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self.pool.cancel(self._stop)
        self._drain()  # the assembler may wait for room in the queue
        self._executor.shutdown(wait=False, cancel_futures=True)
        me = threading.current_thread()
        if me is not self._assembler and self._assembler.ident is not None:
            self._assembler.join()
        if me.ident not in self._fetchers:
            self._executor.shutdown(wait=True)
        self._edges = None  # decoded chunks at window edges: they may hold LMDB views
        self._drain()
        self._ready.put(_CLOSED)  # a consumer still waiting, or asking later, is told

    def _drain(self) -> None:
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                return

    # ------------------------------------------------------------- assembler

    def _fetcher_started(self) -> None:
        self._fetchers.add(threading.get_ident())

    def _load(self, window: Window) -> _Loaded:
        firsts, batches = [], []
        rows = self.target.rows(window.shard, window.row_start, window.row_start + window.rows)
        with contextlib.closing(self.pool.read_rows(rows, self._edges, stop=self._stop)) as read:
            for first, batch in read:
                if self._stop.is_set():
                    break
                firsts.append(first)
                batches.append(batch)
        if self._stop.is_set():
            raise _Stopped  # partial: never assembled
        return _Loaded(firsts, batches, window.row_start + window.order())

    def _run(self) -> None:
        try:
            self._assemble_all()
            self._put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer thread
            self._put(_Failure(exc))

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _assemble_all(self) -> None:
        order = self.order
        batches = [order.batch(n) for n in self.numbers]
        uses: dict[int, int] = {}
        first_use: list[int] = []
        for batch in batches:
            for piece in batch.pieces:
                if piece.window not in uses:
                    first_use.append(piece.window)
                uses[piece.window] = uses.get(piece.window, 0) + 1
        # Rows where two windows read here meet: the chunk across is decoded once.
        starts: dict[int, set[int]] = {}
        ends: dict[int, set[int]] = {}
        for index in first_use:
            w = order.windows[index]
            starts.setdefault(w.shard, set()).add(w.row_start)
            ends.setdefault(w.shard, set()).add(w.row_start + w.rows)
        self._edges = EdgeChunks({s: starts[s] & ends.get(s, set()) for s in starts})
        futures: dict[int, Future[_Loaded]] = {}
        in_flight = 0.0
        next_load = 0

        def top_up(needed: set[int]) -> None:
            """Submit loads in order of need: at least what ``needed`` uses, then up to budget."""
            nonlocal in_flight, next_load
            while next_load < len(first_use) and (
                not needed.issubset(futures) or in_flight < self.prefetch_bytes
            ):
                index = first_use[next_load]
                futures[index] = self._executor.submit(self._load, order.windows[index])
                in_flight += order.windows[index].rows * self.row_bytes
                next_load += 1

        for batch in batches:
            if self._stop.is_set():
                return
            top_up({piece.window for piece in batch.pieces})
            gathers: list[Gather] = []
            for piece in batch.pieces:
                loaded = futures[piece.window].result()
                rows = np.sort(loaded.order[piece.start : piece.stop])
                chunk_of = np.searchsorted(loaded.firsts, rows, side="right") - 1
                for chunk in np.unique(chunk_of):
                    selected = rows[chunk_of == chunk] - loaded.firsts[chunk]
                    gathers.append(Gather(loaded.batches[chunk], selected))
                uses[piece.window] -= 1
                if uses[piece.window] == 0:  # last use: free it, make room to read ahead
                    del futures[piece.window]
                    in_flight -= order.windows[piece.window].rows * self.row_bytes
            self._put((batch.size, assemble(gathers, self.kinds, pin_memory=self.pin_memory)))
