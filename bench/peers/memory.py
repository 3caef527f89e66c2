"""Peak memory of a process tree, sampled on a background thread.

``resource.getrusage`` cannot give this: ``ru_maxrss`` of RUSAGE_CHILDREN is
the largest single child, not the sum of a loader process and its
DataLoader workers alive at the same time. So a thread reads
``/proc/<pid>/statm`` of the process and of every descendant that appeared
after sampling started, every ``interval`` seconds, and keeps the peaks of
two sums:

* RSS: resident pages, including file-backed pages of mapped data files (an
  LMDB map or an mmap'd shard counts the page-cache pages it touched, which
  the kernel can drop at any time);
* anonymous (RSS minus file-backed and shared memory): what the loaders
  allocated, buffers, decoded samples, batches, interpreter heaps; the figure
  to compare loaders by.

Both count a page shared by a forked DataLoader worker with its parent once
per process, so with workers they over-state by up to the parent's heap per
worker (alike for every system). PSS would divide shared pages, but reading
it (``smaps_rollup``) walks every mapping: ~15 ms per read for a process with
1 GB mapped, under the mm lock the reader's own page faults need, which
perturbs the epoch being measured. ``statm`` costs microseconds.

Sampling every 50 ms can miss a spike shorter than that; the figures are a
floor on the true peak, equally for every system.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

__all__ = ["TreeMemory"]

MB = 1e6
PAGE = os.sysconf("SC_PAGE_SIZE")


def _statm(pid: int) -> tuple[int, int]:
    """(resident, shared) bytes of ``pid``; (0, 0) once it has exited."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            fields = f.read().split()
        return int(fields[1]) * PAGE, int(fields[2]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0, 0


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from every one of its threads."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    found, stack = [], _children(pid)
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(_children(child))
    return found


class TreeMemory:
    """Context manager: peak RSS and anonymous memory of ``pid`` and its new descendants."""

    def __init__(self, pid: int | None = None, *, interval: float = 0.05) -> None:
        self.pid = pid if pid is not None else os.getpid()
        self.interval = interval
        self.peak_rss = self.peak_anon = self.start_rss = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._old: set[int] = set()

    def sample(self) -> None:
        """One reading of the tree, folded into the peaks."""
        rss = anon = 0
        for pid in (self.pid, *(c for c in descendants(self.pid) if c not in self._old)):
            resident, shared = _statm(pid)
            rss += resident
            anon += resident - shared
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_anon = max(self.peak_anon, anon)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeMemory:
        self._old = set(descendants(self.pid))
        self.start_rss = _statm(self.pid)[0]
        self.sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def figures(self) -> dict[str, float]:
        """Peaks and the starting RSS, in MB (10^6 bytes)."""
        return {
            "peak_rss_mb": round(self.peak_rss / MB, 1),
            "peak_anon_mb": round(self.peak_anon / MB, 1),
            "start_rss_mb": round(self.start_rss / MB, 1),
            "memory_samples": self.samples,
        }
