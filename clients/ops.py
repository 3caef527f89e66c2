"""What the ops CLI does, as functions: gather state, plan, warm, evict, check readiness.

The CLI (``clients/cli/``) only parses arguments, calls these and renders
what they return; everything that talks to the registry or to nodes lives
here, so scripts and tests can call it directly. Node errors come back as
data (a report's ``error``, an item's ``failures``) where one node failing
must not stop the others, and as :class:`~edgecache.cache.errors.EdgeCacheError`
otherwise; never as ``grpc.RpcError``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc

from edgecache.cache import rendezvous
from edgecache.cache.errors import (
    AccessDenied,
    EdgeCacheError,
    InvalidEndpoint,
    InvalidName,
    ManifestError,
    ObjectNotFound,
    OriginError,
    VersionNotFound,
    VersionPinned,
)
from edgecache.cache.names import parse_spec
from edgecache.cache.planner import (
    Infeasible,
    Job,
    Plan,
    RegionState,
    VersionKey,
    VersionSize,
    plan,
)
from edgecache.cache.registry import Registry
from edgecache.cache.registry_match import RegistryMatch, check_registry
from edgecache.cache.storage import Stores
from edgecache.cache.units import format_bytes
from edgecache.clients.channels import (
    bearer,
    describe,
    edge_stub,
    health_pings,
    node_error,
    open_channel,
)
from edgecache.clients.topology import Schedule, Topology
from edgecache.v1 import edge_pb2, edge_pb2_grpc
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "EvictResult",
    "Holding",
    "complete_versions",
    "holdings",
    "NodeReport",
    "PinnedJob",
    "pinned_jobs",
    "local_registry",
    "record_warmed_jobs",
    "dropped_warm_pins",
    "other_readers",
    "warm_readers",
    "schedule_owner",
    "WarmPin",
    "Readiness",
    "WarmItem",
    "evict",
    "foreign_pins",
    "gather_status",
    "make_plan",
    "ready",
    "resolve_specs",
    "stage_item",
    "status_call_timeout",
    "version_sizes",
    "held_manifests",
    "Outage",
    "region_nodes",
    "region_outages",
    "registry_digests",
    "state_problems",
    "unreachable_regions",
    "wait_ready",
    "warm",
    "warm_items_for_plan",
    "warm_item_for_version",
    "Unfit",
    "version_unfit",
    "without_pins",
]

log = logging.getLogger(__name__)
DEFAULT_BANDWIDTH = 1e9 / 8  # 1 Gbit/s when neither the file nor the nodes say
WARMED_JOBS = "_warm/jobs.json"  # in the registry: the jobs warm pinned versions for


def region_nodes(topology: Topology, region: str | None) -> dict[str, list[str]]:
    """Region → nodes, for one region or (``None``) all; an unknown region is named."""
    if region is None:
        return {name: list(cfg.nodes) for name, cfg in topology.regions.items()}
    if region not in topology.regions:
        raise InvalidEndpoint(
            f"unknown region {region!r}; the topology has {', '.join(sorted(topology.regions))}"
        )
    return {region: list(topology.regions[region].nodes)}


@dataclass
class NodeReport:
    """One node as seen from here."""

    region: str
    address: str
    healthy: bool
    rtt_ms: float = math.inf
    status: edge_pb2.NodeStatus | None = None
    error: str = ""
    # Serving, but it refused this call's credentials: not down (a retry will not help,
    # a token will), though nothing of its state is known either.
    refused: bool = False
    # Refused in TLS (``refused`` too): a CA, a certificate or the scheme to set, not a token.
    tls_refused: bool = False

    @property
    def refusal(self) -> str:
        """How it refused this command, for a message naming the node before it."""
        if self.tls_refused:
            return "could not be reached in TLS as this command is set up"
        return "serves but refused this command's credentials"


def gather_status(
    topology: Topology,
    timeout: float = 3.0,
    *,
    token: str | None = None,
    regions: set[str] | None = None,
    pings: int = 3,
) -> list[NodeReport]:
    """Health, RTT and Status of every node (of ``regions``, if given), in parallel.

    Unreachable nodes are reported, not raised. ``timeout`` bounds each call
    (connecting, each of ``pings`` health checks, Status), so a node costs at
    most ``(pings + 2) * timeout``; fewer pings make a quicker round, a rougher RTT.
    """

    def one(region: str, address: str) -> NodeReport:
        channel = open_channel(address)
        stub = edge_pb2_grpc.EdgeCacheStub(channel)
        try:
            checks = health_pings(channel, pings=pings, timeout=timeout)
            if checks.rtt_ms is None:
                tls = checks.tls_refused  # a setting to change, not a node to wait for
                return NodeReport(
                    region, address, False, error=checks.error, refused=tls, tls_refused=tls
                )
            try:
                status = stub.Status(
                    edge_pb2.StatusRequest(), timeout=timeout, metadata=bearer(token)
                )
            except grpc.RpcError as exc:
                if exc.code() not in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    raise
                return NodeReport(
                    region,
                    address,
                    checks.serving,
                    checks.rtt_ms,
                    error=describe(exc),
                    refused=True,
                )
            return NodeReport(region, address, checks.serving, checks.rtt_ms, status)
        except grpc.RpcError as exc:
            return NodeReport(region, address, False, error=describe(exc))
        finally:
            channel.close()

    pairs = [
        (r, n)
        for r, cfg in topology.regions.items()
        if regions is None or r in regions
        for n in cfg.nodes
    ]
    with ThreadPoolExecutor(max(len(pairs), 1)) as pool:
        return list(pool.map(lambda p: one(*p), pairs))


async def resolve_specs(
    registry: Registry, specs: set[str]
) -> tuple[dict[str, pb.Manifest], dict[str, str]]:
    """Manifests of every spec (``latest`` resolved now), and why each other spec does not exist.

    The reason is the registry's own: it names the registry's URL and says
    whether that exists at all or which versions it holds (a typo in the
    registry URL made every version "not in the registry", with nothing to
    say where the plan had looked).
    """
    found: dict[str, pb.Manifest] = {}
    missing: dict[str, str] = {}
    for spec in sorted(specs):
        try:
            found[spec] = await registry.resolve(spec)
        except VersionNotFound as exc:
            missing[spec] = str(exc)
    return found, missing


def make_plan(
    topology: Topology,
    schedule: Schedule,
    *,
    now: datetime | None = None,
    reports: list[NodeReport] | None = None,
    token: str | None = None,
) -> tuple[Plan, dict[str, pb.Manifest]]:
    """Resolve the schedule against the registry and the nodes, then plan."""
    now = now or datetime.now(UTC)
    reports = gather_status(topology, token=token) if reports is None else reports
    # Jobs that have ended need nothing more: neither staging nor a verdict.
    current = [job for job in schedule.jobs if job.end > now]
    specs = {spec for job in current for spec in job.datasets}

    held_keys = {(v.dataset, v.version) for _, v in _resident(reports)}
    # A pinned version not held (yet) may be another schedule's, whose room the plan keeps:
    # its manifest sizes it.
    held_keys |= {key for key, _ in _pins(reports, now)}

    async def resolve(
        reg: Registry,
    ) -> tuple[dict[str, pb.Manifest], dict[str, str], dict[str, pb.Manifest]]:
        found, absent = await resolve_specs(reg, specs)
        return found, absent, await held_manifests(reg, held_keys, found)

    manifests, missing, others = Registry.run(topology.registry, resolve)
    held = holdings(reports, {**others, **manifests})
    sizes = version_sizes(manifests, held, others=others)
    jobs = [
        Job(
            name=job.name,
            region=job.region,
            start=job.start,
            end=job.end,
            versions=tuple(
                (manifests[s].dataset, manifests[s].version) for s in job.datasets if s in manifests
            ),
            priority=job.priority,
        )
        for job in current
    ]
    outages = region_outages(reports)
    own: dict[tuple[str, VersionKey], datetime] = {}
    for job in jobs:
        for version in job.versions:
            own[(job.region, version)] = max(own.get((job.region, version), job.end), job.end)
    pinned = foreign_pins(reports, own, now)
    reserved = _reserved_room(pinned, held, manifests, others)
    regions = {}
    short_room: dict[str, list[str]] = {}  # region → why its room is less than its capacity
    for name, config in topology.regions.items():
        alive = [r.status for r in reports if r.region == name and r.status is not None]
        held_here = held.get(name, {})
        # The room the nodes use is every copy they store (their used_bytes): a version held
        # whole takes all its copies, and evicting it frees them. Of a version held in part,
        # staging fetches what the nodes' shares lack (its bytes counted once, which is what
        # the plan counts as held); copies beyond the shares stay on their nodes until it is
        # evicted, room the region does not have.
        resident = {v: h.used_bytes for v, h in held_here.items() if h.complete}
        partial = {v: h.stored_bytes for v, h in held_here.items() if not h.complete}
        extra = {v: h.used_bytes - h.stored_bytes for v, h in held_here.items() if not h.complete}
        extra = {v: b for v, b in extra.items() if b > 0}
        # Replicas split shards (rendezvous hashing): their capacities add up, each
        # bounded by the room its cache's disk has left.
        capacity = max(sum(_room(status) for status in alive) - sum(extra.values()), 0)
        disk_bound = [
            r
            for r in reports
            if r.region == name and r.status and _room(r.status) < r.status.capacity_bytes
        ]
        if disk_bound:
            short_room.setdefault(name, []).append(
                "; ".join(
                    f"the cache's disk on {r.address} has "
                    f"{format_bytes(r.status.disk_free_bytes)} "
                    f"free{' (full)' if r.status.disk_full else ''}"
                    for r in disk_bound
                    if r.status is not None
                )
                + ": the room counted is what the disk holds, not --capacity; free space on "
                "the volume or give the cache a larger one"
            )
        if extra:
            short_room.setdefault(name, []).append(
                "; ".join(
                    f"its nodes hold {format_bytes(b)} of {v[0]}@{v[1]} beyond their shares "
                    f"(copies staged while a replica was down), room only evicting "
                    f"{v[0]}@{v[1]} frees"
                    for v, b in sorted(extra.items())
                )
            )
        measured = [s.origin_bytes_per_second for s in alive if s.origin_bytes_per_second]
        # Replicas split shards, so their staging rates add up; one that has not staged yet
        # counts as the average of those that have.
        rates = [s.staging_bytes_per_second for s in alive if s.staging_bytes_per_second]
        staging_rate = sum(rates) / len(rates) * len(alive) if rates else None
        outage = outages.get(name)
        regions[name] = RegionState(
            name=name,
            capacity_bytes=capacity,
            origin_bandwidth=config.origin_bandwidth
            or (min(measured) if measured else DEFAULT_BANDWIDTH),
            resident=resident,
            partial=partial,
            peer_bandwidth=dict(config.peers),
            egress_price_per_gb=config.egress_price_per_gb,
            staging_rate=staging_rate,
            # Nothing can be planned where no node answers; a degraded region is planned
            # on the nodes that did (and the command fails all the same, naming the rest).
            unreachable=outage.message() if outage is not None and outage.unreachable else "",
            pinned=pinned.get(name, {}),
            reserved=reserved.get(name, {}),
        )
    missing_items = [
        (job.name, job.region, spec) for job in current for spec in job.datasets if spec in missing
    ]
    result = plan(jobs, regions, sizes, now=now, missing=missing_items, why_missing=missing)
    result.infeasible += _share_rows(topology, reports, jobs, manifests, sizes, held, result)
    result.infeasible.sort(key=lambda i: (i.region, i.job, i.version))
    result.infeasible[:] = [
        replace(row, reason=f"{row.reason} ({'; '.join(short_room[row.region])})")
        if row.region in short_room and "capacity" in row.reason
        else row
        for row in result.infeasible
    ]
    return result, manifests


def _share_rows(
    topology: Topology,
    reports: list[NodeReport],
    jobs: Sequence[Job],
    manifests: Mapping[str, pb.Manifest],
    sizes: Mapping[VersionKey, VersionSize],
    held: Mapping[str, Mapping[VersionKey, Holding]],
    result: Plan,
) -> list[Infeasible]:
    """Rows for the jobs whose versions, not held yet, no node split lets their region hold.

    The plan counts a region's capacity as one pool (:func:`share_overflow` says
    why that is not enough). A job is checked with every version the region
    must hold while it runs: its own and those of the jobs there whose time
    overlaps it, the ones held already at what each node holds of them. Checked
    a job at a time, two jobs' versions whose shards hash to one node were each
    said to fit, and the second one's warm failed RESOURCE_EXHAUSTED there.
    """
    by_key = {(m.dataset, m.version): m for m in manifests.values()}
    unmet = {(row.job, row.version) for row in result.infeasible}
    rows = []
    for job in jobs:
        if job.region not in topology.regions:
            continue
        whole = {v for v, h in held.get(job.region, {}).items() if h.complete}
        staged = [by_key[v] for v in job.versions if v not in whole and v in by_key]
        if not staged:
            continue
        together = [  # what the plan holds for the jobs running meanwhile (not what it cannot)
            v
            for other in jobs
            if other.region == job.region and other.start < job.end and job.start < other.end
            for v in other.versions
            if v in by_key and (other.name, f"{v[0]}@{v[1]}") not in unmet
        ]
        needed = list(dict.fromkeys([*((m.dataset, m.version) for m in staged), *together]))
        why = share_overflow(
            topology,
            reports,
            job.region,
            [by_key[v] for v in needed if v not in whole],
            sizes,
            kept=[v for v in needed if v in whole],
        )
        if why is None:
            continue
        for m in staged:
            spec = f"{m.dataset}@{m.version}"
            if (job.name, spec) not in unmet:
                rows.append(Infeasible(job.name, job.region, spec, why))
    return rows


def share_overflow(
    topology: Topology,
    reports: list[NodeReport],
    region: str,
    manifests: Sequence[pb.Manifest],
    sizes: Mapping[VersionKey, VersionSize],
    kept: Sequence[VersionKey] = (),
) -> str | None:
    """Why the region's nodes cannot hold these versions at once, node by node; or None.

    Replicas split a version's shards by rendezvous hashing over the nodes that
    answer, and each node keeps its share in its own cache: the capacities add
    up only as far as the shares are even. Two versions of four large shards
    in a region of two 2.5 MiB nodes (3.5 MiB in all, in 5 MiB) put all four on
    one node: plan and its dry run said they fit, and every warm failed there
    RESOURCE_EXHAUSTED. A share's bytes are the version's stored bytes in the
    proportion of its shards' source bytes. ``kept``: versions the region holds
    whole and keeps meanwhile, counted at what each node holds of them.
    """
    alive = {
        r.address: _room(r.status) for r in reports if r.region == region and r.status is not None
    }
    nodes = [node for node in topology.regions[region].nodes if node in alive]
    if len(nodes) < 2:
        return None  # one node holds everything: the plan's capacity is its own
    names = replica_names(reports)
    share = dict.fromkeys(nodes, 0)
    owned = dict.fromkeys(nodes, 0)
    holds = dict.fromkeys(nodes, 0)  # of the kept versions
    for report, v in _resident(reports):
        if report.address in holds and (v.dataset, v.version) in kept:
            holds[report.address] += v.stored_bytes
    for manifest in manifests:
        key = (manifest.dataset, manifest.version)
        stored, source = sizes[key].stored, sum(s.source_size for s in manifest.shards)
        for index, shard in enumerate(manifest.shards):
            node = rendezvous.owner(nodes, manifest.dataset, manifest.version, index, names=names)
            part = shard.source_size / source if source else 1 / len(manifest.shards)
            share[node] += math.ceil(stored * part)
            owned[node] += 1
    over = [node for node in nodes if share[node] + holds[node] > alive[node]]
    if not over:
        return None
    node = max(over, key=lambda n: share[n] + holds[n] - alive[n])
    specs = ", ".join(f"{m.dataset}@{m.version}" for m in manifests)
    shards = sum(len(m.shards) for m in manifests)
    beside = (
        f" beside the {format_bytes(holds[node])} it holds of "
        f"{', '.join(f'{d}@{n}' for d, n in kept)}, kept meanwhile,"
        if holds[node]
        else ""
    )
    return (
        f"{node}'s share of {specs} ({owned[node]} of {shards} shards, "
        f"{format_bytes(share[node])}){beside} is more than its cache holds "
        f"({format_bytes(alive[node])}): replicas split a version's shards by hash and each "
        f"keeps its own share, so the region's capacities add up only as far as the shares "
        f"are even; give {node} at least "
        f"{format_bytes(share[node] + holds[node] - alive[node])} more (its --capacity), "
        "or publish the versions with more, smaller shards"
    )


def _room(status: edge_pb2.NodeStatus) -> int:
    """What a node's cache can hold: its capacity, or less where its disk has less left.

    A cache of ``--capacity 64MiB`` on a 6 MiB volume was planned as 64 MiB: the
    plan said the job was met, and every warm and controller round failed
    RESOURCE_EXHAUSTED. Evicting frees pages inside the LMDB file for new
    chunks, so the bound is what is held plus what the disk has free. A node
    that reports no free bytes and no full disk (a release before it said)
    is taken at its capacity.
    """
    if not status.disk_free_bytes and not status.disk_full:
        return status.capacity_bytes
    return min(status.capacity_bytes, status.used_bytes + status.disk_free_bytes)


def _pins(reports: list[NodeReport], now: datetime) -> Iterator[tuple[VersionKey, datetime]]:
    """Each pin an answering node holds that has not run out: (version, until)."""
    for report in reports:
        if report.status is None:
            continue
        for v in report.status.versions:
            if v.HasField("pinned_until"):
                until = v.pinned_until.ToDatetime(tzinfo=UTC)
                if until > now:
                    yield (v.dataset, v.version), until


def _reserved_room(
    pinned: dict[str, dict[VersionKey, datetime]],
    held: dict[str, dict[VersionKey, Holding]],
    manifests: dict[str, pb.Manifest],
    others: dict[str, pb.Manifest],
) -> dict[str, dict[VersionKey, int]]:
    """Region → version → the stored bytes another schedule's pinned version still lacks there.

    Warm pins every version a job reads, and stages one that does not fit yet
    later (deferred until a job ends); the controller stages it in its time.
    Until then the pin holds no data, and a plan counting only what is held
    gave its room to another schedule, whose job then could not be met. A
    version whose manifest is gone cannot be staged, so it keeps no room.
    """
    by_key = {(m.dataset, m.version): m for m in [*others.values(), *manifests.values()]}
    lacking = {
        (region, key)
        for region, versions in pinned.items()
        for key in versions
        if key in by_key and not (held.get(region, {}).get(key) or Holding()).complete
    }
    wanted = {f"{d}@{v}": by_key[(d, v)] for _, (d, v) in lacking}
    sizes = version_sizes(wanted, held, others={**others, **manifests})
    out: dict[str, dict[VersionKey, int]] = {}
    for region, key in lacking:
        have = held.get(region, {}).get(key)
        rest = sizes[key].stored - (have.stored_bytes if have is not None else 0)
        if rest > 0:
            out.setdefault(region, {})[key] = rest
    return out


def foreign_pins(
    reports: list[NodeReport], own: dict[tuple[str, VersionKey], datetime], now: datetime
) -> dict[str, dict[VersionKey, datetime]]:
    """Region → version → until when its nodes pin it for jobs other than ``own``'s.

    ``own`` is (region, version) → the end of the last job of the schedule at
    hand that reads it there: the pin warm and the controller place for it. A
    node's pin that has not run out and lasts longer than that (or pins a
    version the schedule does not read there) is another schedule's, which
    counts on the version staying: neither the plan nor the executor may evict
    it before then, as ``edgecache evict`` refuses to.
    """
    out: dict[str, dict[VersionKey, datetime]] = {}
    for report in reports:
        if report.status is None:
            continue
        for v in report.status.versions:
            if not v.HasField("pinned_until"):
                continue
            key, until = (v.dataset, v.version), v.pinned_until.ToDatetime(tzinfo=UTC)
            ours = own.get((report.region, key))
            if until <= now or (ours is not None and until <= ours + timedelta(seconds=1)):
                continue
            region = out.setdefault(report.region, {})
            region[key] = max(region.get(key, until), until)
    return out


@dataclass(frozen=True)
class Outage:
    """A region some of whose nodes did not answer: the one meaning of a region down.

    *Unreachable* when none answered: nothing can be planned there, its jobs
    cannot be met as far as anyone here can tell. *Degraded* when some did:
    the plan counts only those (their capacity, their holdings), and staging
    splits the whole version among them (the silent nodes' share included,
    where readers look for it while they are down). Either way a command that
    plans or stages for the region fails (exit 1), naming the nodes: retrying
    once they answer may help.
    """

    region: str
    down: tuple[NodeReport, ...]
    nodes: int  # the region's nodes that were asked

    @property
    def unreachable(self) -> bool:
        """No node of the region answered."""
        return len(self.down) == self.nodes

    @property
    def refused(self) -> bool:
        """Every silent node serves but refused the credentials: bad input, not a retry."""
        return all(r.refused for r in self.down)

    def message(self) -> str:
        """Which nodes did not answer, and what to check: one line for an operator."""
        nodes = "; ".join(f"{r.address} ({r.error or 'no answer'})" for r in self.down)
        if self.refused and all(r.tls_refused for r in self.down):
            # Each node's error ends with the TLS setting to change: said there, once.
            return f"region {self.region}'s nodes could not be reached in TLS: {nodes}"
        if self.refused:
            tls = any(r.tls_refused for r in self.down)  # some in TLS, the others a token
            return (
                f"region {self.region}'s nodes serve but refused this command's credentials"
                f"{' (a token, or TLS)' if tls else ''}: {nodes}; pass the token they take "
                "with --token-file (the admin token for warm and evict)"
                + (", and set TLS as each error says" if tls else "")
            )
        state = (
            "unreachable"
            if self.unreachable
            else f"degraded, {len(self.down)} of its {self.nodes} nodes not answering"
        )
        return (
            f"region {self.region} is {state}: {nodes}; check that the node runs and is "
            "reachable from here (edgecache status, edgecache doctor), then try again"
        )


def without_pins(reports: Sequence[NodeReport], pins: Sequence[WarmPin]) -> list[NodeReport]:
    """``reports`` as they would read once ``pins`` are released (or shortened): copies.

    ``warm --dry-run`` plans on this, so it shows what the real run, which
    releases the pins first and then asks the nodes again, carries out.
    """
    gone = {(pin.node, pin.key): pin.shorten_to for pin in pins}
    out = []
    for report in reports:
        if report.status is not None and any(node == report.address for node, _ in gone):
            status = edge_pb2.NodeStatus()
            status.CopyFrom(report.status)
            for v in status.versions:
                key = (report.address, (v.dataset, v.version))
                if key in gone:
                    if (shorter := gone[key]) is not None:
                        v.pinned_until.FromDatetime(shorter.astimezone(UTC).replace(tzinfo=None))
                    else:
                        v.ClearField("pinned_until")
            report = replace(report, status=status)
        out.append(report)
    return out


# How long status and doctor wait for the registry's manifests (a registry that accepts
# connections and never answers held status for aiohttp's 5 minutes, printing nothing).
DIGESTS_TIMEOUT = 5.0


def registry_digests(
    registry: str, reports: Sequence[NodeReport], timeout: float = DIGESTS_TIMEOUT
) -> dict[tuple[str, int], str] | None:
    """The registry's digest of each version a node that answered holds, for :func:`state_problems`.

    Read in one pass (the manifests concurrently), for ``timeout`` seconds at
    most. A version the registry does not have is left out; None when the
    registry could not be read (in time): ``status`` and ``doctor`` then say
    the copies were not checked, and judge the rest of the nodes' state.
    """
    keys = sorted(
        {
            (v.dataset, v.version)
            for r in reports
            if r.status is not None and _reads_registry(r, registry)
            for v in r.status.versions
            if v.shard_count and v.digest
        }
    )
    if not keys:
        return {}

    async def read(reg: Registry) -> dict[tuple[str, int], str] | None:
        found = await asyncio.wait_for(
            asyncio.gather(*(reg.manifest(*key) for key in keys), return_exceptions=True),
            timeout,
        )
        # A version the registry does not have is left out; any other failure means the
        # registry could not be read: an error that came back before the timeout (a read
        # timing out, a refusal) read as "read, nothing to flag", where the timeout said
        # "not checked".
        if failed := [f for f in found if isinstance(f, BaseException)]:
            if not all(isinstance(f, VersionNotFound) for f in failed):
                log.debug("the registry's digests were not read: %s", failed[0])
                return None
        return {
            key: manifest.digest
            for key, manifest in zip(keys, found, strict=True)
            if isinstance(manifest, pb.Manifest) and manifest.digest
        }

    try:
        return Registry.run(registry, read)
    except (EdgeCacheError, OSError, ValueError) as exc:  # TimeoutError is an OSError
        log.debug("the registry's digests were not read: %s", exc)
        return None


def _reads_registry(report: NodeReport, registry: str) -> bool:
    """Whether a node reads ``registry`` (or does not say: a node older than the field)."""
    if report.status is None or not report.status.registry:
        return True
    match = check_registry(report.address, registry, report.status.registry).match
    return match in (RegistryMatch.SAME, RegistryMatch.UNKNOWN)


def state_problems(
    reports: Sequence[NodeReport],
    digests: Mapping[tuple[str, int], str] | None = None,
    registry: str | None = None,
) -> dict[str, list[str]]:
    """Address → what in its node's state makes staging there fail, for ``status`` and ``doctor``.

    Both said nothing of these (exit 0, "ok") while every warm failed or split
    wrong: a cache holding more than its capacity (a node restarted with a lower
    ``--capacity``, its pinned versions kept), which refuses every new shard,
    nodes of a region reporting one node id (:func:`rendezvous.unique_names`),
    and a node started with another ``--region`` than the topology's. With the
    registry's ``digests`` (:func:`registry_digests`, of the topology's
    ``registry``), also a copy of other content under a version's name (the
    registry reset or moved since the node cached it), which the node refuses
    to serve and ``ready`` counts as missing; not for a node that reads
    another registry (or path), whose copies are its registry's, and which is
    flagged for that instead.
    """
    out: dict[str, list[str]] = {}
    for report in reports:
        status = report.status
        # A node of another registry (or path) is said as such: its copies are its
        # registry's, and evicting them there would throw good data away.
        judged = bool(digests) and (registry is None or _reads_registry(report, registry))
        for held in status.versions if status is not None and judged else ():
            want = digests.get((held.dataset, held.version)) if digests else None
            if held.shard_count and not _same_content(held, want):
                spec = f"{held.dataset}@{held.version}"
                out.setdefault(report.address, []).append(
                    f"it {_other_content_text(spec, held.digest, want or '')}"
                )
        if status is not None and status.region and status.region != report.region:
            out.setdefault(report.address, []).append(
                f"it says it is in region {status.region!r}, the topology puts it in "
                f"{report.region!r}: readers given endpoints=[...] group replicas by the region "
                "nodes report, and its metrics carry that one; start it with --region "
                f"{report.region} (EDGECACHE_REGION), or move it in the topology file"
            )
        if status is not None and status.used_bytes > status.capacity_bytes:
            now = datetime.now(UTC)
            pins = [
                f"{v.dataset}@{v.version}"
                for v in status.versions
                if v.shard_count
                and v.HasField("pinned_until")
                and v.pinned_until.ToDatetime(UTC) > now
            ]
            kept = f" by the pins of {', '.join(pins)}" if pins else ""
            out.setdefault(report.address, []).append(
                f"it holds {format_bytes(status.used_bytes)}, over its capacity of "
                f"{format_bytes(status.capacity_bytes)}{kept} (restarted with a lower "
                "--capacity?): every new shard is refused until it is under it again; "
                "release those pins (edgecache evict NAME@N --force, or the schedule that "
                "pinned them) or raise its --capacity"
            )
    by_region: dict[str, dict[str, str]] = {}
    for report in reports:
        if report.status is not None and report.status.node_id:
            by_region.setdefault(report.region, {})[report.address] = report.status.node_id
    for ids in by_region.values():
        for node_id, addresses in rendezvous.shared_ids(ids).items():
            for address in addresses:
                out.setdefault(address, []).append(rendezvous.shared_id_text(addresses, node_id))
    return out


def region_outages(reports: list[NodeReport]) -> dict[str, Outage]:
    """Region → its outage, for each region of ``reports`` with a node that did not answer."""
    asked: dict[str, list[NodeReport]] = {}
    for report in reports:
        asked.setdefault(report.region, []).append(report)
    return {
        region: Outage(region, tuple(down), len(nodes))
        for region, nodes in sorted(asked.items())
        if (down := [r for r in nodes if r.status is None])
    }


def lost_outages(
    items: Iterable[WarmItem], topology: Topology, before: Mapping[str, Outage]
) -> dict[str, Outage]:
    """``before`` with the nodes found down while staging ``items`` added to their regions.

    A node that died during a warm had its share staged on the others, as one
    down at the start, and the region is as degraded (readers look for that
    share on it once it is back, where it is not): warm exits 1 naming it, as
    it does for a node down before it began. It exited 0 with a note.
    """
    out = dict(before)
    for item in items:
        if not item.lost:
            continue
        known = {r.address for r in out[item.region].down} if item.region in out else set()
        added = tuple(
            NodeReport(item.region, node, healthy=False, error=why or "stopped answering")
            for node, why in item.lost.items()
            if node not in known
        )
        old = out.get(item.region)
        nodes = len(topology.regions[item.region].nodes)
        out[item.region] = Outage(item.region, (*(old.down if old else ()), *added), nodes)
    return out


def unreachable_regions(
    reports: list[NodeReport], schedule: Schedule, now: datetime
) -> dict[str, Outage]:
    """Region → its outage, for the regions of jobs not yet over (:class:`Outage`).

    Unreachable and degraded regions both: a plan for such a region is built
    on part of it, or on nothing, so it is not to be trusted, and staging
    there cannot finish.
    """
    used = {job.region for job in schedule.jobs if job.end > now}
    return {region: outage for region, outage in region_outages(reports).items() if region in used}


@dataclass
class Holding:
    """How much of one version a region's nodes hold between them.

    ``stored_bytes`` counts each shard once (the version's size, as readers
    find it); ``used_bytes`` counts every copy, a shard a node holds beyond its
    share included: the room the version takes on the nodes (their
    ``used_bytes``), which evicting it frees.
    """

    shards: int = 0
    stored_bytes: int = 0
    complete: bool = False
    used_bytes: int = 0


def _resident(reports: list[NodeReport]) -> Iterator[tuple[NodeReport, edge_pb2.ResidentVersion]]:
    """Each version an answering node holds data of (a pin without data holds nothing)."""
    for report in reports:
        if report.status is not None:
            for version in report.status.versions:
                if version.shard_count:
                    yield report, version


def holdings(
    reports: list[NodeReport], manifests: dict[str, pb.Manifest]
) -> dict[str, dict[VersionKey, Holding]]:
    """Region → version → what its answering nodes hold of it where readers look for it.

    Replicas split a version's shards (rendezvous hashing among the nodes that
    answer): each node's share counts, as :func:`ready` counts it, so a node
    back from an outage, whose share the others staged meanwhile, makes the
    version incomplete again and plan and warm stage the share (before, the
    union of the nodes' shards counted: "nothing to stage" while ``ready``
    said 0/3). Shards a node holds beyond its share (staged while another was
    down) are duplicates: the stored bytes count each shard once, at the
    nodes' bytes per shard, not once per copy, while the used bytes count
    every copy, since the node still stores them (the room the plan has: a
    region whose used bytes counted each shard once was planned with room
    its nodes did not have). A version whose shard count is known from
    neither a manifest nor a node counts its shards' union.
    """
    shard_counts = {(m.dataset, m.version): len(m.shards) for m in manifests.values()}
    digests = {(m.dataset, m.version): m.digest for m in manifests.values()}
    names = replica_names(reports)
    out: dict[str, dict[VersionKey, Holding]] = {}
    alive: dict[str, list[str]] = {}
    for report in reports:
        if report.status is not None:
            out.setdefault(report.region, {})  # a node that answers holding nothing: a region
            alive.setdefault(report.region, []).append(report.address)
    per_node: dict[tuple[str, VersionKey], dict[str, int]] = {}
    for report, v in _resident(reports):
        key = (v.dataset, v.version)
        holding = out[report.region].setdefault(key, Holding())
        holding.used_bytes += v.stored_bytes
        if not _same_content(v, digests.get(key)):
            continue  # other content under the name (the node refuses it): room, not data
        holding.shards += v.shard_count
        holding.stored_bytes += v.stored_bytes
        per_node.setdefault((report.region, key), {})[report.address] = v.shard_count
        if v.total_shards and key not in shard_counts:
            shard_counts[key] = v.total_shards
    for region, versions in out.items():
        nodes = alive[region]
        for key, holding in versions.items():
            total = shard_counts.get(key)
            if total is None:
                holding.complete = True  # nothing says how many: what is held is all there is
                continue
            copies, held = holding.shards, per_node.get((region, key), {})
            if len(nodes) > 1:
                holding.shards = sum(
                    min(held.get(node, 0), _share(nodes, node, key, total, names)) for node in nodes
                )
            else:
                holding.shards = min(copies, total)
            if copies > holding.shards:
                holding.stored_bytes = holding.stored_bytes * holding.shards // copies
            holding.complete = holding.shards >= total
    return out


def _share(
    nodes: Sequence[str], node: str, key: VersionKey, total: int, names: Mapping[str, str]
) -> int:
    """How many of a version's ``total`` shards ``node`` owns among ``nodes`` (rendezvous)."""
    return len(rendezvous.owned_shards(list(nodes), node, key[0], key[1], total, names=names))


