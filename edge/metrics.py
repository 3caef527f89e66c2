"""Prometheus metrics of one edge node: the one place its counts are kept.

Each node owns a ``CollectorRegistry`` (not the process-global one), so
several nodes in one process (tests, the demo) keep separate figures. Names
follow Prometheus conventions: ``_total`` counters, base units in the name.
The node's ``Status`` reply reads its hits, misses and traffic back from here
(:meth:`NodeMetrics.value`), so ``/metrics`` and ``Status`` cannot disagree.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

__all__ = ["NodeMetrics"]


class NodeMetrics:
    """Counters, gauges and histograms an edge node updates as it works."""

    def __init__(self, region: str, node_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The standard process_* series (resident memory, CPU seconds, open files), which a
        # private registry does not get by itself: the node's memory bounds are watched
        # with process_resident_memory_bytes.
        ProcessCollector(registry=self.registry)
        self._http: Any = None
        labels = {"region": region, "node": node_id}
        self._labels = labels

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.bytes_served = counter(
            "edgecache_served_bytes_total", "Chunk bytes sent to readers"
        ).labels(**labels)
        self.chunks_served = counter(
            "edgecache_served_chunks_total", "Chunks sent to readers"
        ).labels(**labels)
        self.hits = counter(
            "edgecache_cache_hits_total", "ReadShard requests served from the cache"
        ).labels(**labels)
        self.misses = counter(
            "edgecache_cache_misses_total", "ReadShard requests that went to origin"
        ).labels(**labels)
        self.uncached_reads = counter(
            "edgecache_uncached_reads_total",
            "Read-through misses served without caching them (pins fill the cache, or the shard "
            "is larger than it): each read of such a shard goes to origin again",
        ).labels(**labels)
        self.staging_taken_over = counter(
            "edgecache_staging_taken_over_total",
            "Staging fetches a training read came to wait for, which then went ahead as its "
            "miss (the read came before the warm had staged the shard)",
        ).labels(**labels)
        self.origin_bytes = counter(
            "edgecache_origin_bytes_total", "Bytes fetched from origin"
        ).labels(**labels)
        self.origin_fetches = counter(
            "edgecache_origin_fetches_total",
            "Raw shards fetched from origin (read-through misses, staging, re-fetches)",
        ).labels(**labels)
        self.corrupt_chunks = counter(
            "edgecache_corrupt_chunks_total",
            "Damaged chunks found in the cache: the shard was dropped and fetched again",
        ).labels(**labels)
        self.origin_retries = counter(
            "edgecache_origin_retries_total",
            "Origin requests retried (shard data and a transform's files; not the registry)",
        ).labels(**labels)
        self.registry_retries = counter(
            "edgecache_registry_retries_total",
            "Registry requests retried (manifests and version lists)",
        ).labels(**labels)
        refused_calls = counter(
            "edgecache_refused_calls_total",
            "Calls refused RESOURCE_EXHAUSTED at a limit on calls running at once: max_streams, "
            "open_streams (the token-free health Watch and reflection streams' share of it) or "
            "manifest_calls (ResolveVersion and GetManifest, a pool of max_streams of their own)",
            ("limit",),
        )
        self.refused_calls = {
            limit: refused_calls.labels(**labels, limit=limit)
            for limit in ("max_streams", "open_streams", "manifest_calls")
        }
        self._staged = counter(
            "edgecache_staged_shards_total", "Shards handled by staging, by result", ("result",)
        )
        self.staged = {
            result: self._staged.labels(**labels, result=result)
            for result in ("staged", "skipped", "failed")
        }
        staged_bytes = counter(
            "edgecache_staged_bytes_total",
            "Bytes staging brought in, by source: origin (source bytes, also counted in "
            "edgecache_origin_bytes_total) or peer (stored chunk bytes copied from a peer node)",
            ("source",),
        )
        self.staged_bytes = {
            source: staged_bytes.labels(**labels, source=source) for source in ("origin", "peer")
        }
        self.origin_seconds = Histogram(
            "edgecache_origin_fetch_seconds",
            "Time to fetch one raw shard from origin",
            list(labels),
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        ).labels(**labels)
        self.preprocess_seconds = Histogram(
            "edgecache_preprocess_seconds",
            "Time to parse, transform and encode one shard",
            list(labels),
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        ).labels(**labels)
        self.preprocess_cpu_seconds = counter(
            "edgecache_preprocess_cpu_seconds_total",
            "Thread CPU seconds spent parsing, transforming and compressing shards from origin",
        ).labels(**labels)
        self.preprocessed_bytes = counter(
            "edgecache_preprocessed_source_bytes_total",
            "Source bytes of the shards preprocessed (read-through misses and staging)",
        ).labels(**labels)
        self.skipped_samples = counter(
            "edgecache_preprocess_skipped_samples_total",
            "Samples a transform dropped under its skip policy (e.g. corrupt images)",
        ).labels(**labels)
        self.staging_capacity = gauge(
            "edgecache_staging_capacity_bytes_per_second",
            "Source bytes/s this node can preprocess on all its preprocessing threads, "
            "from the CPU time of its recent shards",
        )
        # Latency as readers and operators feel it, by result (ok, not_cached, or the
        # status code).
        self._first_chunk = Histogram(
            "edgecache_read_first_chunk_seconds",
            "ReadShard: time from the request to its first chunk (a miss includes the fetch)",
            [*labels, "result"],
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self._reads = Counter(
            "edgecache_reads_total",
            "ReadShard calls by how they ended: ok, not_cached (a cached_only read of a "
            "shard not held here), stale_digest (the reader's digest of the version is not "
            "this node's: the reader resolves it again), or the status code they ended with, "
            "errors after the first chunk included (a mid-stream refetch that failed, a chunk "
            "damaged again)",
            [*labels, "result"],
            registry=self.registry,
        )
        self._per_chunk = Histogram(
            "edgecache_read_chunk_seconds",
            "ReadShard: time between consecutive chunks of a stream (includes the reader's pace)",
            list(labels),
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
        ).labels(**labels)
        self._stage = Histogram(
            "edgecache_stage_seconds",
            "Stage: time for a whole request, by result (ok, or the status code)",
            [*labels, "result"],
            registry=self.registry,
            buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400),
        )
        for metric in (self._first_chunk, self._stage, self._reads):  # exported from the start
            metric.labels(**labels, result="ok")
        self.evicted_shards = counter(
            "edgecache_cache_evicted_shards_total",
            "Shards the cache evicted for space (least recently used, unpinned)",
        ).labels(**labels)
        self.evicted_bytes = counter(
            "edgecache_cache_evicted_bytes_total",
            "Bytes of the shards the cache evicted for space",
        ).labels(**labels)
        self.used_bytes = gauge("edgecache_cache_used_bytes", "Bytes of chunks in the cache")
        self.capacity_bytes = gauge("edgecache_cache_capacity_bytes", "Cache capacity in bytes")
        self.fetch_memory_bytes = gauge(
            "edgecache_fetch_memory_bytes",
            "Memory the node's shard fetches may hold at once (fetch_memory)",
        )
        self.fetch_memory_reserved_bytes = gauge(
            "edgecache_fetch_memory_reserved_bytes",
            "Memory reserved by the shard fetches running now (estimates from source sizes)",
        )
        self.pinned_bytes = gauge(
            "edgecache_cache_pinned_bytes",
            "Bytes of chunks of versions pinned now: what eviction cannot free for new versions",
        )
        self.disk_full = gauge(
            "edgecache_cache_disk_full",
            "1 while the cache's disk is full (its last write found no room on the volume, "
            "and it has no more free space since, nor an eviction freed pages), else 0",
        )
        self.cache_damaged = gauge(
            "edgecache_cache_damaged",
            "1 once LMDB's own pages were found damaged (the node serves NOT_SERVING until "
            "restarted on a new cache directory), else 0",
        )
        self.disk_full_errors = counter(
            "edgecache_cache_disk_full_errors_total",
            "Cache writes (shards, manifests, pins) refused because the disk was full",
        ).labels(**labels)
        self.active_streams = gauge("edgecache_active_streams", "ReadShard streams in flight")
        self.staging_active = gauge("edgecache_staging_active", "Stage requests in flight")

    def first_chunk(self, seconds: float, result: str) -> None:
        """A ReadShard's first chunk took ``seconds`` (``result``: ok, not_cached or a status code).

        ``not_cached``: a cached_only read of a shard this node does not hold (a peer
        copy asking the shard's owner first), kept apart from the failures alerts count.
        """
        self._first_chunk.labels(**self._labels, result=result).observe(seconds)

    def read_ended(self, result: str, *, before_first_chunk: float | None = None) -> None:
        """A ReadShard ended (``result`` as for :meth:`first_chunk`), once per call.

        ``before_first_chunk``: the seconds it ran, when it ended without a chunk
        (a refusal, an error, a reader that left), recorded as its first chunk's.
        """
        if before_first_chunk is not None:
            self.first_chunk(before_first_chunk, result)
        self._reads.labels(**self._labels, result=result).inc()

    def next_chunk(self, seconds: float) -> None:
        """The gap before a stream's next chunk."""
        self._per_chunk.observe(seconds)

    def stage_done(self, seconds: float, result: str) -> None:
        """A Stage request ended after ``seconds`` with ``result``."""
        self._stage.labels(**self._labels, result=result).observe(seconds)

    def value(self, name: str, **labels: str) -> float:
        """The current value of one of this node's samples (0 before it has one).

        ``name`` is the sample's name as ``/metrics`` shows it (a histogram's
        ``_sum`` or ``_count`` too); ``labels`` beyond region and node, such as
        ``result="staged"``.
        """
        found = self.registry.get_sample_value(name, {**self._labels, **labels})
        return 0.0 if found is None else found

    def serve(self, host: str, port: int) -> int:
        """Expose ``/metrics`` over HTTP; returns the bound port (``port=0`` picks one)."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_address[1])

    def shutdown(self) -> None:
        """Stop the ``/metrics`` HTTP server, if one was started."""
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()
            self._http = None
