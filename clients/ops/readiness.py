"""Whether a version is staged in a region: ``ready`` once, or waited for to a deadline."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from edgecache.clients.ops.status import (
    NodeReport,
    _other_content_text,
    _same_content,
    _share,
    gather_status,
    region_nodes,
    replica_names,
)
from edgecache.clients.topology import Topology
from edgecache.v1 import manifest_pb2 as pb


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


@dataclass(frozen=True)
class Readiness:
    """Whether a version is staged in a region, and what is missing if not."""

    ok: bool
    message: str
    timed_out: bool = False
    waited_seconds: float = 0.0
    # A node serves but refused this command's credentials: bad input, which no wait mends.
    refused: bool = False
    # A node of the region did not answer (the round the verdict is of): beside a refusal,
    # a failure (exit 1) as ``status`` counts it, not bad input alone.
    silent: bool = False


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


def _any_silent(reports: Sequence[object], region: str, *, refusing: bool = True) -> bool:
    """Whether a node of ``region`` did not answer in ``reports`` (anything else is kept).

    ``refusing=False``: not counting a node that refused this command's credentials.
    """
    return any(
        isinstance(r, NodeReport)
        and r.region == region
        and r.status is None
        and (refusing or not r.refused)
        for r in reports
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
    silent = False  # a node of the region did not answer, the last round

    def check(budget: float) -> tuple[bool, str, bool]:
        """(ready, why, whether the verdict holds: every node answered or had its time)."""
        nonlocal refused, silent
        call = status_call_timeout(budget, pings=_READY_PINGS, longest=_READY_CALL_SECONDS)
        reports = gather_status(topology, call, token=token, regions={region}, pings=_READY_PINGS)
        ok, message = ready(reports, region, manifest)
        refused = _refused_in(reports, region)
        silent = _any_silent(reports, region, refusing=False)
        return ok, message, call >= _READY_TRUSTED_CALL_SECONDS or not _any_silent(reports, region)

    if timeout is None:
        ok, message, _ = check(_READY_CALLS * _READY_CALL_SECONDS)
        waited = time.monotonic() - started
        return Readiness(
            ok, message, waited_seconds=waited, refused=refused and not ok, silent=silent
        )
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
            waited = time.monotonic() - started
            return Readiness(False, said, waited_seconds=waited, refused=True, silent=silent)
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