def replica_names(reports: Iterable[NodeReport]) -> dict[str, str]:
    """Address → the name its node splits shards by: the id it reports (``Status.node_id``).

    Readers rank replicas by the same ids (:mod:`~edgecache.cache.rendezvous`),
    whatever address each side dials. A node that did not answer has none
    (its address stands for it: it is down, and the others hold its share).
    """
    return rendezvous.region_names(
        (r.region, r.address, r.status.node_id) for r in reports if r.status is not None
    )


def complete_versions(
    reports: list[NodeReport], manifests: dict[str, pb.Manifest]
) -> dict[str, set[VersionKey]]:
    """Region → the versions its nodes hold every shard of, between them."""
    return {
        region: {key for key, holding in versions.items() if holding.complete}
        for region, versions in holdings(reports, manifests).items()
    }


async def held_manifests(
    registry: Registry, held: set[VersionKey], known: dict[str, pb.Manifest]
) -> dict[str, pb.Manifest]:
    """Manifests of the versions nodes hold that ``known`` lacks (gone or unreadable: left out).

    A held version's stored bytes against its manifest's source bytes is the
    stored/source ratio that sizes the versions no node holds yet, so every
    held version counts, not only those a schedule reads. These serve only
    that estimate, so one that cannot be had is skipped: a version deleted
    from the registry silently, one whose manifest cannot be parsed with a
    warning naming it (left to fail, it would stop every plan, warm and
    controller round over a version no job reads).
    """
    have = {(m.dataset, m.version) for m in known.values()}

    async def one(dataset: str, version: int) -> pb.Manifest | None:
        try:
            return await registry.manifest(dataset, version)
        except VersionNotFound:
            return None
        except ManifestError as exc:
            log.warning(
                "%s@%d, held or pinned by a node, is left out of the size estimates: its manifest "
                "cannot be read (%s)",
                dataset,
                version,
                exc,
            )
            return None

    found = await asyncio.gather(*(one(d, v) for d, v in sorted(held - have)))
    return {f"{m.dataset}@{m.version}": m for m in found if m is not None}


