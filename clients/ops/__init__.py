"""What the ops CLI does, as functions: gather state, plan, warm, evict, check readiness.

The CLI (``clients/cli/``) only parses arguments, calls these and renders
what they return; everything that talks to the registry or to nodes lives
here, so scripts and tests can call it directly. Node errors come back as
data (a report's ``error``, an item's ``failures``) where one node failing
must not stop the others, and as :class:`~edgecache.cache.errors.EdgeCacheError`
otherwise; never as ``grpc.RpcError``.

The submodules, one concern each (every public name is re-exported here):

- ``status``: what the nodes say (:class:`NodeReport`), outages, holdings, state problems.
- ``planning``: resolving and sizing a schedule's versions, room and pins, :func:`make_plan`.
- ``staging``: :class:`WarmItem`, :func:`stage_item`, :func:`warm`, outages found staging.
- ``readiness``: :func:`ready` and :func:`wait_ready`, whose rounds end by their deadline.
- ``eviction``: :func:`evict`, and :func:`version_unfit` (why staging a version would fail).
- ``warm_record``: warm's record in the registry (its jobs and pins), :func:`pinned_jobs`.
- ``at_start``: the version a started job's ``name`` read, from the registry's publish times.

A test patches a name on the submodule whose code looks it up
(``ops.readiness.gather_status`` for :func:`wait_ready`), not on this package.
"""

from edgecache.clients.ops.eviction import EvictResult, Unfit, evict, version_unfit
from edgecache.clients.ops.planning import DEFAULT_BANDWIDTH as DEFAULT_BANDWIDTH
from edgecache.clients.ops.planning import (
    foreign_pins,
    held_manifests,
    make_plan,
    resolve_specs,
    version_sizes,
    without_pins,
)
from edgecache.clients.ops.planning import share_overflow as share_overflow
from edgecache.clients.ops.readiness import Readiness, ready, status_call_timeout, wait_ready
from edgecache.clients.ops.staging import (
    WarmItem,
    peers_refused_text,
    stage_item,
    warm,
    warm_item_for_version,
    warm_items_for_plan,
)
from edgecache.clients.ops.staging import lost_outages as lost_outages
from edgecache.clients.ops.staging import other_registries as other_registries
from edgecache.clients.ops.status import DIGESTS_TIMEOUT as DIGESTS_TIMEOUT
from edgecache.clients.ops.status import (
    Holding,
    NodeReport,
    Outage,
    complete_versions,
    copies_not_checked,
    gather_status,
    holdings,
    region_nodes,
    region_outages,
    registry_digests,
    state_problems,
    unreachable_regions,
)
from edgecache.clients.ops.status import replica_names as replica_names
from edgecache.clients.ops.warm_record import WARMED_JOBS as WARMED_JOBS
from edgecache.clients.ops.warm_record import (
    PinnedJob,
    WarmPin,
    dropped_warm_pins,
    local_registry,
    other_readers,
    pinned_jobs,
    record_warmed_jobs,
    schedule_owner,
    warm_readers,
)
from edgecache.clients.ops.warm_record import warm_started as warm_started

# Public names outside __all__ (imported with ``as`` above) are re-exported as they were:
# the CLI and the executor use some of them (ops.lost_outages, replica_names).
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
    "peers_refused_text",
    "stage_item",
    "status_call_timeout",
    "version_sizes",
    "held_manifests",
    "Outage",
    "region_nodes",
    "region_outages",
    "copies_not_checked",
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
