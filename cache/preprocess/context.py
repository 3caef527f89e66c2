"""What a transform may know about the shard it is working on, and the threads it may use.

Transforms are stateless callables (one object serves every shard, on any
thread), yet a good error names the object and the sample, a ``skip`` policy
must count what it dropped, and decoding a batch of images should use every
preprocessing core. The pipeline therefore sets a :class:`ShardContext` (a
context variable, so each thread sees its own shard) around each transform
call: the object's name, the shard row the batch starts at, the node's worker
pool for the shard's parts, and the tally of skipped samples.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["MeteredPool", "ShardContext", "shard_context", "using"]

T = TypeVar("T")
_NOTES_KEPT = 20


@dataclass
class ShardContext:
    """One shard's preprocessing: where it comes from, its parts' pool, what was skipped.

    ``pool`` runs the parts of one batch (images of a batch, slices of text);
    it must not be the pool the shard itself runs on, or a full pool would
    wait on itself.
    """

    source: str = "(data)"
    first_row: int = 0  # the shard row of the current batch's row 0, before skips
    pool: Executor | None = None
    skipped: int = 0
    notes: list[str] = field(default_factory=list)  # the first skipped samples, named

    def where(self, row: int, key: str | None = None) -> str:
        """``'<object>: sample 1234 (key 'n01/img_7')'`` for batch row ``row``."""
        named = f" (key {key!r})" if key else ""
        return f"{self.source}: sample {self.first_row + row}{named}"

    def skip(self, note: str) -> None:
        """Count one dropped sample; keep the first few notes for the operator."""
        self.skipped += 1
        if len(self.notes) < _NOTES_KEPT:
            self.notes.append(note)

    def map(self, fn: Callable[..., T], tasks: Sequence[tuple[Any, ...]]) -> list[T]:
        """``[fn(*task) for task in tasks]``, on the pool's threads when there is one."""
        if self.pool is None or len(tasks) < 2:
            return [fn(*task) for task in tasks]
        return list(self.pool.map(lambda task: fn(*task), tasks))


_current: ContextVar[ShardContext | None] = ContextVar("edgecache_shard_context", default=None)


def shard_context() -> ShardContext:
    """The context of the shard being transformed (a blank one outside the pipeline)."""
    return _current.get() or ShardContext()


@contextlib.contextmanager
def using(context: ShardContext) -> Iterator[ShardContext]:
    """Make ``context`` current for the code inside (one transform call)."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


class MeteredPool(Executor):
    """An executor's view that sums the thread CPU time of the tasks sent through it.

    A node wraps its shared parts pool in one per shard, so a shard's CPU cost
    counts the chunks and images its parts compressed and decoded elsewhere.
    """

    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self.cpu_seconds = 0.0
        self.threads = int(getattr(pool, "_max_workers", 1))

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the pool, counting its thread CPU time."""
        return self._pool.submit(self._run, fn, args, kwargs)

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - started
            with self._lock:
                self.cpu_seconds += spent