def version_sizes(
    manifests: dict[str, pb.Manifest],
    held: dict[str, dict[VersionKey, Holding]],
    *,
    others: dict[str, pb.Manifest] | None = None,
) -> dict[VersionKey, VersionSize]:
    """Stored and source bytes of every version in ``manifests``: stored as held, else estimated.

    The estimate scales the source bytes by the stored/source ratio of the
    dataset's other versions that some region holds whole (same data, same
    preprocessing, as a rule), else by that ratio over everything held, else
    1. Preprocessing changes size a lot (Parquet → Arrow grows, JSON text →
    zstd shrinks), so source bytes alone would misjudge capacity. ``others``
    are the manifests of held versions that ``manifests`` lacks (versions no
    job reads): their ratios count too, though they get no size of their own.
    """
    source = {
        (m.dataset, m.version): sum(s.source_size for s in m.shards)
        for m in [*(others or {}).values(), *manifests.values()]
    }
    wanted = {(m.dataset, m.version) for m in manifests.values()}
    stored: dict[VersionKey, int] = {}
    for region in held.values():
        for key, holding in region.items():
            if holding.complete:
                stored[key] = max(stored.get(key, 0), holding.stored_bytes)
    ratios: dict[str, list[float]] = {}
    for (dataset, version), size in stored.items():
        if source.get((dataset, version)):
            ratios.setdefault(dataset, []).append(size / source[(dataset, version)])
    everything = [r for values in ratios.values() for r in values]
    overall = sum(everything) / len(everything) if everything else 1.0
    sizes = {}
    for key in sorted(wanted):
        source_bytes = source[key]
        if key in stored:
            sizes[key] = VersionSize(stored=stored[key], source=source_bytes)
            continue
        known = ratios.get(key[0])
        ratio = sum(known) / len(known) if known else overall
        sizes[key] = VersionSize(stored=max(int(source_bytes * ratio), 1), source=source_bytes)
    return sizes


