"""Staging versions on nodes: ``warm``'s and the controller's ``Stage`` calls.

:func:`stage_item` splits a :class:`WarmItem`'s shards among the nodes that answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

import grpc

from edgecache.cache import rendezvous
from edgecache.cache.names import parse_spec
from edgecache.cache.planner import Plan
from edgecache.cache.registry_match import RegistryMatch, check_registry
from edgecache.clients.channels import bearer, describe, health_pings, node_error, open_channel
from edgecache.clients.ops.status import NodeReport, Outage, region_nodes
from edgecache.clients.topology import Schedule, Topology
from edgecache.v1 import edge_pb2, edge_pb2_grpc
from edgecache.v1 import manifest_pb2 as pb


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
    # Peers that refused the staging node for its configuration (its peer token, TLS):
    # the version came from origin instead of the peers the plan chose, as each version
    # staged from them will until that setting is fixed (bad input, as a refused token is).
    peers_refused: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def moved_bytes(self) -> int:
        """Bytes the nodes' Stage progress said they moved: from origin and from peers."""
        return self.origin_bytes + self.peer_bytes


def peers_refused_text(spec: str, region: str, peers: Sequence[str]) -> str:
    """What ``warm`` and the controller say of a version its peers refused to give."""
    return (
        f"{spec} in {region} came from origin, not from its peers as planned: "
        f"{', '.join(peers)} refused the staging node for its configuration (its notes "
        "name the setting to fix on the region's nodes, such as peer_token_file): each "
        "version staged from those peers comes from origin until it is fixed"
    )


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
            if node not in item.names and item.names:
                # Down since before this run: its id, which decides its share beside the
                # others' ids, is unknown; a count worked out from its address was wrong.
                item.notes.append(
                    f"{silent}: its share was staged on {', '.join(live)} (how many of the "
                    f"{item.shard_count} shards it owns depends on its node id, unknown while "
                    "it is down)"
                )
                continue
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
            item.peers_refused.extend(p for p in event.peers_refused if p not in item.peers_refused)
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
