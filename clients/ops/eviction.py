"""Evicting versions from nodes, and why staging a version would only evict and then fail."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc

from edgecache.cache.errors import AccessDenied, InvalidName, VersionNotFound, VersionPinned
from edgecache.cache.names import parse_spec
from edgecache.cache.planner import VersionKey
from edgecache.cache.registry import Registry
from edgecache.cache.registry_match import registry_key, shown_url
from edgecache.cache.units import format_bytes
from edgecache.clients.channels import bearer, edge_stub, node_error
from edgecache.clients.ops.planning import _room, held_manifests, share_overflow, version_sizes
from edgecache.clients.ops.status import (
    NodeReport,
    _resident,
    gather_status,
    holdings,
    region_nodes,
)
from edgecache.clients.ops.warm_record import _pinned_message
from edgecache.clients.topology import Topology
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb


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


def listing_command(registry: str, dataset: str, config_flag: str = "") -> str:
    """``edgecache versions DATASET`` for ``registry``, as a user can paste it.

    With ``--registry URL`` wherever the topology at hand may not name it; a URL
    that carries credentials is printed without them (:func:`shown_url`) and
    would not be read so: that listing reads the topology this command read
    (``config_flag``: its ``--config``, or none for ``./edgecache.yaml``).
    """
    if shown_url(registry) != registry:
        return f"edgecache versions {dataset}{config_flag}"
    return f"edgecache versions {dataset} --registry {registry_key(registry)}"


def evict(
    topology: Topology,
    spec: str,
    *,
    region: str | None = None,
    token: str | None = None,
    force: bool = False,
    now: datetime | None = None,
    flags: str = "",
    config_flag: str = "",
) -> list[EvictResult]:
    """Drop ``NAME@N`` from every node of ``region`` (or of every region).

    Refused (:class:`VersionPinned`, naming the jobs and the command that
    releases their pins, with ``flags``: the caller's ``--config`` and
    ``--token-file``; ``config_flag``, the ``--config`` alone, for a listing of the
    registry that does not print its credentials) while any of those nodes
    pins the version for a scheduled job, unless ``force``; a version neither
    published nor held anywhere is :class:`VersionNotFound`. Every node is
    asked even when one fails; failures come back in ``error``. A node that
    answers NOT_FOUND holds nothing of the version (the version is no longer
    published, and another node still held it): 0 bytes freed there, not a
    failure; only when every node says so does nobody know the version, and
    that is :class:`VersionNotFound`.
    """
    parsed = parse_spec(spec, latest=False)
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
        raise VersionPinned(_pinned_message(topology, f"{key[0]}@{key[1]}", pins, now, flags=flags))
    # The registry as a URL (a local path is read as its absolute file:// URL, as the
    # other commands show it), and a command that lists it whatever topology is at hand.
    registry = registry_key(topology.registry)
    unknown = VersionNotFound(
        f"{spec} is neither published in {registry} nor held by any node of "
        f"{', '.join(regions)}; list versions with: "
        + listing_command(topology.registry, parsed.dataset, config_flag)
    )
    # Only nodes that answered said they hold nothing of it: with one down, it may hold
    # the version (the registry may have dropped it since), so every node is asked and
    # the down one is a failure (exit 1, retry), not "unknown version" (exit 2).
    if not held and all(r.status is not None for r in reports):
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