@dataclass
class WarmItem:
    """One version to stage on one region's nodes."""

    region: str
    spec: str
    nodes: list[str]
    bytes_total: int  # the plan's estimate (stored bytes), which progress bars scale
    pin_until: datetime | None = None
    shard_count: int = 0  # with several nodes: each stages only the shards it owns
    peers: list[str] = field(default_factory=list)  # copy from these nodes; empty: origin
    # Nodes of ``nodes`` known not to answer (the round's status): never called; the
    # nodes that answer split the version between them instead (see stage_item).
    down: list[str] = field(default_factory=list)
    # Address → the node's id, which replicas split shards by (replica_names); a node
    # missing here is asked for it before its share is worked out (stage_item).
    names: dict[str, str] = field(default_factory=dict)
    # The registry the version was resolved in (the topology's); set, a node that reads
    # another is not called (check_registry). Empty: nodes are not checked.
    registry: str = ""
    # Address → the registry the node says it reads ("" for a node too old to say); a
    # node missing here is asked before staging, when ``registry`` is set (stage_item).
    registries: dict[str, str] = field(default_factory=dict)
    # Address → why: nodes found down while staging (not in ``down`` before it), whose
    # share went to the others; the region is degraded as if they were down at the start.
    lost: dict[str, str] = field(default_factory=dict)
    bytes_done: int = 0  # progress, as a share of bytes_total
    origin_bytes: int = 0  # what the nodes said they fetched from origin (source bytes)
    peer_bytes: int = 0  # what the nodes said they copied from peers (stored bytes)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. a peer that failed mid-shard
    done: bool = False

    @property
    def moved_bytes(self) -> int:
        """Bytes the nodes' Stage progress said they moved: from origin and from peers."""
        return self.origin_bytes + self.peer_bytes


def _split(item: WarmItem) -> bool:
    """Whether the item's nodes split its shards (several replicas, shard count known)."""
    return len(item.nodes) > 1 and item.shard_count > 0


def _shares(item: WarmItem, nodes: Sequence[str]) -> dict[str, list[int]]:
    """Node → the shards it owns among ``nodes`` (rendezvous hashing, as readers rank them)."""
    dataset, version = parse_spec(item.spec)
    return {
        node: rendezvous.owned_shards(
            nodes, node, dataset, version or 0, item.shard_count, names=item.names
        )
        for node in nodes
    }


def _learn_nodes(item: WarmItem, token: str | None) -> None:
    """Ask the item's nodes for what it lacks of them (one Status call each, at most).

    Their ids, when replicas split the shards by them; their registries, when
    the item is checked against one. A node that does not answer keeps its
    address as its name: it is down, its share goes to the others, and
    readers, who rank only nodes that answer, look for its shards where the
    others' ranking puts them. Its registry stays unknown (not refused): its
    Stage call fails its own way.
    """
    names = _split(item)
    ids = dict(item.names)
    for node in item.nodes:
        if node in item.down:
            continue
        if (not names or node in ids) and (not item.registry or node in item.registries):
            continue
        channel = open_channel(node)
        try:
            status = edge_pb2_grpc.EdgeCacheStub(channel).Status(
                edge_pb2.StatusRequest(), timeout=5.0, metadata=bearer(token)
            )
        except grpc.RpcError as exc:
            if names and node not in ids:
                # Split by its address here, while readers that learn its id look for its
                # shards by that: said, so a run once it answers can put them right.
                item.notes.append(
                    f"{node} did not say its node id ({describe(exc)}): its shards were split "
                    "by its address, where readers that learn its id may not look; run warm "
                    "again once it answers"
                )
            continue
        finally:
            channel.close()
        if status.node_id:
            ids[node] = status.node_id
        item.registries[node] = status.registry
    if names:
        item.names = rendezvous.unique_names(ids)


def other_registries(item: WarmItem) -> dict[str, str]:
    """The item's nodes that read another registry than ``item.registry`` → the refusal.

    Checked before any Stage call: such a node answers health checks and
    status like the others, and would fail every shard NOT_FOUND (or stage
    another registry's version of the same name), so it is not called, and
    the failure names both registries and what to set. A ``file://`` path
    that differs only earns a note (the same folder may be mounted at another
    path where the node runs: :func:`~edgecache.cache.registry_match.check_registry`);
    a node that does not say (an older one) is not judged.
    """
    if not item.registry:
        return {}
    refused = {}
    for node in item.nodes:
        if node in item.down or node not in item.registries:
            continue
        check = check_registry(node, item.registry, item.registries[node])
        if check.refuses:
            refused[node] = f"not staging {item.spec}: {check.message()}"
        elif check.match is RegistryMatch.PATH_DIFFERS and (note := check.message()) not in (
            item.notes
        ):
            item.notes.append(note)
    return refused


def _silent(address: str) -> str | None:
    """Why ``address`` is down (a health check it does not answer), or None when it answers.

    A Stage that failed UNAVAILABLE before any progress may be the node's own
    answer (its origin failing): only a node that does not answer its health
    check is down, and its share goes to the others.
    """
    channel = open_channel(address)
    try:
        checks = health_pings(channel, pings=1, timeout=2.0)
    finally:
        channel.close()
    return (checks.error or "no answer") if checks.rtt_ms is None else None


