"""What a training process read, as Prometheus metrics, answering: did the GPU wait for data.

EdgeDataset counts, per rank (label ``rank``) and pinned version (``dataset``):

* ``edgecache_client_data_wait_seconds_total`` — time the training loop
  waited for a batch. Its rate is the fraction of wall time spent waiting
  (the data-stall alert watches it). With ``num_workers=0`` the dataset
  measures it itself; with workers the main process cannot see the loop
  wait unless the loader is wrapped: ``for batch in ds.watch(loader)``.
  Until something measured it, the series is left out (unknown, not 0 s).
* ``edgecache_client_samples_total``, ``edgecache_client_batches_total`` —
  delivered to the training loop.
* ``edgecache_client_read_bytes_total{endpoint}`` — chunk bytes read from
  each node or local cache.
* ``edgecache_client_failovers_total`` — reads continued on another node.
* ``edgecache_client_endpoint_in_use{endpoint}`` — 1 for the endpoint that
  served the last chunk, 0 for the others.

DataLoader workers read in processes of their own; what they read rides to
the main process with each batch (in the shared ring's handle,
:mod:`edgecache.clients.batch_memory`) and is counted there, so one scrape of
the training process covers all its workers. Metrics are served when asked:
``EdgeDataset(metrics_port=...)`` or ``$EDGECACHE_CLIENT_METRICS_PORT`` (a base
port: each process adds its ``$LOCAL_RANK``, as torchrun sets it).
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from edgecache.clients import batch_memory

__all__ = ["ClientCounters", "PoolTally", "REGISTRY", "serve"]

PORT_VARIABLE = "EDGECACHE_CLIENT_METRICS_PORT"


class _Counts:
    """What was delivered to the training loop and read, as running totals."""

    def __init__(self, endpoints: Iterable[str] = ()) -> None:
        self.wait_seconds = 0.0
        # Whether anything measured the wait: with DataLoader workers and no watch() nothing
        # can, and a series of 0 s would tell the stall alert the GPU never waits.
        self.wait_measured = False
        self.samples = self.batches = self.failovers = 0
        self.bytes: dict[str, int] = dict.fromkeys(endpoints, 0)
        self.endpoint: str | None = None
        self.lock = threading.Lock()

    def add(self, delta: dict[str, Any]) -> None:
        """Fold in what was delivered or read since the last delta (see :class:`PoolTally`)."""
        with self.lock:
            if "wait" in delta:
                self.wait_seconds += delta["wait"]
                self.wait_measured = True
            self.samples += delta.get("samples", 0)
            self.batches += delta.get("batches", 0)
            self.failovers += delta.get("failovers", 0)
            for endpoint, count in delta.get("bytes", {}).items():
                self.bytes[endpoint] = self.bytes.get(endpoint, 0) + count
            if delta.get("endpoint"):
                self.endpoint = delta["endpoint"]


# Per (rank, dataset) label set, for the life of the process: Prometheus counters must
# never go down, and summing live datasets only made every ``_total`` drop when one was
# garbage-collected (read as a counter reset: rate() and the data-wait alert spike).
_TOTALS: dict[tuple[str, str], _Counts] = {}
_TOTALS_LOCK = threading.Lock()


class ClientCounters(_Counts):
    """One EdgeDataset's totals in this process (its workers' included, as batches arrive).

    Each delta also goes to the totals of its label set (rank, pinned version),
    which outlive the dataset: metrics are served from those, so a dataset
    dropped after an evaluation leaves what it read counted.
    """

    def __init__(self, rank: int, dataset: str, endpoints: list[str]) -> None:
        super().__init__(endpoints)
        self.rank, self.dataset = rank, dataset
        with _TOTALS_LOCK:
            self._totals = _TOTALS.setdefault((str(rank), dataset), _Counts())
        with self._totals.lock:
            for endpoint in endpoints:
                self._totals.bytes.setdefault(endpoint, 0)

    def add(self, delta: dict[str, Any]) -> None:
        """Fold ``delta`` into this dataset's counts and its label set's totals."""
        super().add(delta)
        self._totals.add(delta)


class PoolTally:
    """What a node pool read since the last call of :meth:`delta` (its stats are running totals)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._failovers = 0
        self._pool: object = None

    def delta(self, pool: Any) -> dict[str, Any]:
        """Bytes per endpoint, failovers and the endpoint in use, new since the last call."""
        if pool is not self._pool:  # a new pool (after close, or in a new process)
            self._pool, self._seen, self._failovers = pool, {}, 0
        out: dict[str, Any] = {"bytes": {}}
        for endpoint, stats in pool.stats.items():
            new = stats.bytes - self._seen.get(endpoint, 0)
            if new:
                out["bytes"][endpoint] = new
                self._seen[endpoint] = stats.bytes
        out["failovers"] = pool.failovers - self._failovers
        self._failovers = pool.failovers
        out["endpoint"] = pool.current
        return out


_KEYS = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[int, ClientCounters] = weakref.WeakValueDictionary()


def register(counters: ClientCounters) -> int:
    """A key under which workers' deltas reach ``counters`` (same in forked workers)."""
    key = next(_KEYS) + (os.getpid() << 20)
    _LIVE[key] = counters
    return key


