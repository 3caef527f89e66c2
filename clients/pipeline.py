"""The read-ahead pipeline behind EdgeDataset: windows fetched on threads, batches in order.

Threads: fetching, checksum verification, zstd and Arrow decoding all
release the GIL, so one process reads on several cores. DataLoader workers
each run a pipeline of their own, sized to their share (EdgeDataset divides
the threads and the read-ahead among them), and hand batches to the main
process through a shared ring (:mod:`edgecache.clients.batch_memory`).

The assembler plans batches in canonical order (which window positions each
holds, :meth:`EpochOrder.batch`) and submits the windows they need to the
fetch threads in order of first need (a local cache's uncompressed windows it
reads itself, when first needed: see :meth:`Pipeline._submit`), planning
further ahead while the decoded bytes held stay under the windows open at once
plus a read-ahead that adapts to the consumer (see :class:`Pipeline`). A
window is dropped once every planned batch using it was built and no later
batch of this pipeline can need it: the canonical batches still to come read
each lane from a known place on (:meth:`RankBatches.reached`), and all of the
window's samples lie before it (the part another worker's lane or another rank
reads is theirs). At any time a pipeline holds about one window per stream it
reads, two for the streams of a lane where they move on, plus the read-ahead.

Stopping early (a ``break``, ``close()``, garbage collection, a DataLoader
worker's exit) cancels the reads and joins every thread before it returns:
the fetch threads decode zero-copy views of an LMDB map, and the node pool
may close that store, or the channels of in-flight streams, right after.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from edgecache.clients.batch_memory import BatchMemory
from edgecache.clients.edge_chunks import EdgeChunks
from edgecache.clients.epoch_order import Batch, EpochOrder, runs
from edgecache.clients.node_pool import NodePool
from edgecache.clients.read_target import ReadTarget
from edgecache.clients.tensors import ColumnKind, Gather, RowTable, assemble, chunk_views

__all__ = ["Pipeline"]

_DONE = object()
# Windows after the one being read that one gRPC stream goes on to deliver (parked in
# between): one request per CONTINUED_WINDOWS + 1 windows of a forward stream. One: the
# windows a request asks for beyond the next wait in HTTP/2 buffers long before they are
# read. With 3, bench.peers' loader held 30-70 MB more at the same speed (tokens and
# images over gRPC, 0 and 2 workers, three runs each).
CONTINUED_WINDOWS = 1
_CLOSED = object()


class _Stopped(Exception):
    """A read cut short by close(): its rows are incomplete and never used."""


@dataclass
class _Loaded:
    """A window's decoded chunks, and where each position of its order is among them."""

    batches: list[pa.RecordBatch]
    views: list[dict[str, np.ndarray | RowTable]]  # what gathers reuse of each chunk
    chunk: np.ndarray  # per position of the window's order: its chunk (index into batches)
    offset: np.ndarray  # and its row within that chunk


class _Inline:
    """A window of a local cache, read on the assembling thread when a batch first needs it.

    See :meth:`Pipeline._submit` for why it is not read on a fetch thread.
    """

    __slots__ = ("_read", "_loaded")

    def __init__(self, read: Callable[[], _Loaded]) -> None:
        self._read = read
        self._loaded: _Loaded | None = None

    def load(self) -> _Loaded:
        """The window, read now if it was not yet (a read that failed is tried again)."""
        if self._loaded is None:
            self._loaded = self._read()
        return self._loaded