def stage_item(
    item: WarmItem,
    *,
    token: str | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[WarmItem], None] = lambda item: None,
) -> WarmItem:
    """Stage one item through its nodes' ``Stage`` RPCs, each node its own shards.

    With ``item.peers``, nodes copy the shards from those nodes (a peer
    region's) and fall back to origin for any a peer cannot give. Staging
    skips what is cached, so running it again resumes. Failures are collected
    in ``item.failures`` (unreachable nodes included), never raised. Setting
    ``stop`` cancels the streams; nodes keep the whole shards they committed.

    Replicas split the shards by rendezvous hashing over the nodes that
    answer: a node in ``item.down`` is never called, and one found down while
    staging (no progress, no health check) is dropped, so the others stage its
    share. That is the owner ``EdgeDataset`` asks first while the node is
    down (it ranks the replicas that answer), and a note names the nodes
    whose share moved. A region of one node that is down fails, uncalled.

    With ``item.registry`` set, a node that reads another registry is not
    called either (:func:`other_registries`): a failure names both
    registries, and the nodes that read the right one stage its share.
    """
    stop = stop or threading.Event()
    dataset, version = parse_spec(item.spec)
    request = edge_pb2.StageRequest(dataset=dataset, version=version or 0, peers=item.peers)
    if item.pin_until is not None:
        request.pin_until.FromDatetime(item.pin_until.astimezone(UTC).replace(tzinfo=None))
    _learn_nodes(item, token)  # the ids shards are split by (as readers rank them), registries
    # A node reading another registry is refused before any Stage call: treated as down
    # for the split (its share goes where readers look next), and a failure of the item.
    refused = other_registries(item)
    item.failures.extend(why for why in refused.values() if why not in item.failures)
    live = [node for node in item.nodes if node not in item.down and node not in refused]
    lost = {node: "" for node in item.nodes if node in item.down}  # node → why, if known
    asked: dict[str, set[int]] = {}  # node → the shards it staged (split items)
    finished = 0  # shards staged by the calls before this one
    changed = True
    while changed and live:
        changed = False  # a node found down this pass: its share goes to the others
        shares = _shares(item, live) if _split(item) else {live[0]: []}
        for address in live:
            if stop.is_set():
                return item
            mine = [s for s in shares.get(address, []) if s not in asked.get(address, set())]
            if _split(item) and not mine:
                continue
            node_request = edge_pb2.StageRequest()
            node_request.CopyFrom(request)
            node_request.shards.extend(mine)
            outcome = _stage_node(item, address, node_request, finished, token, stop, on_progress)
            if outcome is None:
                asked.setdefault(address, set()).update(mine)
                finished += len(mine)
            elif (why := outcome[1]) is not None and _split(item) and len(live) > 1:
                lost[address] = why
                live.remove(address)
                changed = True
                break
            else:
                item.failures.append(outcome[0])
    if not live and (lost or not refused):
        nodes = "; ".join(f"{node} ({why or 'no answer'})" for node, why in lost.items())
        which = "other node" if refused else "node"
        item.failures.append(
            f"staging {item.spec}: no {which} of {item.region} answers: {nodes}; check that "
            "they run and are reachable from here (edgecache status, edgecache doctor), then "
            "try again"
        )
    elif live and refused and _split(item):
        owned = _shares(item, item.nodes)
        for node in refused:
            share = len(owned[node])
            if share:
                item.notes.append(
                    f"{node} reads another registry: its share ({share} of "
                    f"{item.shard_count} shards) was staged on {', '.join(live)}"
                )
    item.lost.update({node: why for node, why in lost.items() if node not in item.down})
    if live and lost and _split(item):
        owned = _shares(item, item.nodes)
        for node, why in lost.items():
            share = len(owned[node])
            silent = f"{node} is not answering" + (f" ({why})" if why else "")
            item.notes.append(
                f"{silent}: its share ({share} of {item.shard_count} shards) was staged on "
                f"{', '.join(live)}"
                if share
                else f"{silent}; it owns none of the shards"
            )
    if stop.is_set():
        return item
    item.done = not item.failures
    item.bytes_done = item.bytes_total if item.done else item.bytes_done
    on_progress(item)
    return item


def _stage_node(
    item: WarmItem,
    address: str,
    request: edge_pb2.StageRequest,
    finished: int,
    token: str | None,
    stop: threading.Event,
    on_progress: Callable[[WarmItem], None],
) -> tuple[str, str | None] | None:
    """One node's ``Stage`` call, its progress added to ``item``: None when it went through.

    Otherwise (the failure, why the node is down or None): a node that failed
    before any progress and does not answer a health check is down.
    """
    channel = open_channel(address)
    call = edge_pb2_grpc.EdgeCacheStub(channel).Stage(request, metadata=bearer(token))
    watcher = threading.Thread(target=_cancel_on, args=(stop, call), daemon=True)
    watcher.start()
    origin_seen = peer_seen = 0
    answered = False
    try:
        for event in call:
            answered = True
            # Skipped (already cached) shards count as done for progress.
            total = item.shard_count or event.shards_total
            share = (finished + event.shards_done) / max(total, 1)
            item.bytes_done = max(item.bytes_done, int(item.bytes_total * min(share, 1)))
            item.origin_bytes += event.bytes_done - origin_seen
            item.peer_bytes += event.peer_bytes_done - peer_seen
            origin_seen, peer_seen = event.bytes_done, event.peer_bytes_done
            item.notes.extend(n for n in event.notes if n not in item.notes)
            on_progress(item)
            if stop.is_set():
                # At once, not at the watcher's next look (0.1 s): events that came in
                # the meantime were still read, and a stage could finish after a Ctrl-C.
                call.cancel()
                return None
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and stop.is_set():
            return None
        failure = str(node_error(exc, endpoint=address, what=f"staging {item.spec}"))
        gone = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return failure, (_silent(address) if gone and not answered else None)
    finally:
        call.cancel()
        channel.close()
    return None


def _cancel_on(stop: threading.Event, call: grpc.Call) -> None:
    """Cancel ``call`` when ``stop`` is set (a Ctrl-C lands in the main thread)."""
    while call.is_active():
        if stop.wait(0.1):
            call.cancel()
            return


def warm(
    items: list[WarmItem],
    *,
    on_progress: Callable[[WarmItem], None] = lambda item: None,
    stop: threading.Event | None = None,
    token: str | None = None,
) -> list[WarmItem]:
    """Stage every item (:func:`stage_item`), regions in parallel, a region's items in order."""
    stop = stop or threading.Event()

    def run_region(region_items: list[WarmItem]) -> None:
        for item in region_items:
            if stop.is_set():
                return
            stage_item(item, token=token, stop=stop, on_progress=on_progress)

    by_region: dict[str, list[WarmItem]] = {}
    for item in items:
        by_region.setdefault(item.region, []).append(item)
    pool = ThreadPoolExecutor(max(len(by_region), 1))
    futures = [pool.submit(run_region, group) for group in by_region.values()]
    try:
        while not all(f.done() for f in futures):
            time.sleep(0.1)  # stay interruptible: Ctrl-C lands here
    except KeyboardInterrupt:
        stop.set()  # stop cleanly: cancel the streams; nodes keep whole shards only
        raise
    finally:
        pool.shutdown(wait=True)
    for future in futures:
        future.result()
    return items


def ready(reports: list[NodeReport], region: str, manifest: pb.Manifest) -> tuple[bool, str]:
    """Whether ``region``'s nodes that answer hold every shard of the version between them.

    One node must hold them all; several nodes split them (rendezvous hashing),
    so together they must hold every shard, each node its own share among the
    nodes that answer. That is where readers find a shard while a node is
    down (``EdgeDataset`` ranks the replicas that answer) and where ``warm``
    and the controller stage the down node's share: ready then, with a note
    naming the node that did not answer. With no node answering, not ready.
    """
    nodes = [r for r in reports if r.region == region]
    if not nodes:
        return False, f"region {region!r} has no nodes in the topology"
    total = len(manifest.shards)
    spec = f"{manifest.dataset}@{manifest.version}"
    alive = [r for r in nodes if r.status is not None]
    silent = [
        f"{r.address} {r.refusal} ({r.error})"
        if r.refused
        else f"{r.address} unreachable ({r.error or 'no answer'})"
        for r in nodes
        if r.status is None
    ]
    if not alive:
        return False, f"{spec} is not ready in {region}: " + "; ".join(silent)
    missing = []
    names = replica_names(alive)
    for report in alive:
        held = _held(report, manifest)
        key = (manifest.dataset, manifest.version)
        wanted = (
            _share([n.address for n in alive], report.address, key, total, names)
            if len(alive) > 1
            else total
        )
        if held < wanted:
            share = " (its share with the others not answering)" if silent else ""
            missing.append(f"{report.address} has {held}/{wanted} shards{share}")
    if missing:
        other = _other_content(alive, manifest)
        return False, f"{spec} is not ready in {region}: " + "; ".join([*missing, *other, *silent])
    if silent:
        return True, (
            f"{spec} is staged in {region}: the nodes that answered hold every shard between "
            f"them (note: {'; '.join(silent)})"
        )
    return True, f"{spec} is staged in {region}"


def _held(report: NodeReport, manifest: pb.Manifest) -> int:
    """The shards of ``manifest``'s version the node holds (none, of other content)."""
    assert report.status is not None
    return next(
        (
            v.shard_count
            for v in report.status.versions
            if (v.dataset, v.version) == (manifest.dataset, manifest.version)
            and _same_content(v, manifest.digest)
        ),
        0,
    )


def _same_content(held: edge_pb2.ResidentVersion, digest: str | None) -> bool:
    """Whether a node's copy of a version is the registry's (``digest``), as far as known.

    A node keeps the manifest it cached a version under: after a registry reset
    (or a node moved to another registry) ``name@N`` may name other content
    there, which the node refuses to serve; ``ready`` and ``status`` said it was
    staged. A node too old to say its copy's digest, or a version whose manifest
    is not at hand, is taken as the registry's.
    """
    return not held.digest or not digest or held.digest == digest


def _other_content_text(spec: str, held: str, registry: str) -> str:
    """What a node's copy of other content under ``spec`` is, and what to do (after its name)."""
    return (
        f"keeps other content under {spec} (digest {held[:19]}…, the registry's is "
        f"{registry[:19]}…: the registry was reset or moved since it cached it) and refuses "
        f"to serve it; evict it there (edgecache evict {spec}, --force if pinned) and warm "
        "it again"
    )


def _other_content(reports: Sequence[NodeReport], manifest: pb.Manifest) -> list[str]:
    """Each answering node that keeps other content under ``manifest``'s name@N, said."""
    spec = f"{manifest.dataset}@{manifest.version}"
    return [
        f"{r.address} {_other_content_text(spec, v.digest, manifest.digest)}"
        for r in reports
        if r.status is not None
        for v in r.status.versions
        if (v.dataset, v.version) == (manifest.dataset, manifest.version)
        and v.shard_count
        and not _same_content(v, manifest.digest)
    ]


