"""EdgeDataset: a PyTorch IterableDataset that streams a pinned dataset version from edge nodes.

.. code-block:: python

    ds = EdgeDataset("tokens-en@3", endpoints=["eu-1:7070", "eu-2:7070"], batch_size=256,
                     columns=["input_ids", "label"], shuffle=True, seed=17)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in loader:  # dict[str, torch.Tensor]
            batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}

Guarantees (see :mod:`edgecache.clients.epoch_order` for how):

* every sample exactly once per epoch across all ranks and workers
  (``drop_last=False``); with ``drop_last=True`` the same number of full
  batches on every rank and no sample twice;
* the same (version, seed, epoch) gives the same order on any machine, for
  any number of DataLoader workers;
* ``state_dict()`` is (version, seed, epoch, batches yielded): resume with
  other workers, other endpoints or in another region and get exactly the
  samples not yet yielded. With ``num_workers > 0`` the main process cannot
  see what workers yielded: pass ``state_dict(batches=steps_this_epoch)``
  (the canonical order makes the step count exact).

Reading runs on background threads of the iterating process; with
``num_workers=0`` (recommended on small hosts) batches land directly in
pinned memory when CUDA is available.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from edgecache.cache.errors import EdgeCacheError, InvalidEndpoint, StateMismatch, VersionNotFound
from edgecache.cache.manifest import manifest_from_bytes, manifest_schema
from edgecache.cache.names import parse_spec
from edgecache.cache.store import CacheStore
from edgecache.clients.endpoints import Endpoint, parse_endpoint
from edgecache.clients.epoch_order import EpochOrder, window_rows_for
from edgecache.clients.node_pool import NodePool
from edgecache.clients.pipeline import Pipeline
from edgecache.clients.read_target import ReadTarget
from edgecache.clients.tensors import ColumnKind, column_kinds
from edgecache.clients.topology import load_topology
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["EdgeDataset"]

log = logging.getLogger(__name__)
_STATE_FORMAT = 1
_said_unpinned = False


def _distributed() -> tuple[int, int] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


def _endpoints_from_config(
    config: str | os.PathLike[str], region: str | None
) -> tuple[list[str], list[str]]:
    """(every node, the region's own nodes) of a topology file.

    The region's nodes come first, then the other regions' in file order; with
    no region, every node in file order. Read with :func:`load_topology`, the
    loader the CLI uses, so a malformed file fails here with the same message
    (file, line, field).
    """
    topology = load_topology(config)
    regions = topology.regions
    if region is None:
        return [node for r in regions.values() for node in r.nodes], []
    if region not in regions:
        raise InvalidEndpoint(
            f"region {region!r} is unknown: {config} has regions {', '.join(sorted(regions))}"
        )
    own = list(regions[region].nodes)
    return own + [node for name, r in regions.items() if name != region for node in r.nodes], own


class EdgeDataset(IterableDataset):  # type: ignore[type-arg]
    """Stream one pinned dataset version from the nearest healthy edge node.

    Args:
        spec: ``name``, ``name@latest`` or ``name@N``; resolved once, here.
        endpoints: ``host:port``, ``grpcs://host:port`` or ``lmdb:///cache/dir`` entries
            (one endpoint may be given as a plain string).
        config / region: read the endpoints from a topology file (edgecache.yaml)
            instead; the region's nodes come first, other regions' after them.
        batch_size: samples per batch; ``None`` yields one sample at a time.
        columns: columns to read (default: all).
        shuffle / seed: deterministic shuffling of shards and of windows of rows.
        rank / world_size: default from torch.distributed when initialised, else 0 / 1.
        drop_last: drop partial batches; every rank then yields the same number.
        pin_memory: ``"auto"`` pins when CUDA is available (in the main process).
        prefetch_bytes: how far ahead (decoded bytes) background threads read.
        threads: fetch/decode threads.
        window_bytes: shuffle window size; memory is about ``lanes × window_bytes``.
        lanes: windows read in parallel; choose ``num_workers`` dividing it.
        token: bearer token for nodes that require one for reads.
        stall_timeout: seconds without a chunk before a stream is abandoned.
        retry_timeout: seconds without progress on any node before giving up.
    """

    def __init__(
        self,
        spec: str,
        *,
        endpoints: str | Sequence[str] | None = None,
        config: str | os.PathLike[str] | None = None,
        region: str | None = None,
        batch_size: int | None = 256,
        columns: Sequence[str] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        pin_memory: bool | str = "auto",
        prefetch_bytes: int = 256 << 20,
        threads: int = 2,
        window_bytes: int = 16 << 20,
        lanes: int = 8,
        token: str | None = None,
        stall_timeout: float = 5.0,
        retry_timeout: float = 30.0,
    ) -> None:
        super().__init__()
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if endpoints is None and config is None:
            raise InvalidEndpoint("pass endpoints=[...] or config='edgecache.yaml' (and region=)")
        replicas: list[str] = []
        if endpoints is not None:
            # One endpoint given as a string is one endpoint, not a list of characters.
            texts = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        else:
            texts, replicas = _endpoints_from_config(config, region)  # type: ignore[arg-type]
        if not texts:
            raise InvalidEndpoint("the endpoint list is empty; give at least one host:port")
        self.endpoints: list[Endpoint] = [parse_endpoint(t) for t in texts]
        dist = _distributed()
        self.rank = rank if rank is not None else (dist[0] if dist else 0)
        self.world_size = world_size if world_size is not None else (dist[1] if dist else 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in 0..world_size-1, got rank={self.rank}, "
                f"world_size={self.world_size}"
            )
        if pin_memory not in (True, False, "auto"):
            raise ValueError(f"pin_memory must be True, False or 'auto', got {pin_memory!r}")
        self.batch_size, self.drop_last = batch_size, drop_last
        self.shuffle, self.seed, self.lanes = shuffle, seed, lanes
        self.pin_memory_setting = pin_memory
        self.prefetch_bytes, self.threads, self.window_bytes = prefetch_bytes, threads, window_bytes
        self._pool_args = {
            "token": token,
            "stall_timeout": stall_timeout,
            "retry_timeout": retry_timeout,
            "replicas": replicas,
        }
        self._open: _Readers | None = None
        self._pid = os.getpid()
        self.epoch = 0
        self._cursor = 0  # canonical batches yielded this epoch (by this process)
        self._samples_epoch = 0
        self._delivered = {"samples": 0, "batches": 0, "wait_seconds": 0.0}
        self.manifest = self._resolve(spec)
        self.schema = manifest_schema(self.manifest)
        self.kinds: list[ColumnKind] = column_kinds(self.schema, columns)
        self.columns = [k.name for k in self.kinds]
        self.window_rows = window_rows_for(self._row_bytes(), window_bytes)

    # ------------------------------------------------------------- versions

    @property
    def version(self) -> str:
        """``name@N`` of the pinned version (also in every error message)."""
        return f"{self.manifest.dataset}@{self.manifest.version}"

    def pool(self) -> NodePool:
        """The node pool of the current process (opened lazily, again after fork).

        It is closed by :meth:`close`, or when the dataset is garbage-collected.
        """
        return self._readers().pool

    def _readers(self) -> _Readers:
        if self._open is None or self._pid != os.getpid():
            self._open = _Readers(NodePool(self.endpoints, **self._pool_args))  # type: ignore[arg-type]
            self._pid = os.getpid()
            # Not a method of self: the dataset must stay collectable.
            self._finalizer = weakref.finalize(self, self._open.close)
        return self._open

    def close(self) -> None:
        """Stop this process's reads, then close its channels, stores and threads.

        Iterators still live end: the next batch asked of one raises ValueError.
        Iterating again opens everything anew.
        """
        if self._open is not None and self._pid == os.getpid():
            self._finalizer()
        self._open = None

    def __enter__(self) -> EdgeDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _resolve(self, spec: str) -> pb.Manifest:
        parsed = parse_spec(spec)
        dist = _distributed()
        if dist is not None:
            box: list[Any] = [None]
            if dist[0] == 0:
                box[0] = self._fetch_manifest(parsed.dataset, parsed.version).SerializeToString()
            torch.distributed.broadcast_object_list(box, src=0)  # every rank: one version
            return manifest_from_bytes(box[0], source=f"manifest of {spec} from rank 0")
        return self._fetch_manifest(parsed.dataset, parsed.version)

    def _fetch_manifest(self, dataset: str, version: int | None) -> pb.Manifest:
        """The manifest of ``dataset@version`` (latest when None), from a node if any.

        A node's refusal arrives as an edgecache error naming it (see
        :meth:`NodePool.call`): VersionNotFound, AccessDenied, InvalidRequest.
        """
        if not any(not e.local for e in self.endpoints):
            return self._local_manifest(dataset, version)
        pool = self.pool()
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

    def _local_manifest(self, dataset: str, version: int | None) -> pb.Manifest:
        for endpoint in self.endpoints:
            store = CacheStore(endpoint.target, readonly=True)
            try:
                numbers = sorted({v.version for v in store.versions() if v.dataset == dataset})
                wanted = version or (numbers[-1] if numbers else None)
                raw = store.get_manifest(dataset, wanted) if wanted else None
            finally:
                store.close()
            if raw is not None:
                if version is None:
                    log.warning(
                        "resolved %s@latest from the local cache only: %s@%s",
                        dataset,
                        dataset,
                        wanted,
                    )
                return manifest_from_bytes(raw, source=f"{endpoint.text} manifest")
        raise VersionNotFound(
            f"{dataset}@{version or 'latest'} is in none of the local caches "
            f"{[e.target for e in self.endpoints]}; stage it first (edgecache warm)"
        )

    def _row_bytes(self) -> float:
        """Decoded bytes per row: exact for fixed-width schemas, estimated otherwise."""
        exact = 0
        for field in self.schema:
            t, width = field.type, 1
            while pa.types.is_fixed_size_list(t):
                width *= t.list_size
                t = t.value_type
            try:
                exact += width * t.bit_width // 8
            except ValueError:
                # Variable width: estimate from the source (columnar sources are often
                # compressed ~2x; raw binary not at all). Only the window size depends on it.
                rows = sum(s.row_count for s in self.manifest.shards) or 1
                return 1.5 * sum(s.source_size for s in self.manifest.shards) / rows
        return float(max(exact, 1))

    # ------------------------------------------------------------ iteration

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (new order); resets the cursor unless resuming it."""
        if epoch != self.epoch:
            self.epoch, self._cursor, self._samples_epoch = epoch, 0, 0

    def epoch_order(self, epoch: int | None = None) -> EpochOrder:
        """Which samples this rank yields in an epoch (default: the current one), in order."""
        return EpochOrder(
            [s.row_count for s in self.manifest.shards],
            window_rows=self.window_rows,
            seed=self.seed,
            epoch=self.epoch if epoch is None else epoch,
            world_size=self.world_size,
            rank=self.rank,
            batch_size=self.batch_size or 1,
            drop_last=self.drop_last,
            lanes=self.lanes,
            shuffle=self.shuffle,
        )

    plan = epoch_order  # the method's earlier name, kept for existing callers

    def __len__(self) -> int:
        """Batches (or samples, with batch_size=None) this rank yields per epoch."""
        return self.epoch_order().batch_count

    def _pin(self, in_worker: bool) -> bool:
        global _said_unpinned
        if self.pin_memory_setting is False or in_worker:
            return False
        available = torch.cuda.is_available()
        if self.pin_memory_setting is True and not available and not _said_unpinned:
            log.info("CUDA is not available: batches are ordinary, unpinned tensors")
            _said_unpinned = True
        if self.pin_memory_setting == "auto" and not available and not _said_unpinned:
            log.info("no CUDA here: EdgeDataset yields ordinary (unpinned) tensors")
            _said_unpinned = True
        return available

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        index, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        order = self.epoch_order()
        numbers = order.batches_for(index, workers, self._cursor)
        readers = self._readers()
        pipeline = Pipeline(
            order,
            numbers,
            readers.pool,
            ReadTarget(
                self.manifest.dataset, self.manifest.version, self.manifest.digest, self.schema
            ),
            self.kinds,
            row_bytes=self._row_bytes(),
            pin_memory=self._pin(worker is not None),
            threads=self.threads,
            prefetch_bytes=self.prefetch_bytes,
        )
        readers.add(pipeline)
        try:
            for size, batch in pipeline:
                self._cursor += workers if worker else 1
                self._samples_epoch += size
                self._delivered["samples"] += size
                self._delivered["batches"] += 1
                if self.batch_size is None:
                    yield {
                        k: v[0] if isinstance(v, (torch.Tensor, list)) else v
                        for k, v in batch.items()
                    }
                else:
                    yield batch
            if worker is None:
                self._cursor, self._samples_epoch = 0, 0  # epoch done: the next pass starts over
        except EdgeCacheError as exc:
            # The same object, re-raised: its class, attributes (a NodeError's endpoint
            # and code) and traceback stay; the version is added as context.
            note = f"while reading {self.version} with EdgeDataset"
            if note not in getattr(exc, "__notes__", ()):
                exc.add_note(note)
            raise
        finally:
            # A break, an abandoned iterator or a DataLoader worker's exit end up here
            # (GeneratorExit): the reads stop and their threads are joined now.
            pipeline.close()
            readers.discard(pipeline)
            self._delivered["wait_seconds"] += pipeline.wait_seconds

    # ---------------------------------------------------------------- state

    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """Where this rank is: version, seed, epoch and a cursor of batches yielded.

        With ``num_workers > 0`` pass ``batches`` (your step count this epoch).
        """
        cursor = self._cursor if batches is None else batches
        return {
            "format": _STATE_FORMAT,
            "dataset": self.manifest.dataset,
            "version": self.manifest.version,
            "digest": self.manifest.digest,
            "seed": self.seed,
            "epoch": self.epoch,
            "batches": cursor,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "rank": self.rank,
            "drop_last": self.drop_last,
            "shuffle": self.shuffle,
            "lanes": self.lanes,
            "window_rows": self.window_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off; refuses a state of another version or layout."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise StateMismatch("not an EdgeDataset state dict (or from an incompatible release)")
        mine = self.state_dict()
        for key in ("dataset", "version", "digest"):
            if state[key] != mine[key]:
                raise StateMismatch(
                    f"the state is for {state['dataset']}@{state['version']} but this dataset "
                    f"reads {self.version}; create "
                    f"EdgeDataset('{state['dataset']}@{state['version']}', …) to resume it"
                )
        for key in (
            "batch_size",
            "world_size",
            "rank",
            "drop_last",
            "shuffle",
            "lanes",
            "window_rows",
        ):
            if state[key] != mine[key]:
                raise StateMismatch(
                    f"{self.version}: the state was saved with {key}={state[key]!r}, this "
                    f"dataset has {mine[key]!r}; use the same value to resume exactly"
                )
        self.seed, self.epoch, self._cursor = state["seed"], state["epoch"], state["batches"]
        self._samples_epoch = 0

    # ---------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        """What this process delivered and saw (workers keep their own)."""
        pool = self._open.pool if self._open is not None else None
        endpoints = (
            {
                text: {
                    "rtt_ms": s.rtt_ms,
                    "bytes": s.bytes,
                    "failures": s.failures,
                    "last_error": s.last_error,
                }
                for text, s in pool.stats.items()
            }
            if pool
            else {}
        )
        return {
            "version": self.version,
            **self._delivered,
            "bytes": sum(e["bytes"] for e in endpoints.values()),
            "failovers": pool.failovers if pool else 0,
            "endpoints": endpoints,
        }

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = None  # channels and LMDB environments never cross processes
        state.pop("_finalizer", None)
        return state


class _Readers:
    """One process's node pool and the pipelines reading through it.

    Closing it stops and joins the pipelines before the pool closes, whoever
    closes it: :meth:`EdgeDataset.close`, or the dataset's finalizer when it is
    garbage-collected (in a reference cycle the finalizer runs before the
    iterators are closed, so it must not assume they were).
    """

    def __init__(self, pool: NodePool) -> None:
        self.pool = pool
        self._pipelines: set[Pipeline] = set()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def add(self, pipeline: Pipeline) -> None:
        with self._lock:
            self._pipelines.add(pipeline)

    def discard(self, pipeline: Pipeline) -> None:
        with self._lock:
            self._pipelines.discard(pipeline)

    def close(self) -> None:
        if os.getpid() != self._pid:
            # A forked DataLoader worker inherits this (and the finalizer that calls it):
            # the parent's threads do not exist here, and a lock one of them held at the
            # fork would never be released. The worker's own readers are another object.
            return
        with self._lock:
            pipelines, self._pipelines = list(self._pipelines), set()
        for pipeline in pipelines:
            pipeline.close()
        self.pool.close()
