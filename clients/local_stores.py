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
a fork (a loop at ``num_workers=0`` reading it while another DataLoader starts
its workers, e.g. an evaluation mid-epoch) is kept referenced, never closed or
used, in the child, which opens the cache afresh (:func:`_open_beside_inherited`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from edgecache.cache.errors import CacheDirError, ShardNotCached
from edgecache.cache.store import CacheStore
from edgecache.clients.endpoints import Endpoint
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["acquire", "check", "damaged_manifest", "release", "restage_advice"]

log = logging.getLogger(__name__)

_OPEN: dict[str, list[object]] = {}  # path → [store, users]
_INHERITED: dict[str, list[CacheStore]] = {}  # a parent's stores in a forked child: never closed
# Reentrant: a garbage collection may run a dataset's finalizer inside acquire() (opening a
# store allocates), and that finalizer gives its own stores back here, in the same thread.
# With a plain lock the thread waited for itself, and every reader of the process behind
# it (CI, stop 46: a read hung to pytest's 7-minute timeout).
_LOCK = threading.RLock()


def acquire(path: str | os.PathLike[str]) -> CacheStore:
    """The process's read-only store of ``path`` (opened now if no one holds it)."""
    key = str(Path(path).resolve())
    with _LOCK:
        entry = _OPEN.get(key)
        if entry is None:
            store = _open_beside_inherited(key) if key in _INHERITED else None
            entry = _OPEN[key] = [store or CacheStore(key, readonly=True), 0]
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


EVICTED_OR_NOT_STAGED = (
    "its node evicted the version (edgecache evict, or for space) or has not staged it yet"
)


def restage_advice(name: str, endpoint: str) -> str:
    """What to do about a version (``name@N``) a cache read directly lacks.

    Nothing fetches into a cache read directly: only its node (a stage, a read
    through it) puts shards back, or the reads go through the node instead.
    """
    return (
        f"Stage it on that node again (edgecache warm {name} --region <its region>; "
        f"{REPLICAS}), "
        f"or list the node's gRPC endpoint (or its region's) after {endpoint} so reads "
        "continue through it"
    )


# Why staging again does not help a cache of one replica: the advice above sent a user of
# a two-replica region round the same warm, the cache still lacking the other's shards.
REPLICAS = (
    "in a region of several replicas each stages only the shards it owns, so one "
    "replica's cache never holds the others' shards: list every replica's cache "
    "directory (where they are on this host), or read through the gRPC endpoints"
)


def damaged_manifest(name: str, path: str) -> str:
    """Why a local cache's copy of a version's manifest is passed over, and what to do.

    The registry's copy is intact (a reader checks the cache's against its own
    digest), so publishing again is not the fix: that would make a new version.
    """
    return (
        f"the manifest of {name} kept in the cache at {path} is damaged (it does not "
        "parse, or its digest does not match its content), so that cache is not read "
        f"for {name}. Its node takes the registry's intact copy when it stages the "
        f"version again: edgecache evict {name} --region <its region>, then edgecache "
        f"warm {name} --region <its region>"
    )


def check(endpoints: Sequence[Endpoint], manifests: Sequence[pb.Manifest]) -> None:
    """Check the ``lmdb://`` endpoints once, when a dataset is built.

    A path that is not a cache this edgecache reads raises
    :class:`~edgecache.cache.errors.CacheDirError` naming it, also next to gRPC
    endpoints: a node creates its cache when it starts, so a missing one is a
    typo or a node not run on this host, and would otherwise cost every read a
    failed attempt and a warning. With ``lmdb://`` endpoints alone, a version
    none of them holds a shard of (evicted, its manifest left behind, or never
    staged) raises :class:`~edgecache.cache.errors.ShardNotCached`; so does one
    they hold only in part (:func:`require_shards`, once the shards read are
    known), without a warning first. Beside gRPC endpoints, a cache holding part
    of a version is read with a warning, the other shards through the nodes.
    """
    local = [e for e in endpoints if e.local]
    held: dict[tuple[str, int], dict[str, int]] = {}  # version → {endpoint: shards there}
    paths: dict[str, Path] = {}
    for endpoint in local:
        try:
            store = acquire(endpoint.target)
        except CacheDirError as exc:
            if len(local) == len(endpoints):
                raise
            raise CacheDirError(
                f"{endpoint.text}: {exc}. Fix the path, or leave the lmdb:// endpoint out "
                "and read through the gRPC endpoints"
            ) from exc
        try:
            paths[endpoint.text] = store.path
            for info in store.versions():
                held.setdefault((info.dataset, info.version), {})[endpoint.text] = info.shard_count
        finally:
            release(store)
    alone = bool(local) and len(local) == len(endpoints)
    # Every version none of the caches holds a shard of, at once (a mixture's second was
    # said only once the first was staged again and the dataset built again).
    empty = [
        f"{m.dataset}@{m.version}"
        for m in manifests
        if alone and not any(held.get((m.dataset, m.version), {}).values())
    ]
    if empty:
        where = ", ".join(str(paths[e.text]) for e in local)
        # "none of A, B holds no shard" said the opposite of what it meant (a helper's hunt).
        state = f"the cache at {where} holds" if len(local) == 1 else f"{where} each hold"
        advice = " ".join(restage_advice(name, local[-1].text) for name in empty[:1])
        if len(empty) > 1:
            advice += "; the same for " + ", ".join(empty[1:])
        raise ShardNotCached(
            f"{state} no shard of {', '.join(empty)}, only "
            f"{'its manifest' if len(empty) == 1 else 'their manifests'}: "
            f"{EVICTED_OR_NOT_STAGED}. {advice}"
        )
    for manifest in manifests:
        name = f"{manifest.dataset}@{manifest.version}"
        counts = held.get((manifest.dataset, manifest.version), {})
        total = len(manifest.shards)
        if alone:
            # Nothing reads the missing shards: require_shards refuses the version
            # (or reads a split the caches hold), so "read elsewhere" would be false.
            continue
        for endpoint in local:
            count = counts.get(endpoint.text, 0)
            if count < total:
                log.warning(
                    "the cache at %s holds %d of the %d shards of %s: the others are read "
                    "from the other endpoints",
                    paths[endpoint.text],
                    count,
                    total,
                    name,
                )


def require_shards(
    endpoints: Sequence[Endpoint], manifests: Sequence[pb.Manifest], needed: Sequence[set[int]]
) -> None:
    """With ``lmdb://`` endpoints alone, refuse a version whose shards read are not all there.

    ``needed[i]``: the shards of ``manifests[i]`` the dataset reads (a ``rows=``
    split reads fewer). Nothing fetches into a cache read directly, so a shard
    none of the caches holds ended the epoch when its turn came (AllNodesFailed,
    minutes in): :class:`~edgecache.cache.errors.ShardNotCached` now, when the
    dataset is built, with how many are missing and what to do. Beside a gRPC
    endpoint nothing is checked: the nodes read what the caches lack.
    """
    local = [e for e in endpoints if e.local]
    if not local or len(local) != len(endpoints):
        return
    found: list[set[int]] = [set() for _ in manifests]
    paths = []
    for endpoint in local:
        store = acquire(endpoint.target)
        try:
            paths.append(str(store.path))
            for have, m in zip(found, manifests, strict=True):
                have.update(s.key.shard for s in store.shards(m.dataset, m.version))
        finally:
            release(store)
    where = ", ".join(paths)
    state = f"the cache at {where} holds" if len(paths) == 1 else f"{where} hold"
    # Every version that lacks shards, at once: a mixture's second incomplete component
    # was said only once the first was staged and the dataset built again.
    short = [
        (f"{m.dataset}@{m.version}", len(shards - have), len(shards))
        for have, m, shards in zip(found, manifests, needed, strict=True)
        if shards - have
    ]
    if short:
        counts = "; ".join(
            f"{total - lacking} of the {total} shards of {name} this dataset reads "
            f"(the other {lacking} are in none of them)"
            for name, lacking, total in short
        )
        them = "it" if len(short) == 1 else "them"
        warm = "; ".join(f"edgecache warm {name} --region <its region>" for name, _, _ in short)
        raise ShardNotCached(
            f"{state} {counts}, and nothing fetches into a cache read directly (a read of "
            f"one would end the epoch). Stage {them} there and let {them} finish ({warm}; "
            f"{REPLICAS}), "
            f"or list the node's gRPC endpoint (or its region's) after {local[-1].text} so "
            "reads fetch them through it"
        )


def _open_beside_inherited(key: str) -> CacheStore:
    """A fresh read-only store of ``key`` in a forked child whose parent had it open.

    py-lmdb refuses to open an environment that is open in the process
    (``lmdb._envid.env_keys`` names its files), because two environments of one
    file share the process's fcntl locks and closing one would drop the
    other's. The parent's environment, copied into this child by ``fork``,
    holds no locks here (fcntl locks are not inherited) and is never used or
    closed (closing it would release the parent's reader slots), so the
    fresh one is the only environment of that file this process uses: the
    guard is lifted for this one open, by giving it no file identities. A
    py-lmdb without that hook keeps refusing, and the read fails naming the
    way out.
    """
    import lmdb._envid as envid  # noqa: PLC0415 - only a forked child needs it

    original = getattr(envid, "env_keys", None)
    if original is None:
        return CacheStore(key, readonly=True)
    envid.env_keys = lambda path, subdir: ()  # type: ignore[assignment]
    try:
        return CacheStore(key, readonly=True)
    except CacheDirError as exc:
        raise CacheDirError(
            f"{exc}. This DataLoader worker was forked while its parent was reading the "
            "same lmdb:// cache (a loop at num_workers=0 in progress): give this "
            "DataLoader multiprocessing_context='forkserver' (or 'spawn'), or read "
            "through the node's gRPC endpoint"
        ) from exc
    finally:
        envid.env_keys = original


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.RLock()  # a thread of the parent may have held it at the fork
    for key, entry in _OPEN.items():
        _INHERITED.setdefault(key, []).append(entry[0])  # type: ignore[arg-type]
    _OPEN.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