def warm_items_for_plan(
    topology: Topology, schedule: Schedule, result: Plan, manifests: dict[str, pb.Manifest]
) -> list[WarmItem]:
    """The plan's staging tasks as warm items, each pinned until its last job ends."""
    ends = {job.name: job.end for job in schedule.jobs}
    shard_counts = {f"{m.dataset}@{m.version}": len(m.shards) for m in manifests.values()}
    return [
        WarmItem(
            name,
            task.spec,
            list(topology.regions[name].nodes),
            task.bytes,
            pin_until=max(ends[j] for j in task.jobs),
            shard_count=shard_counts[task.spec],
            registry=topology.registry,
        )
        for name, region_plan in result.regions.items()
        for task in region_plan.tasks
    ]


def warm_item_for_version(topology: Topology, region: str, manifest: pb.Manifest) -> WarmItem:
    """One version to stage into every node of ``region`` (each its own shards)."""
    nodes = region_nodes(topology, region)[region]
    return WarmItem(
        region,
        f"{manifest.dataset}@{manifest.version}",
        nodes,
        sum(s.source_size for s in manifest.shards),
        shard_count=len(manifest.shards),
        registry=topology.registry,
    )


@dataclass(frozen=True)
class Unfit:
    """Why a version cannot be staged in a region: for good (too large), or for now (pins)."""

    text: str
    for_now: bool = False  # the region's pins hold the room: it fits once they end


def version_unfit(
    topology: Topology, region: str, manifest: pb.Manifest, *, token: str | None = None
) -> Unfit | None:
    """Why ``manifest``'s version cannot be staged in ``region`` now, or None when it can.

    Sized as ``plan`` sizes it (stored bytes, held by some region or estimated
    from what the regions hold) against the capacity of the region's nodes that
    answer. Staging such a version would only make each node evict its cache
    to make room, then fail, so ``warm NAME@N`` (its dry run too) asks this
    first and refuses, as ``plan`` does. The same holds for the room other
    versions' pins keep (a pinned version is never evicted): staging evicted
    the unpinned versions, then failed RESOURCE_EXHAUSTED, where its dry run
    had said "would stage". With no node answering nothing is known: staging
    reports that.
    """
    # Every region's holdings size it (another region may hold it whole: its stored bytes
    # exactly, as plan sizes it); the region's own nodes give the capacity.
    reports = gather_status(topology, token=token)
    alive = [r for r in reports if r.region == region and r.status is not None]
    if not alive:
        return None
    key = (manifest.dataset, manifest.version)
    spec = f"{manifest.dataset}@{manifest.version}"
    known = {spec: manifest}
    held_keys = {(v.dataset, v.version) for _, v in _resident(reports)}
    others = Registry.run(topology.registry, lambda reg: held_manifests(reg, held_keys, known))
    held = holdings(reports, {**others, **known})
    size = version_sizes(known, held, others=others)[key]
    capacity = sum(r.status.capacity_bytes for r in alive if r.status is not None)
    if size.stored > capacity:
        return Unfit(
            f"{spec} ({format_bytes(size.stored)} once stored) is larger than region "
            f"{region}'s whole capacity ({format_bytes(capacity)}), so nothing was staged or "
            f"evicted; give {region} at least {format_bytes(size.stored - capacity)} more (a "
            "larger capacity on its nodes, or more nodes: replicas split the shards)"
        )
    whole = held.get(region, {}).get(key)
    if whole is not None and whole.complete:
        return None
    why = share_overflow(topology, reports, region, [manifest], {key: size})
    if why is not None:
        return Unfit(f"{spec} cannot be held in region {region}: {why}")
    return _pinned_out(alive, region, spec, key, size.stored - (whole.stored_bytes if whole else 0))


def _pinned_out(
    alive: Sequence[NodeReport], region: str, spec: str, key: VersionKey, needed: int
) -> Unfit | None:
    """Why the room other versions' pins keep in ``region`` leaves too little for ``needed``."""
    now = datetime.now(UTC)
    room = 0
    pinned: dict[str, tuple[int, datetime]] = {}  # name@N → (stored bytes, until)
    for report in alive:
        assert report.status is not None
        locked = 0
        for v in report.status.versions:
            if not v.shard_count or (v.dataset, v.version) == key:
                continue
            if v.HasField("pinned_until") and (until := v.pinned_until.ToDatetime(UTC)) > now:
                locked += v.stored_bytes
                name = f"{v.dataset}@{v.version}"
                before = pinned.get(name, (0, until))
                pinned[name] = (before[0] + v.stored_bytes, max(before[1], until))
        room += max(0, _room(report.status) - locked)
    if needed <= room or not pinned:
        return None
    listed = ", ".join(
        f"{name} ({format_bytes(b)}, until {until:%Y-%m-%d %H:%M} UTC)"
        for name, (b, until) in sorted(pinned.items())
    )
    first = min(until for _, until in pinned.values())
    return Unfit(
        f"{spec} needs {format_bytes(needed)} in region {region}, which has "
        f"{format_bytes(room)} left beside what pins keep there ({listed}): a pinned version "
        "is never evicted to make room, so staging would evict the others and then fail; "
        f"run warm again once a pin ends (the first at {first:%Y-%m-%d %H:%M} UTC), release "
        "them (evict NAME@N --force, or the schedule that pinned them), or give the region "
        "more capacity",
        for_now=True,
    )


@dataclass
class EvictResult:
    """What one node said to an eviction."""

    region: str
    node: str
    bytes_freed: int = 0
    error: str = ""
    refused: bool = False  # the node refused the credentials: --token-file, not a retry
    pinned: bool = False  # pinned there since the status read (ABORTED): not evicted


def evict(
    topology: Topology,
    spec: str,
    *,
    region: str | None = None,
    token: str | None = None,
    force: bool = False,
    now: datetime | None = None,
) -> list[EvictResult]:
    """Drop ``NAME@N`` from every node of ``region`` (or of every region).

    Refused (:class:`VersionPinned`, naming the jobs) while any of those nodes
    pins the version for a scheduled job, unless ``force``; a version neither
    published nor held anywhere is :class:`VersionNotFound`. Every node is
    asked even when one fails; failures come back in ``error``. A node that
    answers NOT_FOUND holds nothing of the version (the version is no longer
    published, and another node still held it): 0 bytes freed there, not a
    failure; only when every node says so does nobody know the version, and
    that is :class:`VersionNotFound`.
    """
    parsed = parse_spec(spec)
    if parsed.version is None:
        raise InvalidName(f"evict needs an explicit version: {parsed.dataset}@N")
    key = (parsed.dataset, parsed.version)
    regions = region_nodes(topology, region)
    now = now or datetime.now(UTC)
    reports = [r for r in gather_status(topology, token=token) if r.region in regions]
    held = [
        (r, v)
        for r in reports
        if r.status is not None
        for v in r.status.versions
        if (v.dataset, v.version) == key
    ]
    pins = [
        (r.region, r.address, v.pinned_until.ToDatetime(tzinfo=UTC))
        for r, v in held
        if v.HasField("pinned_until") and v.pinned_until.ToDatetime(tzinfo=UTC) > now
    ]
    if pins and not force:
        raise VersionPinned(_pinned_message(topology, f"{key[0]}@{key[1]}", pins, now))
    unknown = VersionNotFound(
        f"{spec} is neither published in {topology.registry} nor held by any node of "
        f"{', '.join(regions)}; list versions with: edgecache versions {parsed.dataset}"
    )
    if not held:
        try:
            Registry.run(topology.registry, lambda reg: reg.manifest(*key))
        except VersionNotFound:
            raise unknown from None
    request = edge_pb2.EvictRequest(dataset=parsed.dataset, version=parsed.version)
    if not force:  # a pin placed since the status read above: the node refuses (ABORTED)
        request.unless_pinned_after.FromDatetime(now)  # aware: protobuf turns it into UTC
    results, not_found = [], 0
    for name, nodes in regions.items():
        for node in nodes:
            result = EvictResult(name, node)
            with edge_stub(node) as stub:
                try:
                    reply = stub.Evict(request, timeout=30, metadata=bearer(token))
                    result.bytes_freed = reply.bytes_freed
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        not_found += 1  # nothing of it held there: nothing to free
                    else:
                        error = node_error(exc, endpoint=node, what=f"evicting {spec}")
                        result.error, result.refused = str(error), isinstance(error, AccessDenied)
                        result.pinned = exc.code() == grpc.StatusCode.ABORTED
            results.append(result)
    if results and not_found == len(results):
        raise unknown
    return results


@dataclass(frozen=True)
class PinnedJob:
    """A scheduled job whose versions were pinned for it, as whoever pinned them recorded it."""

    name: str
    region: str
    start: datetime
    end: datetime
    versions: tuple[str, ...]  # name@N
    # Who pinned for it: "warm" (with the schedule file it ran, "" in a record older than
    # that) or "controller"; an eviction refusal names the command that releases the pin.
    by: str = "warm"
    schedule: str = ""


@dataclass(frozen=True)
class WarmPin:
    """A pin ``warm`` placed on a node, as its record keeps it: the schedule it ran owns it.

    Kept so a later warm of the same schedule file can release it once no job
    of that schedule reads the version there (a job removed or moved), as the
    controller releases its own; without it the pin stayed to its old end and
    only ``evict --force`` could free the room.
    """

    schedule: str  # the schedule file warm ran, as an absolute path
    node: str
    region: str
    version: str  # name@N
    until: datetime
    # Set by dropped_warm_pins: not released but shortened to this time, because a job
    # another record holds still reads the version there until then (see there).
    shorten_to: datetime | None = None

    @property
    def key(self) -> VersionKey:
        """The version as the plan and the nodes name it."""
        dataset, _, number = self.version.rpartition("@")
        return dataset, int(number)


def local_registry(registry: str) -> str | None:
    """The directory of a registry on this machine's filesystem, or None for an object store."""
    if registry.startswith("file://"):
        return registry[len("file://") :]
    return None if "://" in registry else registry


def schedule_owner(path: str | os.PathLike[str]) -> str:
    """How warm's record names a schedule file: its absolute path, whatever the cwd."""
    return str(Path(path).resolve())


