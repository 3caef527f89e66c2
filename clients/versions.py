"""The versions an EdgeDataset reads: manifests resolved once, and their columns.

``name`` or ``name@latest`` is resolved once, when the dataset is created
(under torch.distributed, by rank 0 for every rank); from then on the
dataset reads that version only, in every region. A mixture resolves each
component the same way. The gRPC pool or LMDB environment used to resolve
is closed again at once, so DataLoader workers forked later open their own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from edgecache.cache.errors import ManifestError, VersionNotFound
from edgecache.cache.manifest import manifest_from_bytes
from edgecache.clients import local_stores
from edgecache.clients.endpoints import Endpoint
from edgecache.clients.mixture import common_columns
from edgecache.clients.node_pool import NodePool
from edgecache.clients.tensors import ColumnKind, column_kinds
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["fetch_manifest", "local_manifest", "select_columns"]

log = logging.getLogger(__name__)


def fetch_manifest(pool: NodePool, dataset: str, version: int | None) -> pb.Manifest:
    """The manifest of ``dataset@version`` (latest when None) from the pool's nodes.

    A node's refusal arrives as an edgecache error naming it (see
    :meth:`NodePool.call`): VersionNotFound, AccessDenied, InvalidRequest.
    """
    if version is None:
        resolved: Any = pool.call(
            "ResolveVersion",
            edge_pb2.ResolveVersionRequest(dataset=dataset),
            what=f"{dataset}@latest",
        )
        version = int(resolved.version)
    return pool.call(  # type: ignore[return-value]
        "GetManifest",
        edge_pb2.GetManifestRequest(dataset=dataset, version=version),
        what=f"{dataset}@{version}",
    )


def local_manifest(endpoints: Sequence[Endpoint], dataset: str, version: int | None) -> pb.Manifest:
    """The manifest from the first local cache (``lmdb://``) that keeps the version's.

    ``version`` None (``@latest``): the newest version any of the caches keeps.

    Each store is given back before returning (and closed if no reader of this
    process holds it): an LMDB environment must not be open in a process that
    forks DataLoader workers which open it again.
    """
    damaged: list[str] = []
    # @latest: the newest version any of the caches keeps a manifest of, evicted ones too:
    # as a node would, it resolves to what is newest (the first cache's newest could be
    # older than another's), and reading it then says the data must be staged again
    # (ShardNotCached), never "unknown".
    wanted = version or max((_newest(e, dataset) for e in endpoints), default=0) or None
    for endpoint in endpoints:
        store = local_stores.acquire(endpoint.target)
        try:
            raw = store.get_manifest(dataset, wanted) if wanted else None
        finally:
            local_stores.release(store)
        if raw is None:
            continue
        try:
            manifest = manifest_from_bytes(raw, source=f"{endpoint.text} manifest")
        except ManifestError:  # this cache's copy only: another may keep it whole
            damaged.append(local_stores.damaged_manifest(f"{dataset}@{wanted}", endpoint.target))
            log.warning("%s", damaged[-1])
            continue
        if version is None:
            log.warning(
                "resolved %s@latest from the local cache only: %s@%s", dataset, dataset, wanted
            )
        return manifest
    if damaged:
        raise ManifestError("; ".join(damaged))
    raise VersionNotFound(
        f"{dataset}@{version or 'latest'} is in none of the local caches "
        f"{[e.target for e in endpoints]}; stage it first (edgecache warm)"
    )


def _newest(endpoint: Endpoint, dataset: str) -> int:
    """The newest version of ``dataset`` a local cache keeps a manifest of (0: none)."""
    store = local_stores.acquire(endpoint.target)
    try:
        numbers = store.manifest_versions(dataset)
    finally:
        local_stores.release(store)
    return numbers[-1] if numbers else 0


def select_columns(
    schemas: Sequence[pa.Schema], names: Sequence[str], columns: Sequence[str] | None
) -> list[ColumnKind]:
    """The columns to yield; for a mixture every component must have them, with one type.

    Default: all columns of a single version; those the components share for a mixture.
    """
    if len(schemas) == 1:
        return column_kinds(schemas[0], columns)
    wanted = list(columns) if columns is not None else common_columns(schemas, names)
    for name, schema in zip(names, schemas, strict=True):
        missing = [c for c in wanted if c not in schema.names]
        if missing:
            raise KeyError(f"columns {missing} are not in {name}; it has {schema.names}")
    for column in wanted:
        types = [f"{n}: {s.field(column).type}" for n, s in zip(names, schemas, strict=True)]
        if len({str(s.field(column).type) for s in schemas}) > 1:
            raise ValueError(
                f"column {column!r} has different types in the components ({', '.join(types)}); "
                "leave it out of columns="
            )
    return column_kinds(schemas[0], wanted)
