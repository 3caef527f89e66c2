"""Read-only LMDB caches (``lmdb://`` endpoints), opened once per process and shared.

py-lmdb refuses to open an environment twice in one process (closing one
would drop the other's locks), so every reader of this process — each
EdgeDataset's node pool, a manifest lookup — takes the same
:class:`~edgecache.cache.store.CacheStore` from here and gives it back; the
last one to give it back closes it. Keeping it open between epochs spares a
fresh mapping of the whole cache, faulted in again page by page, per epoch.

An environment must not cross ``fork()``: a DataLoader forking workers while
one is open would hand its children an environment whose close (a garbage
collection would do) clears the parent's reader slots. EdgeDataset closes
idle stores before a fork (``os.register_at_fork``); a store still in use at
a fork is kept referenced, never closed, in the child.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from edgecache.cache.store import CacheStore

__all__ = ["acquire", "release"]

_OPEN: dict[str, list[object]] = {}  # path → [store, users]
_INHERITED: list[CacheStore] = []  # a parent's stores in a forked child: never closed
_LOCK = threading.Lock()


def acquire(path: str | os.PathLike[str]) -> CacheStore:
    """The process's read-only store of ``path`` (opened now if no one holds it)."""
    key = str(Path(path).resolve())
    with _LOCK:
        entry = _OPEN.get(key)
        if entry is None:
            entry = _OPEN[key] = [CacheStore(key, readonly=True), 0]
        entry[1] = int(entry[1]) + 1  # type: ignore[call-overload]
        return entry[0]  # type: ignore[return-value]


def release(store: CacheStore) -> None:
    """Give ``store`` back; the last user's release closes it."""
    with _LOCK:
        for key, entry in list(_OPEN.items()):
            if entry[0] is store:
                entry[1] = int(entry[1]) - 1  # type: ignore[call-overload]
                if entry[1] > 0:  # type: ignore[operator]
                    return
                del _OPEN[key]
                break
        else:
            return  # not ours (inherited from a parent, or released twice)
    store.close()


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # a thread of the parent may have held it at the fork
    _INHERITED.extend(entry[0] for entry in _OPEN.values())  # type: ignore[misc]
    _OPEN.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