def record_warmed_jobs(
    topology: Topology,
    schedule: Schedule,
    manifests: dict[str, pb.Manifest],
    now: datetime,
    *,
    owner: str = "",
    plan: Plan | None = None,
    unreleased: Sequence[WarmPin] = (),
) -> None:
    """Record in the registry which jobs ``warm`` pins versions for, so ``evict`` can name them.

    The controller keeps its own record (``_controller/state.json``); this is
    warm's (``_warm/jobs.json``). A warm run owns what an earlier run of the
    same schedule file (``owner``) recorded: those jobs and pins are replaced
    by this run's (a job removed from the schedule goes), while other
    schedules' are kept until they end, so warm runs of two schedules do not
    erase each other's. A job of the same name is replaced whoever recorded it.
    ``plan``'s pins are recorded as placed on every node of their region;
    ``unreleased`` are this schedule's earlier pins that no job reads any
    more but that could not be released yet (a node down): kept, to be
    released by the next run.
    """
    local = local_registry(topology.registry)
    if local is not None and not os.path.isdir(local):
        # A mistyped local registry: its versions did not resolve, so nothing was pinned;
        # writing the record would create the folder, a new empty registry hiding the typo.
        return
    old_jobs, old_pins = _warm_record(topology.registry)
    mine = bool(owner)
    kept = {
        job.name: job for job in old_jobs if job.end > now and not (mine and job.schedule == owner)
    }
    for job in schedule.jobs:
        if job.end > now:
            versions = tuple(
                f"{manifests[s].dataset}@{manifests[s].version}"
                for s in job.datasets
                if s in manifests
            )
            kept[job.name] = PinnedJob(
                job.name, job.region, job.start, job.end, versions, schedule=owner
            )
    pins = [p for p in old_pins if p.until > now and not (mine and p.schedule == owner)]
    pins += unreleased
    if plan is not None and mine:
        for region, region_plan in plan.regions.items():
            for node in topology.regions[region].nodes:
                for version, until in sorted(region_plan.pins.items()):
                    spec = f"{version[0]}@{version[1]}"
                    pins.append(WarmPin(owner, node, region, spec, until))
    body = json.dumps(
        {
            "jobs": [
                {
                    "name": job.name,
                    "region": job.region,
                    "start": job.start.isoformat(),
                    "end": job.end.isoformat(),
                    "versions": list(job.versions),
                    "schedule": job.schedule,
                }
                for job in sorted(kept.values(), key=lambda j: (j.start, j.name))
            ],
            "pins": [
                {
                    "schedule": pin.schedule,
                    "node": pin.node,
                    "region": pin.region,
                    "version": pin.version,
                    "until": pin.until.isoformat(),
                }
                for pin in sorted(pins, key=lambda p: (p.schedule, p.node, p.version))
            ],
        },
        indent=1,
    ).encode()
    url = _warmed_jobs_url(topology.registry)

    async def write() -> None:
        stores = Stores()
        try:
            await stores.for_url(url).put(url, body)
        finally:
            await stores.close()

    asyncio.run(write())


def dropped_warm_pins(
    topology: Topology,
    owner: str,
    plan: Plan,
    now: datetime,
    *,
    readers: dict[tuple[str, str], datetime] | None = None,
) -> list[WarmPin]:
    """The pins an earlier warm of schedule ``owner`` placed that its plan no longer keeps so.

    Their job was removed from the schedule (or moved, or reads another
    version now): warm releases them, as the controller releases its own. A
    pin still needed by a job another schedule's warm or the controller
    recorded (same region, same version, not ended) is left to that record:
    not returned when it ends by that job's end, and returned with
    ``shorten_to`` (that job's end) when it outlasts it. A pin the plan still
    keeps, but to an earlier time (the schedule moved its job's end earlier),
    is returned with ``shorten_to`` the plan's time, or the other record's
    job's end when that is later. A node keeps one pin time per version, and
    warm's Pin never shortens one (it may be another schedule's): left as it
    was, such a pin outlived every job, since a later release found another
    time on the node than the one recorded, and only ``evict --force`` freed
    the room. ``readers`` is :func:`other_readers` for ``owner``, when the
    caller has it. A record that cannot be read gives nothing.
    """
    try:
        _, pins = _warm_record(topology.registry)
    except OriginError as exc:
        _unreadable_record(_warmed_jobs_url(topology.registry), exc)
        return []
    if readers is None:
        readers = other_readers(topology, owner, now)
    dropped = []
    for pin in pins:
        if pin.schedule != owner or pin.until <= now:
            continue
        region_plan = plan.regions.get(pin.region)
        needed = [
            until
            for until in (
                region_plan.pins.get(pin.key) if region_plan is not None else None,
                readers.get((pin.region, pin.version)),
            )
            if until is not None
        ]
        if not needed:
            dropped.append(pin)
        elif pin.until - max(needed) > timedelta(seconds=1):
            dropped.append(replace(pin, shorten_to=max(needed)))
    return dropped


def other_readers(topology: Topology, owner: str, now: datetime) -> dict[tuple[str, str], datetime]:
    """(region, name@N) → the end of the last job reading it there that others recorded.

    Others: the controller, and warm runs of schedules other than ``owner``;
    jobs that have ended are left out. A pin on a node that lasts longer than
    ``owner``'s plan keeps it is theirs only when one of these jobs ends then
    (:func:`pinned_jobs`, whose records that cannot be read are left out).
    """
    out: dict[tuple[str, str], datetime] = {}
    for job in pinned_jobs(topology):
        if job.end <= now or (job.by == "warm" and job.schedule == owner):
            continue
        for spec in job.versions:
            out[(job.region, spec)] = max(out.get((job.region, spec), job.end), job.end)
    return out


def warm_readers(registry: str, now: datetime) -> dict[tuple[str, str], datetime]:
    """(region, name@N) → the end of the last job in warm's record (any schedule) reading it.

    Jobs that have ended are left out. The controller releases a pin only
    when no such job needs it, and shortens its own no further than their end:
    warm and the controller pin a version a job of both reads at the same
    time, so the controller took warm's pin for its own, and its next schedule
    released what warm's jobs still read. A record origin will not give is
    :class:`OriginError`, raised.
    """
    jobs, _ = _warm_record(registry)
    out: dict[tuple[str, str], datetime] = {}
    for job in jobs:
        if job.end > now:
            for spec in job.versions:
                out[(job.region, spec)] = max(out.get((job.region, spec), job.end), job.end)
    return out


def warm_started(schedule: Schedule, registry: str, now: datetime, skip: Set[str]) -> Schedule:
    """The schedule with each started job reading the versions warm pinned for it.

    The controller's record keeps what a job's ``name`` resolved to at its start
    (:func:`~edgecache.clients.controller.as_started`); warm run alone (from cron,
    say) had only its own record, which plan and warm did not read: a version
    published after the job started was staged and pinned for it, and the pin
    of the one it reads released, for ``evict`` to free under the running job.
    A started job warm recorded (the same name, region and start) reads the
    versions recorded for it, unless a newer one was published before the job
    started (warm's record is of its last run, which may be hours before the
    start, when the job's reader resolved ``name``); ``skip``: jobs the
    controller's record covers. A record origin will not give is
    :class:`OriginError`, raised.
    """
    if not any(job.start <= now < job.end and job.name not in skip for job in schedule.jobs):
        return schedule
    recorded = {(j.name, j.region, j.start): j for j in _warm_record(registry)[0]}

    @functools.cache
    def newest(dataset: str) -> pb.Manifest | None:
        """The registry's newest version of ``dataset``, read once a run (None: it cannot say)."""

        async def read(reg: Registry) -> pb.Manifest:
            return await reg.manifest(dataset, await reg.latest(dataset))

        try:
            return Registry.run(registry, read)
        except EdgeCacheError:
            return None

    jobs = []
    for job in schedule.jobs:
        record = recorded.get((job.name, job.region, job.start))
        if job.start <= now and job.name not in skip and record is not None and record.versions:
            datasets = [
                _as_recorded(spec, record.versions, job.start, newest) for spec in job.datasets
            ]
            job = job.model_copy(update={"datasets": list(dict.fromkeys(datasets))})
        jobs.append(job)
    return schedule.model_copy(update={"jobs": jobs})


def _as_recorded(
    spec: str,
    versions: Sequence[str],
    start: datetime,
    newest: Callable[[str], pb.Manifest | None],
) -> str:
    """``spec`` (``name``, ``name@latest``) as the job read it from ``start``; ``name@N`` as is.

    The recorded ``name@N``, unless the registry's ``newest`` was published
    before ``start`` (the job then resolved that one).
    """
    wanted = parse_spec(spec)
    if wanted.version is not None:
        return spec
    same = [v for v in versions if v.rpartition("@")[0] == wanted.dataset]
    if not same:
        return spec
    chosen = max(same, key=lambda v: int(v.rpartition("@")[2]))
    latest = newest(wanted.dataset)
    if latest is None:
        return chosen  # the registry cannot say: the record stands
    if (
        f"{latest.dataset}@{latest.version}" != chosen
        and latest.created_at.ToDatetime(UTC) <= start
    ):
        return spec  # published before the job started: it read that one
    return chosen


def _warmed_jobs_url(registry: str) -> str:
    return f"{registry.rstrip('/')}/{WARMED_JOBS}"


def _warmed_jobs(registry: str) -> list[PinnedJob]:
    """The jobs :func:`record_warmed_jobs` recorded (see :func:`_warm_record`)."""
    return _warm_record(registry)[0]


def _warm_record(registry: str) -> tuple[list[PinnedJob], list[WarmPin]]:
    """What :func:`record_warmed_jobs` recorded: nothing if warm never ran or it does not parse.

    A record origin will not give is :class:`OriginError`, raised: ``warm`` then
    warns instead of writing over the jobs of earlier runs after a passing
    failure, and :func:`pinned_jobs`, which only names jobs, goes on without it.
    A record written before warm kept its pins (a bare list of jobs) has jobs
    owned by no schedule and no pins.
    """
    url = _warmed_jobs_url(registry)

    async def read() -> bytes | None:
        stores = Stores()
        try:
            return await stores.for_url(url).get(url)
        except ObjectNotFound:
            return None
        finally:
            await stores.close()

    raw = asyncio.run(read())
    try:
        data = json.loads(raw or b"[]")
        if isinstance(data, list):
            data = {"jobs": data, "pins": []}
        jobs = [
            PinnedJob(
                j["name"],
                j["region"],
                datetime.fromisoformat(j["start"]),
                datetime.fromisoformat(j["end"]),
                tuple(j["versions"]),
                schedule=str(j.get("schedule", "")),
            )
            for j in data.get("jobs", [])
        ]
        pins = [
            WarmPin(
                str(p["schedule"]),
                str(p["node"]),
                str(p["region"]),
                str(p["version"]),
                datetime.fromisoformat(p["until"]),
            )
            for p in data.get("pins", [])
        ]
        if not all(pin.version.rpartition("@")[2].isdigit() for pin in pins):
            raise ValueError("a pin's version is not NAME@N")
    except (ValueError, TypeError, KeyError, AttributeError):
        return [], []  # a record that cannot be read only costs the job's name in a message
    return jobs, pins


