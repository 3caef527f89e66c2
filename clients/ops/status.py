"""Node state as seen from here, which the other ops submodules start from.

The nodes' reports (:func:`gather_status`), outages, what they hold (:func:`holdings`), and
what in their state makes staging fail (:func:`state_problems`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc

from edgecache.cache import rendezvous
from edgecache.cache.errors import EdgeCacheError, InvalidEndpoint, VersionNotFound
from edgecache.cache.planner import VersionKey
from edgecache.cache.registry import Registry
from edgecache.cache.registry_match import RegistryMatch, check_registry, shown_url
from edgecache.cache.units import format_bytes
from edgecache.clients.channels import bearer, describe, health_pings, open_channel
from edgecache.clients.topology import Schedule, Topology
from edgecache.v1 import edge_pb2, edge_pb2_grpc
from edgecache.v1 import manifest_pb2 as pb

# The package's logger, as before the split: log lines still name edgecache.clients.ops.
log = logging.getLogger(__package__)


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


def copies_not_checked(registry: str, whose: str) -> str:
    """What ``status`` and ``doctor`` say when :func:`registry_digests` read nothing (None)."""
    return (
        f"the registry {shown_url(registry)} could not be read (in time): {whose} copies "
        "were not checked against it"
    )


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