def arrived(extra: tuple[Any, ...]) -> None:
    """A batch from a DataLoader worker arrived in this process: count what it carries."""
    key, delta = extra
    counters = _LIVE.get(key)
    if counters is not None:
        counters.add(delta)


batch_memory.on_arrival(arrived)


class Carried(dict):  # type: ignore[type-arg]
    """A worker's batch with the counts it carries to the main process, as a plain dict there.

    Counts ride on a batch's shared tensor (:func:`batch_memory.attach`); a batch
    without one (shared batches off, a batch of Python lists alone, or collated
    samples) carried none, and the main process's metrics stayed at 0 however
    much was read. Unpickled in the main process it counts ``extra`` and becomes
    the plain dict it holds. A copy (DataLoader's ``default_convert`` copies a
    mapping in the worker) stays a carrier: copying must count nothing.
    """

    __slots__ = ("extra",)

    def __init__(self, values: Any, extra: tuple[Any, ...]) -> None:
        super().__init__(values)
        self.extra = extra

    def __copy__(self) -> Carried:
        return Carried(self, self.extra)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrive, (dict(self), self.extra))


def _arrive(values: dict[str, Any], extra: tuple[Any, ...]) -> dict[str, Any]:
    arrived(extra)
    return values


def carried(extras: Iterable[tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    """Several carried ``(key, delta)`` as one (samples collated into a batch): same key."""
    from edgecache.clients.dataset_readers import merge

    key, delta = None, None
    for extra in extras:
        if extra is not None:
            key, delta = extra[0], merge(delta, extra[1])
    return None if key is None else (key, delta)


class _Collector(Collector):
    """Reads every label set's totals at scrape time."""

    def collect(self) -> Iterator[Any]:
        wait = CounterMetricFamily(
            "edgecache_client_data_wait_seconds",
            "Seconds the training loop waited for a batch (rate: the fraction of time waiting)",
            labels=["rank", "dataset"],
        )
        samples = CounterMetricFamily(
            "edgecache_client_samples",
            "Samples delivered to the training loop",
            labels=["rank", "dataset"],
        )
        batches = CounterMetricFamily(
            "edgecache_client_batches",
            "Batches delivered to the training loop",
            labels=["rank", "dataset"],
        )
        failovers = CounterMetricFamily(
            "edgecache_client_failovers",
            "Reads continued on another node after one failed",
            labels=["rank", "dataset"],
        )
        read = CounterMetricFamily(
            "edgecache_client_read_bytes",
            "Chunk bytes read from each endpoint (node or local cache)",
            labels=["rank", "dataset", "endpoint"],
        )
        in_use = GaugeMetricFamily(
            "edgecache_client_endpoint_in_use",
            "1 for the endpoint that served the last chunk, 0 for the others",
            labels=["rank", "dataset", "endpoint"],
        )
        with _TOTALS_LOCK:
            every = list(_TOTALS.items())
        for labels, totals in every:
            with totals.lock:
                if totals.wait_measured:  # unknown is absent, not 0
                    wait.add_metric(list(labels), totals.wait_seconds)
                samples.add_metric(list(labels), totals.samples)
                batches.add_metric(list(labels), totals.batches)
                failovers.add_metric(list(labels), totals.failovers)
                for endpoint, count in totals.bytes.items():
                    read.add_metric([*labels, endpoint], count)
                    in_use.add_metric([*labels, endpoint], float(endpoint == totals.endpoint))
        yield from (wait, samples, batches, failovers, read, in_use)


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(_Collector())
_SERVERS: dict[int, int] = {}  # asked port → bound port, one server per process and port
_SERVE_LOCK = threading.Lock()


def port_from_environment() -> int | None:
    """``$EDGECACHE_CLIENT_METRICS_PORT`` plus ``$LOCAL_RANK``, or None when unset."""
    base = os.environ.get(PORT_VARIABLE)
    if not base:
        return None
    try:
        port = int(base)
    except ValueError:
        raise ValueError(f"${PORT_VARIABLE} must be a port number, got {base!r}") from None
    rank = os.environ.get("LOCAL_RANK", "0")
    try:
        local = int(rank)
    except ValueError:
        raise ValueError(
            f"$LOCAL_RANK must be a number (${PORT_VARIABLE} adds it to its port), got {rank!r}"
        ) from None
    return port + local if port else 0


def serve(port: int, host: str = "0.0.0.0") -> int:  # noqa: S104 - Prometheus scrapes from afar
    """Serve this process's client metrics on ``port`` (0: any free one); the bound port.

    Once per process and port: every EdgeDataset of the process is on it.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"the client metrics port must be 0..65535, got {port}")
    with _SERVE_LOCK:
        bound = _SERVERS.get(port)
        if bound is None:
            try:
                server, _ = start_http_server(port, addr=host, registry=REGISTRY)
            except OSError as exc:
                # Most often one metrics_port given to every rank of a host (torchrun): the
                # first took it. Said as the setting to change, not a bare Errno 98.
                raise ValueError(
                    f"cannot serve client metrics on port {port} ({exc.strerror or exc}): "
                    f"give each process of a host its own port: ${PORT_VARIABLE} (it adds "
                    "$LOCAL_RANK) instead of metrics_port=, or metrics_port=0 for any free one"
                ) from exc
            bound = _SERVERS[port] = int(server.server_port)
        return bound