def pinned_jobs(topology: Topology) -> list[PinnedJob]:
    """The jobs pins were set for: the controller's record, and warm's jobs it lacks.

    The names only explain an eviction refusal, so a record that cannot be read
    (origin failing, a damaged file) is left out with a warning: the refusal
    stands (exit 2), it must not turn into a failure (exit 1).
    """
    from edgecache.clients.controller import STATE_NAME, read_state  # it builds on ops

    # Keyed by what a job is and who recorded it, not its name alone: warm's schedule and
    # the controller's may each have a job of one name (the demo's eval-us and yours), and
    # the one that holds the pin must not be dropped for the other. The same job in both
    # records is kept twice: each releases the pin only once its own schedule drops the
    # job, and an eviction refusal that named the controller alone sent the operator
    # round twice.
    jobs: dict[tuple[object, ...], PinnedJob] = {}

    def key(job: PinnedJob) -> tuple[object, ...]:
        return (job.name, job.region, job.start, job.end, tuple(job.versions), job.by, job.schedule)

    try:
        state = read_state(topology.registry)
        for job in state.jobs.values() if state else []:
            pinned = PinnedJob(
                job.name,
                job.region,
                datetime.fromisoformat(job.start),
                datetime.fromisoformat(job.end),
                tuple(job.versions),
                by="controller",
            )
            jobs[key(pinned)] = pinned
    except (OriginError, ValueError, TypeError) as exc:
        _unreadable_record(f"{topology.registry.rstrip('/')}/{STATE_NAME}", exc)
    try:
        warmed = _warmed_jobs(topology.registry)
    except OriginError as exc:
        _unreadable_record(_warmed_jobs_url(topology.registry), exc)
        warmed = []
    for pinned in warmed:
        jobs.setdefault(key(pinned), pinned)
    return sorted(jobs.values(), key=lambda j: (j.start, j.name, j.region, j.by))


def _unreadable_record(url: str, exc: BaseException) -> None:
    log.warning("cannot read %s, so the jobs it records go unnamed: %s", url, exc)


def _job_times(job: PinnedJob, now: datetime) -> str:
    """``name (region, starts …, until … UTC)``: a job as an eviction refusal names it."""
    start = f"{job.start.astimezone(UTC):%Y-%m-%d %H:%M}"
    when = f"running since {start}" if job.start <= now else f"starts {start}"
    return f"{job.name} ({job.region}, {when}, until {job.end.astimezone(UTC):%Y-%m-%d %H:%M} UTC)"


def _pinned_message(
    topology: Topology,
    spec: str,
    pins: list[tuple[str, str, datetime]],
    now: datetime,
) -> str:
    """Which scheduled jobs a pinned version is kept for, and when they start.

    ``pins`` are (region, node, until) of the pins that have not run out. A
    recorded job is named only when it reads the version in a region whose
    nodes pin it, has not ended, and ends within that pin: a job of another
    region is unrelated, and one that runs past the pin no longer holds it
    (its pin was released or replaced since the record was written).
    """
    # Each node's own end (a node keeps one time per version; two nodes may differ):
    # one time for all of them named the latest, and the other node's was hours sooner.
    ends: dict[datetime, set[str]] = defaultdict(set)
    for _, node, when in pins:
        ends[when.replace(second=0, microsecond=0)].add(node)
    said = "; ".join(
        f"on {', '.join(sorted(nodes))} until {when:%Y-%m-%d %H:%M} UTC"
        for when, nodes in sorted(ends.items())
    )
    held_until: dict[str, datetime] = {}
    for region, _, when in pins:
        held_until[region] = max(held_until.get(region, when), when)
    readers = [
        job
        for job in pinned_jobs(topology)
        if spec in job.versions
        and job.region in held_until
        and now < job.end <= held_until[job.region] + timedelta(seconds=1)
    ]
    pinned = f"{spec} is pinned {said}"
    if not readers:
        # Nothing names its job, so no warm run or controller round will release it: the
        # advice to edit a schedule and run warm again did nothing, --force is the way.
        return (
            f"{pinned}, kept for a scheduled job, but neither warm nor the controller recorded "
            "which (`edgecache plan SCHEDULE` lists the jobs that read it), so neither will "
            "release the pin before it runs out; evicting it would leave that job without its "
            "data. If no job needs it any more, pass --force"
        )
    reads = ", ".join(dict.fromkeys(_job_times(job, now) for job in readers))  # once each
    return (
        f"{pinned}, read by {reads}; evicting it would leave that job without its data. "
        f"{_how_to_release(readers)}"
    )


def _how_to_release(readers: list[PinnedJob]) -> str:
    """The command that releases the pin once its job is no longer scheduled.

    Editing the schedule alone changes nothing on the nodes: warm releases
    the pins it placed when it runs that schedule file again, the controller
    on its next round. A warm record older than the pins it keeps names no
    pin to release: only ``--force`` frees it before it runs out.
    """
    schedules = sorted({job.schedule for job in readers if job.by == "warm" and job.schedule})
    steps = [
        f"remove the job from {path} and run `edgecache warm {path}` again (it releases "
        "the pins it placed for jobs no longer there)"
        for path in schedules
    ]
    if any(job.by == "controller" for job in readers):
        steps.append(
            "remove the job from the controller's schedule (its next round releases the pin)"
        )
    if len(steps) > 1:  # each record that holds the job keeps the pin until it lets go
        steps[-1] = "and " + steps[-1]
    if not steps:  # only jobs an older warm recorded, with no schedule file and no pins
        return (
            "An older warm recorded the job without its pins, so no warm run releases this "
            "one: once no job needs it, pass --force"
        )
    text = "; ".join(steps) + ", or pass --force"
    return text[0].upper() + text[1:]


@dataclass(frozen=True)
class Readiness:
    """Whether a version is staged in a region, and what is missing if not."""

    ok: bool
    message: str
    timed_out: bool = False
    waited_seconds: float = 0.0
    # A node serves but refused this command's credentials: bad input, which no wait mends.
    refused: bool = False


def status_call_timeout(budget: float, *, pings: int, longest: float) -> float:
    """Each call's timeout for a :func:`gather_status` round that must end within ``budget`` s.

    A node's round is ``pings + 2`` calls made one after another (connecting,
    each of the ``pings`` health checks, Status), and a node that accepts
    connections but never answers makes each run to its timeout: the round
    then lasts ``(pings + 2)`` timeouts. Splitting the budget evenly among
    them gives each call the most time that still ends every node's round in
    time, whichever call hangs. ``longest`` caps a call when the budget is
    ample, so a dead node costs no more than that a call.
    """
    return min(longest, budget / (pings + 2))


# A readiness round asks each node of the region with one health check (connecting,
# the check, Status: :func:`status_call_timeout` shares a round's budget among them).
_READY_PINGS = 1
_READY_CALLS = _READY_PINGS + 2  # connect, the health check, Status
_READY_CALL_SECONDS = 3.0  # a call's timeout when the deadline is far (gather_status's)
_READY_FIRST_ROUND_SECONDS = 2.0  # the first round's budget however short the timeout
_READY_ROUND_MARGIN = 4.0  # a round starts early only with this many times the last one's
# A node silent in a round whose calls had less than this each is not called unreachable
# for it: the wait's own deadline cut the calls short, not the node (see wait_ready).
_READY_TRUSTED_CALL_SECONDS = 0.5


def _any_silent(reports: Sequence[object], region: str) -> bool:
    """Whether a node of ``region`` did not answer in ``reports`` (anything else is kept)."""
    return any(
        isinstance(r, NodeReport) and r.region == region and r.status is None for r in reports
    )


def _refused_in(reports: Sequence[NodeReport], region: str) -> bool:
    """Whether a node of ``region`` serves but refused this command's credentials."""
    return any(r.refused for r in reports if r.region == region)


def wait_ready(
    topology: Topology,
    manifest: pb.Manifest,
    region: str,
    *,
    token: str | None = None,
    timeout: float | None = None,
    poll_seconds: float = 2.0,
) -> Readiness:
    """Check readiness once (``timeout=None``) or until ready or ``timeout`` seconds pass.

    The nodes are always asked at least once, so ``timeout=0`` checks once
    (that round may take up to 2 s when a node does not answer). After it the
    wait does not overrun the timeout: a round's budget is split evenly among
    its calls (connect, one check, Status), since each may run to its timeout,
    so the round ends by the deadline. Rounds are spaced by ``poll_seconds``
    while there is room for several like the last before the deadline. When
    there is not, the next round is asked at once with what is left rather
    than the rest slept away, so data ready by then is seen; its calls may be
    cut shorter than usual. The wait gives up after such a short round that
    again leaves no room (or once no time is left), sits out the rest and
    says it timed out. Its verdict is the last round's, unless a node did not
    answer that round's calls cut under ``_READY_TRUSTED_CALL_SECONDS`` by
    the deadline: a healthy node was then said to be "unreachable (not
    connected within 0.0096 s)" where the truth was "has 0/2 shards", so the
    verdict is the last round that every node answered or that had its time
    (the first always has). No thread outlives the call. Only the region's own
    nodes are asked, so a node down elsewhere costs nothing.
    """
    if timeout is not None and timeout < 0:
        raise ValueError(f"--timeout must be 0 or more seconds, got {timeout:g}")
    region_nodes(topology, region)  # an unknown region is an error, not "not ready"
    started = time.monotonic()

    refused = False  # a node of the region refused the credentials, the last round

    def check(budget: float) -> tuple[bool, str, bool]:
        """(ready, why, whether the verdict holds: every node answered or had its time)."""
        nonlocal refused
        call = status_call_timeout(budget, pings=_READY_PINGS, longest=_READY_CALL_SECONDS)
        reports = gather_status(topology, call, token=token, regions={region}, pings=_READY_PINGS)
        ok, message = ready(reports, region, manifest)
        refused = _refused_in(reports, region)
        return ok, message, call >= _READY_TRUSTED_CALL_SECONDS or not _any_silent(reports, region)

    if timeout is None:
        ok, message, _ = check(_READY_CALLS * _READY_CALL_SECONDS)
        waited = time.monotonic() - started
        return Readiness(ok, message, waited_seconds=waited, refused=refused and not ok)
    deadline = started + timeout
    budget = max(timeout, _READY_FIRST_ROUND_SECONDS)
    short = False  # whether the round just asked started with too little room
    message = ""  # the verdict: the last round's that holds (the first's at least)
    while True:
        asked = time.monotonic()
        ok, said, holds = check(budget)
        if ok:
            return Readiness(True, said, waited_seconds=time.monotonic() - started)
        if refused:  # the token, not the data: waiting would only hide it for an hour
            return Readiness(False, said, waited_seconds=time.monotonic() - started, refused=True)
        if holds or not message:
            message = said
        took = time.monotonic() - asked
        left = deadline - time.monotonic()
        room = _READY_ROUND_MARGIN * took
        if left <= 0 or (short and left < room):  # asked to the end: wait it out, say so
            time.sleep(max(left, 0.0))
            waited = time.monotonic() - started
            return Readiness(
                False,
                f"timed out after {waited:.1f} s: {message}",
                timed_out=True,
                waited_seconds=waited,
            )
        # Without room for rounds like the last, ask again at once with all the time
        # there is; a quick answer then makes room to poll as usual.
        short = left < room
        if not short:
            time.sleep(min(poll_seconds, left - room))
        budget = max(deadline - time.monotonic(), 0.0)