_Pending = Future[_Loaded] | _Inline


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Pipeline:
    """Yields assembled batches for ``numbers`` of ``order``, reading ahead on threads.

    ``targets[i]`` and ``row_bytes[i]`` are component ``i``'s version and decoded
    bytes per row; with ``component_column`` each batch also holds that column:
    the component index of every sample. ``lanes``: the lanes whose windows it
    reads (default: all). Batches are assembled into ``memory`` (default: a
    fresh, or pinned, tensor per batch).

    Memory held: ``window_budget`` (about one window per stream it reads, which
    the planned batches need open at once), plus a read-ahead that
    starts at two windows and doubles, up to ``read_ahead`` bytes, each time
    the assembler had to wait for a window while no batch was ready (the
    consumer was waiting for data): a fast consumer on a slow link gets a deep
    read-ahead, one that is the bottleneck itself keeps the minimum.
    """

    def __init__(
        self,
        order: EpochOrder,
        numbers: Sequence[int],
        pool: NodePool,
        targets: Sequence[ReadTarget],
        kinds: Sequence[ColumnKind],
        *,
        row_bytes: Sequence[float],
        pin_memory: bool,
        threads: int,
        window_budget: float,
        read_ahead: float,
        component_column: str | None = None,
        lanes: Sequence[int] | None = None,
        ready_batches: int = 4,
        memory: BatchMemory | None = None,
    ) -> None:
        self.order, self.numbers, self.pool = order, numbers, pool
        self.targets = list(targets)
        self.kinds, self.pin_memory = list(kinds), pin_memory
        self.row_bytes = list(row_bytes)
        self.memory = memory
        self.component_column = component_column
        largest = max((self._window_bytes(w) for w in range(len(order.order.windows))), default=0.0)
        self.window_budget = window_budget  # about the windows open at once (one per stream)
        self.read_ahead_limit = max(float(read_ahead), 0.0)
        self.read_ahead = min(2 * largest, self.read_ahead_limit)
        self.fetch_wait_seconds = 0.0  # the assembler waiting for windows
        self.threads = threads
        self._delivered = 0  # batches put in the ready queue
        self._running: dict[int, float] = {}  # fetch thread → when its load started
        self._busy = 0.0  # seconds of loads finished, summed over fetch threads
        self._checked_at, self._checked_busy, self._grown_at = time.perf_counter(), 0.0, 0
        self._flight_lock = threading.Lock()
        self.held_peak = 0.0  # decoded bytes of windows held at most
        self.windows_inline = 0  # of those windows, read on the assembling thread (_submit)
        self._local_shards: dict[tuple[str, int, int], bool] = {}  # see _reads_locally
        self.windows_read = 0  # windows loaded, and the chunks they were decoded from:
        self.window_chunks = 0  # one each where windows lie on the chunks (cache/row_grid.py)
        # the lanes whose windows this pipeline reads (a DataLoader worker's, when
        # the worker count divides the lanes)
        self.lanes = set(range(len(order.order.lanes)) if lanes is None else lanes)
        self.wait_seconds = 0.0
        self._ready: queue.Queue[object] = queue.Queue(maxsize=ready_batches)
        self._stop = threading.Event()
        self._fetchers: set[int] = set()
        self._executor = ThreadPoolExecutor(
            threads, thread_name_prefix="edgecache-fetch", initializer=self._fetcher_started
        )
        # Batches are planned and copied into their memory on this one thread. Build
        # threads beside it bought nothing: the row copies hold the GIL
        # (tensors._copy_ranges), and every torch or numpy call that drops it can wait
        # out a switch interval to get it back while another thread runs Python. Without
        # them an images epoch over lmdb:// ran 10-15 % faster at num_workers=0 (2 cores).
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
                        f"reading {', '.join(map(str, self.targets))} after its dataset was "
                        "closed; "
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

    def _load(self, window: int, extend_to: int | None = None) -> _Loaded:
        """Read and decode window ``window`` (the part of it this epoch takes)."""
        self._track(None)
        try:
            return self._read_window(window, extend_to)
        finally:
            self._track(0.0)

    def _continuation(self, window: int) -> int | None:
        """Where the windows after ``window`` in its stream end, if this pipeline reads them next.

        Those are the windows right after it in its shard, read by the same
        stream (front to back) in a lane of this pipeline, up to
        ``CONTINUED_WINDOWS`` of them: a gRPC read of ``window`` asks for their
        rows too and parks the stream for the next one
        (:mod:`~edgecache.clients.parked_streams`). Backward streams read the
        window before instead, which a stream cannot deliver first.
        """
        order = self.order.order
        windows = order.windows

        def stream_of(w: int) -> int | None:
            units = range(int(order._window_units[w]), int(order._window_units[w + 1]))
            whole = windows.take_from[w] == 0 and windows.take_to[w] == windows.rows[w]
            return int(order.unit_stream[units[0]]) if len(units) == 1 and whole else None

        stream = stream_of(window)
        if stream is None:
            return None
        lane = order.lanes[stream % order.lane_count]
        if lane.index not in self.lanes or lane.backward[stream // order.lane_count]:
            return None
        end, found = int(windows.row_start[window] + windows.rows[window]), None
        for _ in range(CONTINUED_WINDOWS):
            after = [
                o
                for o in order.neighbours(window)
                if int(windows.row_start[o]) == end and stream_of(o) == stream
            ]
            if not after:
                break
            window = after[0]
            end = found = end + int(windows.rows[window])
        return found

    def _read_window(self, window: int, extend_to: int | None = None) -> _Loaded:
        order, windows = self.order.order, self.order.order.windows
        perm = order.window_order(window)
        taken = perm[windows.take_from[window] : windows.take_to[window]]
        start = int(windows.row_start[window])
        target = self.targets[int(windows.component[window])]
        rows = target.rows(
            int(windows.shard[window]), start + int(taken.min()), start + int(taken.max()) + 1
        )
        firsts, batches = [], []
        whole = rows.row_start == start and rows.row_end == start + int(windows.rows[window])
        read_rows = self.pool.read_rows(
            rows, self._edges, stop=self._stop, extend_to=extend_to if whole else None
        )
        with contextlib.closing(read_rows) as read:
            for first, batch in read:
                if self._stop.is_set():
                    break
                firsts.append(first)
                batches.append(batch)
        if self._stop.is_set():
            raise _Stopped  # partial: never assembled
        with self._flight_lock:
            self.windows_read += 1
            self.window_chunks += len(batches)
        # Where every row of the window's order lies, worked out once per window (on
        # a fetch thread) rather than for each batch that gathers from it.
        starts = np.asarray(firsts, dtype=np.int64)
        rows_of = start + perm
        chunk = np.searchsorted(starts, rows_of, side="right") - 1
        sizes = np.array([b.num_rows for b in batches], dtype=np.int64)
        offset = rows_of - starts[np.maximum(chunk, 0)]
        needed = np.zeros(len(perm), dtype=bool)
        needed[int(windows.take_from[window]) : int(windows.take_to[window])] = True
        if np.any(needed & ((chunk < 0) | (offset >= sizes[np.maximum(chunk, 0)]))):
            raise IndexError(f"{rows}: the chunks read do not cover the window's rows")
        try:
            views = [chunk_views(b, self.kinds) for b in batches]
        except ValueError as exc:  # a null: in a mixture, name the version that holds it
            if len(exc.args) == 1 and isinstance(exc.args[0], str):
                exc.args = (f"{rows.target} shard {rows.shard}: {exc.args[0]}",)
            raise
        return _Loaded(batches, views, chunk, offset)

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

    def _shard(self, window: int) -> tuple[str, int, int]:
        windows = self.order.order.windows
        target = self.targets[int(windows.component[window])]
        return (target.dataset, target.version, int(windows.shard[window]))

    def _edge(self, window: int, other: int) -> int:
        """The row where windows ``window`` and ``other`` (neighbours) meet."""
        windows = self.order.order.windows
        start = int(windows.row_start[window])
        return start if int(windows.row_start[other]) < start else start + int(windows.rows[window])

    def _window_bytes(self, window: int) -> float:
        windows = self.order.order.windows
        return float(windows.rows[window]) * self.row_bytes[int(windows.component[window])]

    def _assemble_all(self) -> None:
        order = self.order
        windows = order.order.windows
        self._edges = EdgeChunks(limit=4 * len(order.order.lanes) * order.order.per_lane + 8)
        futures: dict[int, _Pending] = {}
        refs: collections.Counter[int] = collections.Counter()
        # Per lane: where the last planned batch ends. A lane's batches come in order, so
        # a window none of them uses any more, with no sample at or past this, is done.
        frontier: dict[int, int] = {}
        idle: set[int] = set()  # loaded windows no planned batch uses (yet)
        planned: collections.deque[Batch] = collections.deque()
        numbers = iter(self.numbers)
        upcoming = next(numbers, None)  # the next batch to plan
        more = True
        held = 0.0

        def plan() -> None:
            nonlocal more, held, upcoming
            number, upcoming = upcoming, next(numbers, None)
            if number is None:
                more = False
                return
            batch = order.batch(number)
            for span in batch.spans:
                frontier[span.lane] = max(frontier.get(span.lane, span.hi), span.hi)
            for piece in batch.pieces:
                window = piece.window
                refs[window] += 1
                idle.discard(window)
                if window not in futures:
                    # A chunk across the edge with a neighbouring window is decoded
                    # once if both are read while it is kept (it is dropped with the
                    # window that decoded it, so this costs no memory).
                    for other in order.order.neighbours(window):
                        edge = self._edge(window, other)
                        self._edges.share(self._shard(window), edge)  # type: ignore[union-attr]
                    futures[window] = self._submit(window, futures)
                    held += self._window_bytes(window)
            planned.append(batch)
            self.held_peak = max(self.held_peak, held)

        def ahead(window: int) -> bool:
            """Whether a later batch of this pipeline reads ``window``, as far as lanes tell."""
            for lane, first, end in order.order.window_units_spans(window):
                if lane in self.lanes and end > frontier.get(lane, -1):
                    if any(a < end and first < b for a, b in order.ranks.parts[lane]):
                        return True
            return False

        def release() -> None:
            """Drop windows that no planned or later batch can use.

            A later batch of this pipeline reads each lane from where the canonical
            batches from the next one on start reading it: a window whose samples all
            lie before that, in every lane holding some, is done here (the part of it
            another worker's lane or another rank reads is theirs to read).
            """
            nonlocal held
            if not idle:
                return
            reached = order.ranks.reached(upcoming) if upcoming is not None else None
            for window in list(idle):
                spans = order.order.window_spans(window)
                if reached is None or all(end <= reached[lane] for lane, end in spans):
                    idle.discard(window)
                    del futures[window]
                    held -= self._window_bytes(window)
                    # Its edge chunks go too, unless the neighbour that takes one is
                    # being read (it may not have taken it yet) or is still ahead in
                    # this pipeline's part of its lane (a mixture's stream reads a
                    # window of another version between two neighbours).
                    start = int(windows.row_start[window])
                    live = {
                        self._edge(window, o)
                        for o in order.order.neighbours(window)
                        if o in futures or ahead(o)
                    }
                    edges = tuple(
                        e for e in (start, start + int(windows.rows[window])) if e not in live
                    )
                    self._edges.forget(self._shard(window), edges)  # type: ignore[union-attr]

        while True:
            if self._stop.is_set():
                return
            if not planned and more:
                plan()
            while more and held < self.window_budget + self.read_ahead:
                plan()
            if not planned:
                return
            batch = planned.popleft()
            gathers, owners = self._gathers(batch, futures)
            for piece in batch.pieces:
                refs[piece.window] -= 1
                if refs[piece.window] == 0:
                    del refs[piece.window]
                    idle.add(piece.window)
            release()
            self._put(self._build(batch.size, gathers, owners))
            self._delivered += 1

    def _build(
        self, size: int, gathers: list[Gather], owners: list[tuple[int, int]]
    ) -> tuple[int, dict[str, object]]:
        """One batch copied into its memory."""
        extra = None
        if self.component_column is not None:
            column = np.repeat([c for c, _ in owners], [n for _, n in owners]).astype(np.int64)
            extra = {self.component_column: column}
        out = assemble(
            gathers, self.kinds, pin_memory=self.pin_memory, memory=self.memory, extra=extra
        )
        return size, out

    def _gathers(
        self, batch: Batch, futures: dict[int, _Pending]
    ) -> tuple[list[Gather], list[tuple[int, int]]]:
        """The batch's rows grouped by chunk (in row order within each), and their components."""
        windows = self.order.order.windows
        loaded = [self._result(futures[piece.window]) for piece in batch.pieces]
        sizes = [len(p.positions) for p in batch.pieces]
        chunk_ids = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        chunks = np.concatenate(
            [w.chunk[p.positions] for w, p in zip(loaded, batch.pieces, strict=True)]
        )
        offsets = np.concatenate(
            [w.offset[p.positions] for w, p in zip(loaded, batch.pieces, strict=True)]
        )
        order = np.lexsort((offsets, chunks, chunk_ids))
        keys = chunk_ids[order] * (1 << 32) + chunks[order]
        gathers, owners = [], []
        for start, end in runs(keys):
            group = order[start:end]
            i, c = int(chunk_ids[group[0]]), int(chunks[group[0]])
            window = loaded[i]
            gathers.append(Gather(window.batches[c], offsets[group], window.views[c], True))
            owners.append((int(windows.component[batch.pieces[i].window]), len(group)))
        return gathers, owners

    def _submit(self, window: int, futures: dict[int, _Pending]) -> _Pending:
        """Load ``window`` on a fetch thread; after a neighbour still being read, if one is.

        A window of uncompressed chunks whose read goes to a local cache holding
        its shard (``lmdb://``) is read on the assembling thread instead, when a
        batch first needs it: that read is a little Python around views of the
        map (a checksum, Arrow's zero-copy decode), nothing a thread could overlap,
        and on a fetch thread each call in it that drops the GIL handed the GIL
        to the assembler and then waited to get it back. Read inline, an images
        epoch over ``lmdb://`` ran 1.2-1.3x faster at ``num_workers=0`` on 2 cores
        (docs/benchmarks.md). zstd chunks stay on fetch threads: their decoding
        drops the GIL for milliseconds at a time and runs beside the assembler
        (inline, tokens read 20 % slower). From a cold cache the kernel still
        reads ahead in the map (the reader's environment keeps LMDB's read-ahead
        on): a 1 GiB images epoch with the file dropped from the page cache read
        7.1-7.9k samples/s inline against 6.5-7.2k on fetch threads.

        Two neighbouring windows share the chunk across their edge, and the read
        that gets it first hands it to the other (:class:`EdgeChunks`). Read at
        the same time, both would fetch it: on gRPC that is a whole chunk sent
        twice (uncompressed images read 1.4x their bytes that way). So a window
        whose neighbour is still in flight is read when that one is done. It
        waits in a callback, not on a thread: no fetch thread is ever blocked.
        """
        target = self.targets[int(self.order.order.windows.component[window])]
        if not target.compressed and self._reads_locally(self._shard(window)):
            self.windows_inline += 1
            return _Inline(lambda: self._load(window))
        pending = [
            future
            for o in self.order.order.neighbours(window)
            # A neighbour read inline is read when needed: waiting for it could wait forever.
            if isinstance(future := futures.get(o), Future) and not future.done()
        ]
        extend_to = self._continuation(window)
        if not pending:
            return self._executor.submit(self._load, window, extend_to)
        outer: Future[_Loaded] = Future()
        waiting = [len(pending)]
        lock = threading.Lock()

        def copy(inner: Future[_Loaded]) -> None:
            if inner.cancelled():
                outer.set_exception(_Stopped())
            elif inner.exception() is not None:
                outer.set_exception(inner.exception())  # type: ignore[arg-type]
            else:
                outer.set_result(inner.result())

        def start(_: Future[_Loaded]) -> None:
            with lock:
                waiting[0] -= 1
                if waiting[0]:
                    return
            if self._stop.is_set():
                # Closing: this callback may be running inside the executor's own
                # shutdown (cancelling a neighbour's future calls it, under the
                # executor's non-reentrant shutdown lock), where submit would deadlock.
                outer.set_exception(_Stopped())
                return
            try:
                inner = self._executor.submit(self._load, window, extend_to)
            except RuntimeError:  # the pipeline was closed meanwhile
                outer.set_exception(_Stopped())
                return
            inner.add_done_callback(copy)

        for future in pending:
            future.add_done_callback(start)
        return outer

    def _reads_locally(self, shard: tuple[str, int, int]) -> bool:
        """Whether ``shard``'s reads go first to a local cache holding it, asked once a pass.

        Asking opens a read transaction and looks the shard up: ~60 us, once per
        window, was ~5 % of an images epoch over ``lmdb://``. It only decides on which
        thread a window is read (the read itself fails over wherever it runs), so a
        shard evicted or staged during the pass costs nothing but that choice.
        """
        local = self._local_shards.get(shard)
        if local is None:
            local = self._local_shards[shard] = self.pool.reads_locally(shard)
        return local

    def _result(self, future: _Pending) -> _Loaded:
        """A window's load; a wait for it is counted, and may widen the read-ahead.

        The read-ahead doubles (at most once every four batches) when the
        assembler waits for a window while no batch is ready, so the consumer
        waits too, and the fetch threads were less than 80 % busy since the last
        such wait: the windows were asked for too late, not read too slowly.
        Reads that keep every thread busy (decoding zstd, a slow link) are the
        limit themselves, and reading further ahead would only hold memory.
        Before the first batch everything waits; that widens nothing. A window
        read inline is read here, and reading further ahead would not hasten it.
        """
        if isinstance(future, _Inline):
            return future.load()
        if future.done():
            return future.result()
        starved = self._ready.empty() and self._delivered > 0
        started = time.perf_counter()
        loaded = future.result()
        now = time.perf_counter()
        self.fetch_wait_seconds += now - started
        if starved and now - started > 0.001:
            with self._flight_lock:
                busy = self._busy + sum(now - t for t in self._running.values())
            span = max(now - self._checked_at, 1e-9)
            used = (busy - self._checked_busy) / (self.threads * span)
            self._checked_at, self._checked_busy = now, busy
            if used < 0.8 and self._delivered >= self._grown_at + 4:
                self.read_ahead = min(max(2 * self.read_ahead, 1.0), self.read_ahead_limit)
                self._grown_at = self._delivered
        return loaded

    @property
    def fetch_busy_seconds(self) -> float:
        """Seconds the fetch threads spent loading windows, summed over threads."""
        with self._flight_lock:
            return self._busy

    def _track(self, started: float | None) -> None:
        """A load started (``started`` None: record it) or ended (the time it started)."""
        me = threading.get_ident()
        with self._flight_lock:
            if started is None:
                self._running[me] = time.perf_counter()
            else:
                self._busy += time.perf_counter() - self._running.pop(me, started)
