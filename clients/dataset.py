"""EdgeDataset: a PyTorch IterableDataset that streams pinned dataset versions from edge nodes.

.. code-block:: python

    ds = EdgeDataset("tokens-en@3", endpoints=["eu-1:7070", "eu-2:7070"], batch_size=256,
                     columns=["input_ids", "label"], shuffle=True, seed=17)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in loader:  # dict[str, torch.Tensor]
            batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}

Guarantees (see :mod:`edgecache.clients.epoch_order` for how):

* every batch draws from ``shuffle_windows`` windows spread over the stored
  order, when the version has at least ``8 * lanes * shuffle_windows`` windows
  (2 GiB at the defaults and 4 MiB chunks; fewer windows, fewer per batch: a
  warning says so and names a ``window_bytes`` that restores it); memory about
  ``lanes * shuffle_windows * window_bytes`` plus the read-ahead;
* every sample exactly once per epoch across all ranks and workers
  (``drop_last=False``), as many batches on every rank, at most one partial
  (or a last batch split in two to step as often as the others); with
  ``drop_last=True`` the same number of full batches on every rank and no
  sample twice;
* the same (versions, seed, epoch) gives the same global order on any machine,
  for any number of DataLoader workers, world size or batch size; a rank's
  batches are the same for any number of workers, while another world size or
  batch size cuts the same epoch into other batches;
* ``state_dict()`` resumes with other workers, endpoints or regions, and at
  another world size or batch size (elastic) with exactly the samples not yet
  consumed this epoch. With ``num_workers > 0`` pass
  ``state_dict(batches=steps)``: steps since the last resume, or the epoch's start.
* a mapping spec ``{"web@3": 0.7, "code@2": 0.3}`` reads a weighted mixture
  (:mod:`edgecache.clients.mixture`); ``rows=`` reads a stable split.

Reading runs on background threads of the iterating process. With
``num_workers=0`` batches land directly in pinned memory when CUDA is
available; with workers, each runs its share of the threads and read-ahead
and hands batches over through a shared ring (no pickling of sample data;
binary and string columns come as :class:`~edgecache.clients.packed.Packed`
tensors by default for that reason). docs/dataset.md says how to choose.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import pickle
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from edgecache.cache import recycled
from edgecache.cache.codec import MIN_CHUNK_BYTES
from edgecache.cache.errors import (
    AllNodesFailed,
    CacheDirError,
    EdgeCacheError,
    InvalidEndpoint,
    ManifestError,
    VersionNotFound,
)
from edgecache.cache.manifest import manifest_from_bytes, manifest_schema
from edgecache.cache.names import VersionSpec
from edgecache.cache.row_grid import row_bytes, rows_per_window, version_chunk_bytes
from edgecache.clients import fork_safety, local_stores
from edgecache.clients.batch_memory import (
    BatchMemory,
    PinnedMemory,
    attach,
    shared_memory,
)
from edgecache.clients.dataset_metrics import (
    Carried,
    ClientCounters,
    arrived,
    carried,
    port_from_environment,
    register,
    serve,
)
from edgecache.clients.dataset_readers import Readers, merge
from edgecache.clients.dataset_state import (
    FORMAT,
    SharedPosition,
    make_state,
    order_style,
    resume_from,
)
from edgecache.clients.endpoints import Endpoint, parse_endpoint
from edgecache.clients.epoch_order import Component, EpochOrder, Remaining
from edgecache.clients.mixture import (
    allocate,
    check_distinct,
    check_shares,
    parse_mixture,
    parse_rows,
    split_extents,
)
from edgecache.clients.node_pool import NodePool
from edgecache.clients.packed import Packed
from edgecache.clients.pipeline import Pipeline
from edgecache.clients.read_target import ReadTarget
from edgecache.clients.shuffle import MIN_STREAM_WINDOWS, GlobalOrder
from edgecache.clients.tensors import BinaryForm, RaggedForm, with_forms
from edgecache.clients.topology import nodes_nearest_first
from edgecache.clients.versions import fetch_manifest, local_manifest, select_columns
from edgecache.v1 import manifest_pb2 as pb

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["EdgeDataset", "Sample", "collate_samples"]

log = logging.getLogger(__name__)
_said_unpinned = False
T = TypeVar("T")
# Far more than any rank's DataLoader workers; the order is built lane by lane, in time
# that grows faster than their number (10,000 lanes 0.3 s, 50,000 2.6 s).
MAX_LANES = 4096


def _distributed() -> tuple[int, int] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The process's rank and world size: given, else torch.distributed's, else torchrun's.

    Both or neither: one alone would be paired with a default from elsewhere
    (``world_size=2`` alone read rank 0's share in every process). Without an
    initialised process group, ``$RANK`` / ``$WORLD_SIZE`` (as torchrun sets them)
    count, so a dataset made before ``init_process_group`` still reads its share,
    not the whole epoch in every process; one of them alone is refused for the same
    reason (``WORLD_SIZE=4`` alone read the whole epoch in each of the four).
    """
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"got rank={rank!r} and world_size={world_size!r}: pass both, or neither to take "
            "them from torch.distributed (or torchrun's RANK and WORLD_SIZE)"
        )
    if rank is not None and world_size is not None:
        # Any integer (np.int64 from a launcher's arithmetic) but never a bool.
        found = (_integer("rank", rank, minimum=0), _integer("world_size", world_size, minimum=1))
    elif (dist := _distributed()) is not None:
        found = dist
    elif "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        found = _environment_rank()
    else:
        found = (0, 1)
    if not 0 <= found[0] < found[1]:
        raise ValueError(
            f"rank must be in 0..world_size-1, got rank={found[0]!r}, world_size={found[1]!r}"
        )
    return found


def _environment_rank() -> tuple[int, int]:
    """``$RANK`` and ``$WORLD_SIZE``: both, as integers, or a ValueError saying which to fix."""
    texts = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE")}
    missing = [name for name, text in texts.items() if text is None]
    if missing:
        given = next(f"{n}={t!r}" for n, t in texts.items() if t is not None)
        raise ValueError(
            f"{given} is set but {missing[0]} is not: each process would read as rank 0 of 1 "
            f"(the whole epoch); set both (torchrun does), unset {given.split('=')[0]}, or "
            "pass rank= and world_size="
        )
    try:
        rank, world = int(texts["RANK"]), int(texts["WORLD_SIZE"])  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(
            f"RANK={texts['RANK']!r} and WORLD_SIZE={texts['WORLD_SIZE']!r} "
            "are not integers; fix them, or pass rank= and world_size="
        ) from None
    if not 0 <= rank < world:  # said as the environment's, not as rank= the caller never gave
        raise ValueError(
            f"$RANK={texts['RANK']} and $WORLD_SIZE={texts['WORLD_SIZE']}: the rank must be in "
            "0..WORLD_SIZE-1; fix the environment, or pass rank= and world_size="
        )
    return rank, world


def _column_names(columns: str | Sequence[str] | None) -> list[str] | None:
    """``columns=`` as a list of names: one string is one column, none twice, not empty."""
    if columns is None:
        return None
    if isinstance(columns, str):
        names = [columns]
    elif isinstance(columns, Mapping):  # its keys, quietly: {"label": 1} meant something else
        raise ValueError(
            f"columns must be a column name or a list of names, got a mapping {columns!r}; "
            f"pass a list of the names to read: {list(columns)!r}"
        )
    elif isinstance(columns, (set, frozenset)):
        # A set's order is the process's string hashing: ranks and a resumed run each saw
        # another order of the same columns (a helper's hunt found sets taken silently).
        raise ValueError(
            f"columns must be a column name or a list of names, got a set {columns!r}, whose "
            f"order differs from process to process; pass a list: {sorted(columns)!r}"
        )
    elif isinstance(columns, Iterable) and not isinstance(columns, bytes):
        names = list(columns)
    else:  # list(3) was a bare TypeError that named no parameter
        raise ValueError(
            f"columns must be a column name or a list of names, got {columns!r}; pass None for all"
        )
    strange = [n for n in names if not isinstance(n, str) or not n]
    if strange:
        raise ValueError(f"columns must name columns (non-empty strings), got {strange!r}")
    if not names:
        raise ValueError("columns=[] selects nothing; name at least one, or pass None for all")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"columns names {twice} more than once; name each column once")
    return names


def _integer(name: str, value: Any, *, minimum: int | None = None, optional: bool = False) -> Any:
    """``value`` as a plain int, or a ValueError naming ``name`` and what it must be.

    Any integer counts (an ``np.int64`` computed from the versions' sizes) but
    never a bool: ``True`` would quietly be 1. ``optional`` lets None through.
    """
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
        if minimum is None or number >= minimum:
            return number
    what = {None: "an integer", 0: "an integer >= 0", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}"
    )
    raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")


def _boolean(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else a ValueError: ``"False"`` would read as true."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def _is_local(text: Any) -> bool:
    """Whether an endpoint names a local cache (``lmdb://``), which may go beside config=."""
    return parse_endpoint(text).local


def _seconds(name: str, value: Any) -> float:
    """``value`` as a positive float of seconds, or a ValueError naming ``name``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
        if math.isfinite(seconds) and seconds > 0:
            return seconds
    raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _check_row_numbers(
    rows: tuple[float, float] | tuple[int, int] | None,
    names: Sequence[str],
    manifests: Sequence[pb.Manifest],
) -> None:
    """Row numbers past a version's last row are a ValueError, not a split quietly cut short."""
    if rows is None or not all(isinstance(x, int) for x in rows):
        return
    for name, manifest in zip(names, manifests, strict=True):
        total = sum(s.row_count for s in manifest.shards)
        if rows[1] > total:
            raise ValueError(
                f"rows={rows!r}: {name} has {total} rows, so row numbers go up to {total}; "
                "give a smaller end, or fractions ((0.0, 1.0) is every row)"
            )


def _size(nbytes: float) -> str:
    """``nbytes`` as a short human size: 512 KiB, 4 MiB, 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} GiB"


def _name_in_message(exc: BaseException, version: str) -> None:
    """Put ``version`` in the message of ``exc`` too, when its message is one plain string.

    A note shows in a traceback, but not in ``str(exc)``: what a training loop logs
    (a DataLoader worker's error reaches the loop with its notes in the message, so
    only ``num_workers=0`` lacked it). Errors that format their own message keep it.
    """
    if (
        type(exc).__str__ is BaseException.__str__
        and len(exc.args) == 1
        and isinstance(exc.args[0], str)
        and version not in exc.args[0]
    ):
        exc.args = (f"{exc.args[0]} (reading {version})",)


def _portable(exc: Exception) -> Exception:
    """``exc`` as it can cross to the other ranks: a copy if it pickles whole, else its text."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc) and str(copy) == str(exc):
            return copy  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001, S110 - any failure to pickle: send what it says
        pass
    return EdgeCacheError(f"{type(exc).__name__}: {exc}")


def _by_rank(values: Sequence[Any]) -> str:
    """``rank 0: 5, rank 1: 6``: each value with the ranks that hold it (a few named)."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), []).append(rank)
    parts = []
    for text, ranks in groups.items():
        named = ", ".join(map(str, ranks[:4])) + (
            f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
        )
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {named}: {text}")
    return ("; " if any(len(r) > 1 for r in groups.values()) else ", ").join(parts)


def _check_component_column(
    name: str, kinds: Sequence[Any], schemas: Sequence[pa.Schema], components: Sequence[str]
) -> None:
    """Refuse a ``component_column`` that is a column of the batches or of a component.

    A name a component holds, though the mixture leaves it out (not every component
    has it), read as that data ("label") while it held component indices.
    """
    batch = {k.name for k in kinds} | {f"{k.name}_lengths" for k in kinds if k.kind == "ragged"}
    if name in batch:
        raise ValueError(
            f"component_column {name!r} names a column of the batches: choose another name"
        )
    holders = [c for c, schema in zip(components, schemas, strict=True) if name in schema.names]
    if holders:
        raise ValueError(
            f"component_column {name!r} names a column of {', '.join(holders)} that the "
            "batches leave out (columns=, or not every component has it); it would read "
            "as that data: choose another name"
        )


def kept_rows(manifests: Sequence[pb.Manifest], rows: object) -> list[Any]:
    """The rows a ``rows=`` value keeps of each version: what fixes the order.

    ``(0.5, 1.0)`` and ``(10000, 20000)`` of 20,000 rows are one split, for the
    ranks' check and for resuming a state alike. A value ``rows=`` would refuse
    (a state may hold anything) raises ValueError, as :func:`parse_rows` does.
    """
    cut = parse_rows(rows)
    return [split_extents([s.row_count for s in m.shards], cut) for m in manifests]


def _differing_order(every: Sequence[dict[str, Any]], manifests: Sequence[pb.Manifest]) -> str:
    """What differs across ranks among the settings the global order depends on ('' if none).

    ``every``: each rank's settings as given (see ``EdgeDataset.__init__``), in rank
    order. Settings that come to the same order are the same: ``window_bytes=None``
    and the chunk size give the same windows, ``samples_per_epoch=None`` and the
    rows' count the same epoch, weights 0.7 / 0.3 and 7 / 3 the same shares, a
    fraction and the row it falls on the same split; without ``shuffle`` on any
    rank, ``seed`` and ``shuffle_windows`` choose nothing and are not compared.
    """

    def windows(window_bytes: int | None) -> list[int]:
        sizes = [window_bytes or version_chunk_bytes(m) for m in manifests]
        return [
            rows_per_window(row_bytes(m, manifest_schema(m)), size)
            for m, size in zip(manifests, sizes, strict=True)
        ]

    def epoch_samples(given: int | None, rows: Any) -> int:
        cut = None if rows is None else tuple(rows)
        return given or sum(
            e.rows for m in manifests for e in split_extents([s.row_count for s in m.shards], cut)
        )

    def shares(settings: dict[str, Any]) -> list[int] | None:
        weights = settings["weights"]
        total = epoch_samples(settings["samples_per_epoch"], settings["rows"])
        return None if weights is None else allocate(weights, total)

    same_as: dict[str, Any] = {
        "window_bytes": lambda s: windows(s["window_bytes"]),
        "samples_per_epoch": lambda s: epoch_samples(s["samples_per_epoch"], s["rows"]),
        "weights": shares,
        "rows": lambda s: kept_rows(manifests, s["rows"]),
    }
    # Without shuffling, the seed and the windows a batch mixes choose nothing: ranks
    # seeded per rank (for their own augmentation) read one order all the same.
    unused = {"seed", "shuffle_windows"} if not any(s["shuffle"] for s in every) else set()
    said = []
    for key in every[0]:
        if key in unused:
            continue
        values = [s[key] for s in every]
        if all(v == values[0] for v in values):
            continue
        derived = same_as.get(key)
        if derived is not None and all(derived(s) == derived(every[0]) for s in every):
            continue
        what = "dataset spec" if key == "spec" else key
        hint = (
            "; seed per-rank augmentation elsewhere (each rank reads its own share of one "
            "shuffled order already)"
            if key == "seed"
            else ": each rank reads its share of one global order, which depends on it"
        )
        said.append(
            f"{key} {'differ' if key in ('weights', 'rows') else 'differs'} across ranks "
            f"({_by_rank(values)}): every rank must build "
            f"EdgeDataset with the same {what}{hint}"
        )
    return "\n".join(said)


class Sample(dict):  # type: ignore[type-arg]
    """One sample (``batch_size=None``): a dict that knows its variable-length columns.

    Why: torch's ``default_collate`` stacks each column, and cannot stack the
    samples of a variable-length list column (``[7]`` and ``[3]`` tokens: "stack
    expects each tensor to be equal size"). This type is registered with
    ``default_collate`` (``default_collate_fn_map``, the extension point torch
    documents), so ``DataLoader(ds, batch_size=k)`` batches samples as
    ``EdgeDataset(batch_size=k)`` would (:func:`collate_samples`).
    """

    __slots__ = ("counts", "forms")

    def __init__(
        self,
        values: Mapping[str, Any],
        forms: Mapping[str, str],
        counts: tuple[Any, ...] | None = None,
    ) -> None:
        super().__init__(values)
        # column -> "ragged" (padded), "packed" (a numeric list), "binary" or "string"
        # (packed bytes or text), or "list" (kept as Python objects)
        self.forms = forms
        # What a DataLoader worker read for it, for the main process's metrics: collated,
        # the batch carries its samples' counts; sent alone, the sample counts them there.
        self.counts = counts

    def __copy__(self) -> Sample:
        return Sample(self, self.forms, self.counts)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_sample_arrives, (dict(self), self.forms, self.counts))


def _sample_arrives(
    values: dict[str, Any], forms: Mapping[str, str], counts: tuple[Any, ...] | None
) -> Sample:
    """A sample unpickled in the main process (``DataLoader(batch_size=None)``): counted."""
    if counts is not None:
        arrived(counts)
    return Sample(values, forms)


def _packed(name: str, items: Sequence[Any]) -> Packed:
    """Per-sample 1-D tensors of one list column as one ``Packed`` (a batch's form)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in items):
        raise TypeError(f"column {name!r}: expected each sample's value as a 1-D tensor")
    return Packed(torch.cat([t.cpu() for t in items]), _offsets(items), "list")


def _offsets(items: Sequence[Sized]) -> torch.Tensor:
    """``[0, len(items[0]), ...]`` running sums: where each item starts in a ``Packed``."""
    offsets = torch.zeros(len(items) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor([len(t) for t in items], dtype=torch.int64), 0, out=offsets[1:])
    return offsets


def _packed_bytes(name: str, items: Sequence[Any], kind: str) -> Packed:
    """Per-sample ``bytes`` (``kind="binary"``) or ``str`` (``"string"``) as one ``Packed``."""
    if kind == "string":
        if not all(isinstance(t, str) for t in items):
            raise TypeError(f"column {name!r}: expected each sample's value as a str")
        raw = [t.encode() for t in items]
    else:
        if not all(isinstance(t, (bytes, bytearray, memoryview)) for t in items):
            raise TypeError(f"column {name!r}: expected each sample's value as bytes")
        raw = [bytes(t) for t in items]
    joined = bytearray(b"".join(raw))
    values = (
        torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    )
    return Packed(values, _offsets(raw), kind)  # type: ignore[arg-type]


def collate_samples(
    batch: Sequence[Mapping[str, Any]], *, collate_fn_map: dict[Any, Any] | None = None
) -> dict[str, Any]:
    """Batch :class:`Sample` s as ``EdgeDataset(batch_size=len(batch))`` yields a batch.

    Variable-length lists of numbers become ``[B, longest]`` zero-padded
    (``ragged="padded"``, their ``<name>_lengths`` stacked beside them) or a
    ``Packed`` (``ragged="packed"``); bytes and strings a ``Packed`` again
    (``binary="packed"``, the default); Python-object columns stay a list; every
    other column is collated as ``default_collate`` does. ``default_collate``
    calls this for a batch of samples; a custom ``collate_fn`` may call it too.
    """
    forms = getattr(batch[0], "forms", {})
    out: dict[str, Any] = {}
    for key in batch[0]:
        items = [sample[key] for sample in batch]
        form = forms.get(key)
        if form == "list":
            out[key] = items
        elif form == "ragged":
            out[key] = _packed(key, items).padded()[0]
        elif form == "packed":
            out[key] = _packed(key, items)
        elif form in ("binary", "string"):
            out[key] = _packed_bytes(key, items, form)
        else:
            out[key] = collate(items, collate_fn_map=collate_fn_map or default_collate_fn_map)
    counts = carried(getattr(sample, "counts", None) for sample in batch)
    return out if counts is None else Carried(out, counts)


default_collate_fn_map[Sample] = collate_samples


class EdgeDataset(IterableDataset):  # type: ignore[type-arg]
    """Stream pinned dataset versions (one, or a weighted mixture) from the nearest healthy node.

    Args:
        spec: ``name``, ``name@latest`` or ``name@N``; or a mapping of such specs to
            positive weights for a mixture. Resolved once, here, and pinned.
        endpoints: ``host:port``, ``grpcs://host:port`` or ``lmdb:///cache/dir`` entries
            (one endpoint may be given as a plain string).
        config / region: read the endpoints from a topology file (edgecache.yaml)
            instead of ``endpoints``; the region's nodes come first (its replicas, which
            split shards), other regions' after them. ``endpoints`` may go beside them
            only as ``lmdb://`` caches on this host (a node's cache directory), read
            first: the shards they lack come from the topology's nodes.
        batch_size: samples per batch; ``None`` yields one sample at a time (a
            :class:`Sample`, which `DataLoader(batch_size=k)` batches as ``k`` would).
        columns: columns to read, each once (one may be given as a plain string;
            default: all; for a mixture, those every component has with the same type).
        shuffle / seed: deterministic shuffling (see ``shuffle_windows``).
        rank / world_size: both or neither; default from torch.distributed when
            initialised, else ``$RANK`` / ``$WORLD_SIZE`` (torchrun's), else 0 / 1.
        drop_last: drop partial batches; every rank then yields the same number.
        pin_memory: ``"auto"`` pins when CUDA is available (in the main process).
        binary: ``"packed"`` (default): binary and string columns as a
            :class:`~edgecache.clients.packed.Packed` (one uint8 tensor of the values
            plus offsets; crosses DataLoader workers through shared memory, pins, reads
            like a list); ``"list"``: a Python list of ``bytes`` / ``str``.
        ragged: variable-length lists of numbers as ``"padded"`` (default: ``[B,
            longest]`` plus ``<name>_lengths``) or ``"packed"`` (a ``Packed``).
        prefetch_bytes: the most decoded bytes read ahead beyond the windows in use;
            the read-ahead starts at two windows and grows while the consumer waits
            (and reading is not the limit). Per rank: DataLoader workers share it.
            32 MiB read as fast as 128 MiB on loopback, with less memory (see
            docs/dataset.md "Read-ahead and memory").
        threads: fetch/decode threads per rank (DataLoader workers share them, at
            least one each).
        window_bytes: bytes of consecutive rows read and shuffled as one window
            (default: the version's chunk size, so windows are whole chunks).
        shuffle_windows: windows each batch is drawn from (per lane). 1 is the plain
            window shuffle: each batch cut from one window. Memory is about
            ``lanes * shuffle_windows * window_bytes``. Capped at ``windows // (8 *
            lanes)`` (a warning says when): small versions need a smaller
            ``window_bytes`` (or smaller chunks) to mix as much.
        lanes: groups of windows read side by side; ``num_workers`` dividing it keeps
            each worker on its own windows.
        samples_per_epoch: epoch length of a mixture (default: all rows of its
            components); component ``i`` gives ``round(w_i * samples_per_epoch)``.
        rows: ``(start, end)`` of each version's canonical row order, as fractions
            (``(0.0, 0.95)``) or row numbers: splits that never overlap.
        component_column: also yield this column: each sample's component index
            (into :attr:`components`); a non-empty string.
        token: bearer token for nodes that require one for reads.
        stall_timeout: seconds without a chunk before a stream that has started
            delivering is abandoned (its first chunk may take up to 120 s: a miss
            fetches and preprocesses the shard from origin first).
        retry_timeout: seconds without progress on any node before giving up.
        metrics_port: serve this process's reading metrics (``edgecache_client_*``)
            for Prometheus on this port (0: any free port, see :attr:`metrics_port`);
            default from ``$EDGECACHE_CLIENT_METRICS_PORT``, else none.
    """

    def __init__(
        self,
        spec: str | Mapping[str, float],
        *,
        endpoints: str | Sequence[str] | None = None,
        config: str | os.PathLike[str] | None = None,
        region: str | None = None,
        batch_size: int | None = 256,
        columns: str | Sequence[str] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        pin_memory: bool | str = "auto",
        binary: BinaryForm = "packed",
        ragged: RaggedForm = "padded",
        prefetch_bytes: int = 32 << 20,
        threads: int = 2,
        window_bytes: int | None = None,
        shuffle_windows: int = 16,
        lanes: int = 4,
        samples_per_epoch: int | None = None,
        rows: tuple[float, float] | tuple[int, int] | None = None,
        component_column: str | None = None,
        token: str | None = None,
        stall_timeout: float = 5.0,
        retry_timeout: float = 30.0,
        metrics_port: int | None = None,
    ) -> None:
        super().__init__()
        batch_size = _integer("batch_size", batch_size, minimum=1, optional=True)
        shuffle_windows = _integer("shuffle_windows", shuffle_windows, minimum=1)
        lanes = _integer("lanes", lanes, minimum=1)
        if lanes > MAX_LANES:  # building the order grows faster than the lanes: 1e6 never ended
            raise ValueError(
                f"lanes must be at most {MAX_LANES}, got {lanes}: lanes are what a rank's "
                "DataLoader workers divide, so a multiple of num_workers is enough (lanes=8 "
                "for 8 workers)"
            )
        threads = _integer("threads", threads, minimum=1)
        prefetch_bytes = _integer("prefetch_bytes", prefetch_bytes, minimum=0)
        # A string seed would shuffle by its hash: a different order in every process.
        seed = _integer("seed", seed)
        window_bytes = _integer("window_bytes", window_bytes, minimum=1, optional=True)
        samples_per_epoch = _integer(
            "samples_per_epoch", samples_per_epoch, minimum=1, optional=True
        )
        shuffle, drop_last = _boolean("shuffle", shuffle), _boolean("drop_last", drop_last)
        stall_timeout = _seconds("stall_timeout", stall_timeout)
        retry_timeout = _seconds("retry_timeout", retry_timeout)
        metrics_port = _integer("metrics_port", metrics_port, minimum=0, optional=True)
        if component_column is not None and (
            not isinstance(component_column, str) or not component_column
        ):
            # '' or 3 became a batch key of '' or 3, which no training loop looks up.
            raise ValueError(
                "component_column must be a non-empty string (the name of the batch key "
                f"holding each sample's component index) or None, got {component_column!r}"
            )
        mixture = parse_mixture(spec)
        self.rows = parse_rows(rows)
        if endpoints is None and config is None:
            raise InvalidEndpoint("pass endpoints=[...] or config='edgecache.yaml' (and region=)")
        replicas: list[str] = []
        if isinstance(endpoints, bytes | bytearray) or not (
            endpoints is None or isinstance(endpoints, str | Iterable)
        ):  # 18600 was "'int' object is not iterable", b"host:port" endpoint 49 ('1')
            raise InvalidEndpoint(
                "endpoints must be a host:port or lmdb:// string, or a list of them, got "
                f"{endpoints!r} ({type(endpoints).__name__})"
            )
        if config is not None and not isinstance(config, str | os.PathLike):
            raise InvalidEndpoint(
                f"config must be the path of a topology file, got {config!r} "
                f"({type(config).__name__})"
            )
        if config is None and region is not None:
            # Before the "not both" advice below, whose "drop endpoints=" needs a config=.
            raise InvalidEndpoint(
                f"region={region!r} names a region of a topology file: pass config= with it"
                + (", or drop region=" if endpoints is not None else "")
            )
        # One endpoint given as a string is one endpoint, not a list of characters.
        given = [endpoints] if isinstance(endpoints, str) else list(endpoints or [])
        both = endpoints is not None and (config is not None or region is not None)
        if both and not (given and all(_is_local(t) for t in given)):
            # Given both, endpoints were used as they stand: the region's nodes neither came
            # first nor served as its replicas, and nothing said the topology went unread.
            ignored = [k for k, v in (("config", config), ("region", region)) if v is not None]
            raise InvalidEndpoint(
                f"pass endpoints=[...] or config= (with region=), not both: "
                f"{' and '.join(ignored)} would go unused beside endpoints; drop endpoints= to "
                "read the region's nodes from the topology file, or drop "
                f"{' and '.join(k + '=' for k in ignored)} (lmdb:// caches alone may be given "
                "beside config=: they are read first, the topology's nodes after them)"
            )
        if config is not None:
            # The host's own cache first (a node's lmdb:// directory), then the topology:
            # the shards that cache lacks (another replica's) come from their owners.
            nodes, replicas = nodes_nearest_first(config, region)
            texts = given + nodes
        else:
            texts = given
        if not texts:
            raise InvalidEndpoint("the endpoint list is empty; give at least one host:port")
        self.endpoints: list[Endpoint] = [parse_endpoint(t) for t in texts]
        if not all(e.local for e in self.endpoints):
            fork_safety.watch(self)
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        if token is not None and not (isinstance(token, str) and token and token == token.strip()):
            # A Path or bytes went out as its repr ("Bearer PosixPath(...)") and came back as
            # a refused token whose hint said to pass token=. The value is not echoed.
            raise ValueError(
                f"token must be the token's text, a non-empty str without surrounding "
                f"whitespace (got a {type(token).__name__}"
                + (" with surrounding whitespace" if isinstance(token, str) and token else "")
                + "): e.g. token=Path('read.token').read_text().strip()"
            )
        # 0, 1 and np.False_ passed an `in (True, False, "auto")` test (0 == False) and then
        # failed the `is False` ones below: pin_memory=0 pinned on a CUDA host.
        if not (isinstance(pin_memory, str) and pin_memory == "auto"):
            try:
                pin_memory = _boolean("pin_memory", pin_memory)
            except ValueError:
                raise ValueError(
                    f"pin_memory must be True, False or 'auto', got {pin_memory!r}"
                ) from None
        self.batch_size, self.drop_last = batch_size, drop_last
        self.shuffle, self.seed = shuffle, seed
        self.lanes, self.shuffle_windows = lanes, shuffle_windows
        self.pin_memory_setting = pin_memory
        self.prefetch_bytes, self.threads, self.window_bytes = prefetch_bytes, threads, window_bytes
        self._pool_args = {
            "token": token,
            "stall_timeout": stall_timeout,
            "retry_timeout": retry_timeout,
            "replicas": replicas,
        }
        self._open: Readers | None = None
        self._pid = os.getpid()
        self._epoch = 0
        self._cursor = 0  # canonical batches yielded in this stretch of the epoch (this process)
        self._remaining: Remaining | None = None  # None: the whole epoch is left
        self._orders: dict[tuple[int, int, bool, bool], EpochOrder] = {}
        # (seed, epoch, format) resumed from a state saved before format 6: that epoch is
        # read in the order of the state's format (dataset_state.order_style).
        self._old_order: tuple[int, int, int] | None = None
        self._delivered = {"samples": 0, "batches": 0, "wait_seconds": 0.0}
        # What closed pools saw (stats() adds the open one's): bytes, failures, failovers.
        self._closed_endpoints: dict[str, dict[str, Any]] = {}
        self._closed_failovers = 0
        self._watched = False  # watch() measures the loop's wait (and the pipeline's is not)
        self._last_pipeline: dict[str, float] = {}
        self.manifests = self._resolve(
            mixture.specs,
            {
                "spec": [str(v) for v in mixture.specs],
                "weights": None if mixture.single else list(mixture.weights),
                "seed": seed,
                "shuffle": shuffle,
                "shuffle_windows": shuffle_windows,
                "lanes": lanes,
                "window_bytes": window_bytes,
                "rows": None if self.rows is None else list(self.rows),
                "samples_per_epoch": samples_per_epoch,
            },
        )
        local_stores.check(self.endpoints, self.manifests)  # lmdb:// paths: once, here
        self.manifest = self.manifests[0]
        self.schemas = [manifest_schema(m) for m in self.manifests]
        self.schema = self.schemas[0]
        self.components = [f"{m.dataset}@{m.version}" for m in self.manifests]
        check_distinct(mixture, self.components)
        self.weights = None if mixture.single else list(mixture.weights)
        self.binary, self.ragged = binary, ragged
        self.kinds = with_forms(
            select_columns(self.schemas, self.components, _column_names(columns)),
            binary=binary,
            ragged=ragged,
        )
        self.columns = [k.name for k in self.kinds]
        if component_column is not None:
            _check_component_column(component_column, self.kinds, self.schemas, self.components)
        self.component_column = component_column
        self._row_bytes = [
            row_bytes(m, s) for m, s in zip(self.manifests, self.schemas, strict=True)
        ]
        self.window_rows = [
            rows_per_window(b, window_bytes or version_chunk_bytes(m))
            for b, m in zip(self._row_bytes, self.manifests, strict=True)
        ]
        _check_row_numbers(self.rows, self.components, self.manifests)
        extents = [
            split_extents([s.row_count for s in m.shards], self.rows) for m in self.manifests
        ]
        sizes = [sum(e.rows for e in ext) for ext in extents]
        needed = [{e.shard for e in ext} for ext in extents]
        local_stores.require_shards(self.endpoints, self.manifests, needed)
        for name, size in zip(self.components, sizes, strict=True):
            if size == 0:
                raise ValueError(f"{name} has no rows in rows={rows!r}; choose a wider range")
        self.samples_per_epoch = samples_per_epoch or sum(sizes)
        shares = (
            [self.samples_per_epoch]
            if mixture.single and samples_per_epoch is None
            else allocate([1.0] if mixture.single else mixture.weights, self.samples_per_epoch)
        )
        if not mixture.single:
            check_shares(self.components, mixture.weights, shares)
        self._components = [
            Component(name, ext, window_rows, share)
            for name, ext, window_rows, share in zip(
                self.components, extents, self.window_rows, shares, strict=True
            )
        ]
        self._counters = ClientCounters(
            self.rank, self._metrics_label(), [e.text for e in self.endpoints]
        )
        self._metrics_key = register(self._counters)
        port = metrics_port if metrics_port is not None else port_from_environment()
        self.metrics_port: int | None = None if port is None else serve(port)
        """Where this process serves its client metrics (``/metrics``), if it does."""
        # Where set_epoch / load_state_dict put the dataset, for persistent DataLoader workers
        # (their copy never sees those calls); see _take_position.
        self._position = SharedPosition()
        self._position_seen = 0  # the generation this copy wrote or took last
        self._own_position = True  # False while a pass runs: broken off, it is stale
        # Bumped by set_epoch and load_state_dict: a pass begun before one of them stops
        # at its next batch instead of counting its own order into the new position.
        self._placements = 0
        self._passes = 0  # passes this copy began in a DataLoader worker
        # Batches of the stretch the last pass read to its end (here, or by DataLoader
        # workers), until the next pass: state_dict(batches=that) means the finished epoch.
        self._finished_stretch: int | None = None
        # Where that pass began, when workers read it: the loop may still be taking its
        # last batches (read ahead), so fewer steps count from there (state_dict).
        self._finished_from: tuple[int, int, int, Remaining | None] | None = None
        # The workers' pass (and whether it was read whole) the training process followed.
        self._followed: tuple[Any, ...] | None = None
        self._said_uncounted = False  # the state_dict() warning, once
        self._publish_position()
        self._warn_about_order()

    # ------------------------------------------------------------ warnings

    def _warn_about_order(self) -> None:
        """Warn, once, here (never in DataLoader workers), where the order gives less than asked.

        Both used to be silent: a small version's batches each cut from one window
        whatever ``shuffle_windows`` said, and a rank with no sample yielding no
        batch (DDP then waits for it forever).
        """
        order = self._order(self.seed, self._epoch, None)
        share = order.total // self.world_size  # the fewest samples a rank holds
        if order.samples == 0 and self.drop_last and self.batch_size and share > 0:
            # Every rank alike (no DDP hang): the batch, not the ranks, is too large. Told
            # "use fewer ranks than samples" with fewer already, a user had no way out.
            extra = f" or {share + 1}" if order.total % self.world_size else ""
            warnings.warn(
                f"{self.version}: batch_size={self.batch_size} is more than each rank's "
                f"share of the epoch ({share}{extra} of its {order.total} samples "
                f"over {self.world_size} rank(s)), and drop_last=True drops partial batches: "
                f"every rank yields no batch. Use a batch_size of at most {share}, or "
                "drop_last=False",
                stacklevel=3,
            )
        elif order.samples == 0:
            warnings.warn(
                f"{self.version}: rank {self.rank} of {self.world_size} gets no sample of the "
                f"epoch's {order.total} and yields no batch; under DDP the other ranks then "
                "wait for it at their first collective until the process group's timeout. Use "
                "fewer ranks than samples, or read this version on fewer ranks",
                stacklevel=3,
            )
        per_lane = order.order.per_lane
        if self.shuffle and self.shuffle_windows > 1 and per_lane < self.shuffle_windows:
            warnings.warn(self._mixing_shortfall(len(order.order.windows), per_lane), stacklevel=3)

    def _per_lane(self, window_bytes: int) -> int:
        """Windows each batch would draw from in this epoch with windows of ``window_bytes``."""
        components = [
            Component(c.key, c.extents, rows_per_window(b, window_bytes), c.samples)
            for c, b in zip(self._components, self._row_bytes, strict=True)
        ]
        return GlobalOrder(
            components,
            seed=self.seed,
            epoch=self._epoch,
            lanes=self.lanes,
            shuffle_windows=self.shuffle_windows,
            shuffle=self.shuffle,
        ).per_lane

    def _mixing_shortfall(self, windows: int, per_lane: int) -> str:
        """What a version with too few windows for ``shuffle_windows`` gets, and what to do."""
        wanted = self.shuffle_windows
        needed = MIN_STREAM_WINDOWS * self.lanes * wanted
        # The epoch's decoded bytes: its windows are smaller than the chunk size where
        # shards are (a 640 KB version of 10 shards has 10 windows of 64 KB).
        total = sum(c.samples * b for c, b in zip(self._components, self._row_bytes, strict=True))
        window = total / max(windows, 1)
        text = (
            f"{self.version}: each batch draws from {per_lane} window(s), not "
            f"shuffle_windows={wanted}: the epoch has {windows} windows of about "
            f"{_size(window)}, and each of the {self.lanes} lanes' streams needs at least "
            f"{MIN_STREAM_WINDOWS} ({needed} windows for {wanted} streams a lane). A version "
            f"stored in class order gives batches of about {per_lane} class(es). "
        )
        # A power of two near what the window count asks, checked (shard ends make it
        # approximate); a few halvings at most, each cheap. One row a window last, the
        # most windows there are, only where that is few.
        smallest = math.ceil(max(1.0, *self._row_bytes))
        candidate = 1 << max(int(total / needed).bit_length() - 1, 0)
        tries = [c for c in (candidate >> i for i in range(4)) if c > smallest]
        if total / smallest <= 64 * needed:
            tries.append(smallest)
        for candidate in tries:
            if self._per_lane(candidate) >= wanted:
                # Chunks of the window's size mix as well with each chunk read once, where
                # publish can cut them that small.
                republish = (
                    "publish it again with smaller chunks, each read once (edgecache publish "
                    f"--chunk-size {_size(candidate).replace(' ', '')})"
                    if candidate >= MIN_CHUNK_BYTES
                    else ""
                )
                # Not "lower lanes" at lanes=1, the least there is (a helper's hunt).
                lanes = "lower lanes (fewer, longer streams)" if self.lanes > 1 else ""
                others = [o for o in (republish, lanes) if o]
                tail = f"; or {', or '.join(others)}" if others else ""
                return text + (
                    f"Pass window_bytes={candidate} ({_size(candidate)}) to draw from "
                    f"{wanted}: each chunk is then read and decoded about "
                    f"{max(1, round(window / candidate))} times an epoch (once for each "
                    f"window it holds){tail}"
                )
        knobs = "shuffle_windows or lanes" if self.lanes > 1 else "shuffle_windows"
        return text + (
            f"The version has too few rows for that many windows: lower {knobs}, or mix it "
            "with a larger version"
        )

    # ------------------------------------------------------------- versions

    @property
    def version(self) -> str:
        """``name@N`` of the pinned version (``+``-joined for a mixture; in every error)."""
        return "+".join(self.components)

    def pool(self) -> NodePool:
        """The node pool of the current process (opened lazily, again after fork).

        It is closed by :meth:`close`, or when the dataset is garbage-collected.
        """
        return self._readers().pool

    def _readers(self) -> Readers:
        if self._open is None or self._pid != os.getpid():
            self._open = Readers(NodePool(self.endpoints, **self._pool_args))  # type: ignore[arg-type]
            self._pid = os.getpid()
            # Not a method of self: the dataset must stay collectable.
            self._finalizer = weakref.finalize(self, self._open.close)
        return self._open

    def close(self) -> None:
        """Stop this process's reads, then close its channels, stores and threads.

        Iterators still live end: the next batch asked of one raises ValueError.
        Iterating again opens everything anew. The process's idle decode buffers
        (:mod:`edgecache.cache.recycled`, kept for the next epoch) go back to the
        system.
        """
        if self._open is not None and self._pid == os.getpid():
            self._keep_pool_stats(self._open.pool)
            self._finalizer()
        self._open = None
        recycled.buffers.release()

    def _keep_pool_stats(self, pool: Any) -> None:
        """Add a closing pool's bytes, failures and failovers to the dataset's own.

        ``stats()`` read them from the open pool alone: after a ``with`` block it
        said 0 bytes and no endpoints beside the samples delivered, and after a
        close between epochs it mixed two spans (samples of both, bytes of one).
        """
        self._closed_endpoints = self._endpoint_stats(pool)
        self._closed_failovers += pool.failovers

    def _endpoint_stats(self, pool: Any) -> dict[str, dict[str, Any]]:
        """Each endpoint's stats over the dataset's life: closed pools' and ``pool``'s."""
        endpoints = {text: dict(seen) for text, seen in self._closed_endpoints.items()}
        for text, seen in pool.stats.items() if pool is not None else ():
            now = asdict(seen)
            before = endpoints.get(text)
            if before is not None:
                now["bytes"] += before["bytes"]
                now["failures"] += before["failures"]
            endpoints[text] = now
        return endpoints

    def __enter__(self) -> EdgeDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _resolve(self, specs: Sequence[VersionSpec], settings: dict[str, Any]) -> list[pb.Manifest]:
        """The versions' manifests; under torch.distributed, rank 0's, for every rank.

        There every rank also checks that all ranks asked for the same global order
        (``settings``, :func:`_differing_order`): a rank's share is cut from one order
        that every rank computes alike, and ranks built with ``seed=base + rank`` read
        shares of different orders, some samples twice and others never, silently.

        Only a dataset split over the process group (its rank and world size the
        group's) is built collectively. One given another ``rank=``/``world_size=``
        (an evaluation set on rank 0 alone, ``rank=0, world_size=1``) is its own: its
        collectives were paired with the other ranks' next one (DDP's all-reduce), and
        the job hung until the group's timeout.
        """
        dist = _distributed()
        if dist is None or dist != (self.rank, self.world_size):
            return self._fetch(specs)
        box: list[Any] = [None]
        failure: Exception | None = None
        if dist[0] == 0:
            try:
                box[0] = [m.SerializeToString() for m in self._fetch(specs)]
            except Exception as exc:  # noqa: BLE001 - every rank raises it, below
                # Raised before the broadcast, it left the other ranks waiting in it for
                # as long as rank 0 lived, then failing with gloo's "connection closed".
                failure, box[0] = exc, _portable(exc)
        torch.distributed.broadcast_object_list(box, src=0)  # every rank: one version each
        if failure is not None:
            raise failure
        if isinstance(box[0], BaseException):
            box[0].add_note("raised on rank 0, which resolves the versions for every rank")
            raise box[0]
        manifests = [manifest_from_bytes(raw, source="manifest from rank 0") for raw in box[0]]
        every: list[Any] = [None] * dist[1]
        torch.distributed.all_gather_object(every, settings)  # small: a few numbers a rank
        differing = _differing_order(every, manifests)
        if differing:
            raise ValueError(differing)  # on every rank alike: each saw every rank's
        return manifests

    def _fetch(self, specs: Sequence[VersionSpec]) -> list[pb.Manifest]:
        local = [e for e in self.endpoints if e.local]
        if len(local) == len(self.endpoints):  # each store is closed again at once
            return [local_manifest(local, s.dataset, s.version) for s in specs]
        # The pool stays open for reading. (Closing its gRPC channels just before a
        # DataLoader forks its workers made a worker hang opening its own channel.)
        pool = self.pool()
        return [self._fetch_one(pool, local, s) for s in specs]

    def _fetch_one(
        self, pool: NodePool, local: Sequence[Endpoint], spec: VersionSpec
    ) -> pb.Manifest:
        """A version's manifest from the nodes; from a local cache when no node answers.

        A node is asked first: it resolves ``@latest`` from the registry and holds
        the registry's copy. But with every node unreachable, a job whose data is
        all in a local cache (``lmdb://`` first, its node listed as the fallback)
        must still start: its reads never needed the node.
        """
        try:
            return fetch_manifest(pool, spec.dataset, spec.version)
        except AllNodesFailed as exc:
            if not local:
                raise
            try:
                manifest = local_manifest(local, spec.dataset, spec.version)
            except (VersionNotFound, ManifestError, CacheDirError) as missing:
                exc.add_note(f"nor could a local cache give it: {missing}")
                raise exc from None
            log.warning(
                "no node answered for %s@%s (%s); its manifest came from a local cache",
                manifest.dataset,
                manifest.version,
                "; ".join(x.strip() for x in str(exc).splitlines() if x.startswith("  ")),
            )
            return manifest

    # ------------------------------------------------------------ iteration

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads (or the one being read).

        It moves on when a pass reads it to its end, with or without DataLoader
        workers (the training process follows theirs: :meth:`_follow_workers`), and
        with :meth:`set_epoch` and :meth:`load_state_dict`.
        """
        self._follow_workers()
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)  # as set_epoch: DataLoader workers take it too

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (new order); resets the cursor unless resuming it."""
        epoch = _integer("epoch", epoch, minimum=0)
        if get_worker_info() is None:
            self._follow_workers()  # the epoch the last pass with workers left it at
            if not self._own_position:
                self._restart_broken_pass()  # resuming means where it was put, as in workers
        if epoch != self._epoch:
            self._epoch, self._cursor, self._remaining = epoch, 0, None
            self._old_order = None  # an old state's order was for its epoch only
        self._placements += 1
        self._publish_position()

    def _publish_position(self) -> None:
        """Where this copy now stands is where the next pass starts, in workers too.

        In the training process it is written to shared memory for persistent
        DataLoader workers; in a worker (torchdata's StatefulDataLoader loads states
        there) the worker's own call is newer than anything written before it.
        """
        self._origin = self._put = (self.seed, self._epoch, self._cursor, self._remaining)
        self._finished_stretch = self._finished_from = self._followed = None
        if get_worker_info() is None:
            self._position_seen = self._position.write(
                {
                    "seed": self.seed,
                    "epoch": self._epoch,
                    "cursor": self._cursor,
                    "remaining": None if self._remaining is None else self._remaining.to_json(),
                    "old_format": self._old_format(self.seed, self._epoch),
                }
            )
        else:
            self._position_seen = self._position.generation
        self._own_position = True

    def _take_position(self, worker: Any) -> None:
        """In a DataLoader worker, at a pass's start: where the training process put the dataset.

        That is where it was put by ``set_epoch`` or ``load_state_dict`` in the training
        process (or where its last pass without workers ended), when it was put there
        since this copy last looked; then wherever the passes of workers since then
        left it (:meth:`_after_other_workers`): the start of the next epoch once every
        worker of a pass read it to its end, else where the last pass began, as a fresh
        worker would start, never where this copy had read ahead to. A worker cannot see
        the loop, and after a ``break`` near the epoch's end some had read their share
        to its end and others not (the next pass was half one epoch, half the next). The
        training process learns of it through the same shared memory
        (:meth:`_follow_workers`).
        """
        generation, position = self._position.read()
        self._passes += 1
        if generation != self._position_seen:
            self._position_seen = generation
            if position is not None:  # None: too large for shared memory (logged there)
                seed, epoch = int(position["seed"]), int(position["epoch"])
                remaining = position["remaining"]
                old = position.get("old_format")
                self._old_order = (seed, epoch, int(old)) if old else None
                self._origin = (
                    seed,
                    epoch,
                    int(position["cursor"]),
                    None
                    if remaining is None
                    else Remaining.from_json(
                        remaining, self._order(seed, epoch, None).lane_lengths
                    ),
                )
        self._after_other_workers(generation)
        self.seed, self._epoch, self._cursor, self._remaining = self._origin
        self._position.started(generation, self._epoch, worker.seed - worker.id, self._passes)

    def _after_other_workers(self, generation: int) -> None:
        """Where the passes of workers since the position of ``generation`` left the epochs.

        Workers that are not persistent are new copies of the training process's
        dataset every pass, which only ``set_epoch``, ``load_state_dict`` and a pass
        without workers move; persistent ones keep their own, which saw none of the
        passes of other loaders. Without this, a loop that did not call ``set_epoch``
        read epoch 0's order again every pass with fresh workers, and a persistent
        loader after another loader's passes read its own last epoch again. Passes only
        move on: the last pass's workers all read it to its end (then the epoch after
        it, for every worker of this pass alike), or it was broken off (then the epoch
        it began, whole, also when it began one the workers had moved to by
        themselves). The training process follows: :meth:`_follow_workers`.
        """
        seed = self._origin[0]
        last = self._position.last_started(generation)
        if last is not None and last[0] > self._origin[1]:
            self._origin = (seed, last[0], 0, None)
        read = self._position.epoch_read_since(generation)
        if read is not None and read > self._origin[1]:
            self._origin = (seed, read, 0, None)

    def _follow_workers(self) -> None:
        """In the training process: the epoch passes with DataLoader workers went on to.

        Workers move on by themselves (:meth:`_after_other_workers`); the training
        process, whose copy they never report to, follows them here. Without it,
        ``state_dict()`` in their second pass said the first epoch and a checkpoint
        resumed its order, and a pass without workers after an epoch read to its end
        with workers read that epoch again. Once every worker of the last pass read it
        to its end, the dataset is at the next epoch's start, as after a pass without
        workers; ``state_dict(batches=steps)`` with fewer steps than that pass had still
        counts them in it (the loop may be taking the batches the workers read ahead).
        Nothing is written for the workers: they are there.
        """
        if get_worker_info() is not None:
            return
        generation = self._position_seen
        last = self._position.last_started(generation)
        if last is None:
            return
        epoch, loader, serial = last
        read = self._position.pass_read(generation, loader, serial)
        if read != epoch + 1:
            read = None  # not that pass's end (a loader's seed that came round again)
        if (last, read) == self._followed:
            return  # nothing new since: what this process did after it stands
        self._followed = (last, read)
        put = self._put
        began = put if epoch <= put[1] else (put[0], epoch, 0, None)
        if read is None:
            self._origin, self._finished_from, self._finished_stretch = began, None, None
        else:
            self._origin = (began[0], read, 0, None)
            self._finished_from = began
            order = self._order(began[0], began[1], began[3])
            self._finished_stretch = order.batch_count - began[2]
        self.seed, self._epoch, self._cursor, self._remaining = self._origin
        self._own_position = True

    def _old_format(self, seed: int, epoch: int) -> int | None:
        """The format of the older state whose order this epoch is read in; None: the newest."""
        old = self._old_order
        return old[2] if old is not None and old[:2] == (seed, epoch) else None

    def _order(self, seed: int, epoch: int, remaining: Remaining | None) -> EpochOrder:
        interleave, in_turn = order_style(self._old_format(seed, epoch) or FORMAT)
        key = (seed, epoch, interleave, in_turn)
        order = self._orders.get(key)
        if order is None or order.remaining != (remaining or Remaining.whole(order.lane_lengths)):
            order = EpochOrder(
                self._components,
                seed=seed,
                epoch=epoch,
                world_size=self.world_size,
                rank=self.rank,
                batch_size=self.batch_size or 1,
                drop_last=self.drop_last,
                lanes=self.lanes,
                shuffle_windows=self.shuffle_windows,
                shuffle=self.shuffle,
                remaining=remaining,
                interleave=interleave,
                passes_in_turn=in_turn,
            )
            self._orders = {key: order}  # one epoch at a time
        return order

    def epoch_order(self, epoch: int | None = None) -> EpochOrder:
        """Which samples this rank yields in an epoch (default: the current one), in order.

        For the current epoch after a resume, only what was left of it.
        """
        self._follow_workers()
        if epoch is None or epoch == self._epoch:
            return self._order(self.seed, self._epoch, self._remaining)
        return self._order(self.seed, epoch, None)

    plan = epoch_order  # the method's earlier name, kept for existing callers

    def __len__(self) -> int:
        """Batches (or samples, with batch_size=None) the next pass over this rank yields.

        The whole epoch, or after a resume (at any world size) what is left of
        it: a progress bar's total.
        """
        self._follow_workers()
        if not self._own_position and get_worker_info() is None:
            seed, epoch, cursor, remaining = self._origin
            return max(self._order(seed, epoch, remaining).batch_count - cursor, 0)
        return max(self.epoch_order().batch_count - self._cursor, 0)

    def _restart_broken_pass(self) -> None:
        """Back to where the dataset was put (construction, set_epoch, a load, an epoch's end)."""
        self.seed, self._epoch, self._cursor, self._remaining = self._origin
        self._own_position = True

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

    def _window_budget(self, order: EpochOrder, lanes: int) -> float:
        """Decoded bytes of the windows a pipeline reading ``lanes`` lanes has open at once."""
        window = max(r * b for r, b in zip(self.window_rows, self._row_bytes, strict=True))
        return order.order.per_lane * max(lanes, 1) * window

    def _memory(self, in_worker: bool, pin: bool) -> BatchMemory:
        """Where this process's batches go (:mod:`~edgecache.clients.batch_memory`)."""
        readers = self._readers()
        if in_worker and self.batch_size is not None:
            ring = shared_memory()
            if ring is not None:
                return ring
        if pin:
            return PinnedMemory()
        return readers.memory

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        index, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        if worker is not None:
            self._take_position(worker)
        else:
            self._follow_workers()  # after a pass with workers: where they left the epochs
            if not self._own_position:
                # The last pass here was broken off (a break, a failure): start where the
                # dataset was put, as DataLoader workers do, not where that pass stopped.
                # Its progress stayed in state_dict() until now, for a checkpoint after it.
                self._restart_broken_pass()
        self._own_position = False  # until this pass reads to the epoch's end
        self._finished_stretch = self._finished_from = None
        placements = self._placements
        order = self.epoch_order()
        numbers = order.batches_for(index, workers, self._cursor)
        readers = self._readers()
        own_lanes = self.lanes % workers == 0
        pin = self._pin(worker is not None)
        pipeline = Pipeline(
            order,
            numbers,
            readers.pool,
            [
                ReadTarget(
                    m.dataset,
                    m.version,
                    m.digest,
                    s,
                    compressed=m.preprocess.compression != pb.COMPRESSION_NONE,
                )
                for m, s in zip(self.manifests, self.schemas, strict=True)
            ],
            self.kinds,
            row_bytes=self._row_bytes,
            pin_memory=pin,
            # A worker runs its share of the threads and read-ahead: k workers of a
            # pipeline sized for the whole process each would oversubscribe the cores.
            threads=max(1, self.threads // workers),
            window_budget=self._window_budget(
                order, self.lanes // workers if own_lanes else self.lanes
            ),
            read_ahead=self.prefetch_bytes / workers,
            component_column=self.component_column,
            lanes=[lane for lane in range(self.lanes) if lane % workers == index]
            if own_lanes
            else None,
            memory=self._memory(worker is not None, pin),
        )
        readers.add(pipeline)
        tally, counted_wait = readers.tally, 0.0
        forms = {
            # Packed bytes and strings by their item, so collate_samples packs them again
            # (binary='packed': a batch of samples was a list of bytes, unlike a batch).
            k.name: k.item if k.kind == "packed" and k.item in ("binary", "string") else k.kind
            for k in self.kinds
            if k.kind in ("ragged", "list", "packed")
        }
        try:
            for size, batch in pipeline:
                self._cursor += workers if worker else 1
                self._delivered["samples"] += size
                self._delivered["batches"] += 1
                delta = tally.delta(readers.pool)
                delta.update(samples=size, batches=1)
                if worker is None:
                    if not self._watched:
                        delta["wait"] = pipeline.wait_seconds - counted_wait
                        counted_wait = pipeline.wait_seconds
                    self._counters.add(delta)
                else:
                    readers.pending = merge(readers.pending, delta)
                    if attach(batch, (self._metrics_key, readers.pending)):
                        readers.pending = None
                counts = None
                if readers.pending is not None and worker is not None:
                    counts, readers.pending = (self._metrics_key, readers.pending), None
                if self.batch_size is None:
                    yield Sample(
                        {
                            k: v[0] if isinstance(v, (torch.Tensor, list, Packed)) else v
                            for k, v in batch.items()
                        },
                        forms,
                        counts,
                    )
                else:
                    # No shared tensor to ride on: the batch itself carries the counts.
                    yield batch if counts is None else Carried(batch, counts)
                if self._placements != placements:
                    raise ValueError(self._repositioned())
            # Read to its end: what comes next is the next epoch, for the next pass and
            # for state_dict() (a resume must not read this one again). A persistent
            # DataLoader worker goes on to it only if every worker read to its end
            # (_take_position): it says so, and keeps where this pass began till then.
            stretch = order.batch_count - self._origin[2]
            self._epoch, self._cursor, self._remaining = self._epoch + 1, 0, None
            if worker is None:
                self._publish_position()
                self._finished_stretch = stretch
            else:
                self._position.finished(
                    worker.id,
                    worker.seed - worker.id,
                    self._passes,
                    workers=worker.num_workers,
                    generation=self._position_seen,
                    next_epoch=self._epoch,
                )
        except (EdgeCacheError, ValueError) as exc:
            # The same object, re-raised: its class, attributes (a NodeError's endpoint
            # and code) and traceback stay; the version is added as context (also to
            # what the data cannot become: a column with nulls, say).
            note = f"while reading {self.version} with EdgeDataset"
            if note not in getattr(exc, "__notes__", ()):
                exc.add_note(note)
            _name_in_message(exc, self.version)
            raise
        finally:
            # A break, an abandoned iterator or a DataLoader worker's exit end up here
            # (GeneratorExit): the reads stop and their threads are joined now.
            pipeline.close()
            readers.discard(pipeline)
            if worker is None and not self._watched:
                self._delivered["wait_seconds"] += pipeline.wait_seconds
                self._counters.add({"wait": pipeline.wait_seconds - counted_wait})
            self._last_pipeline = {
                "read_ahead_bytes": pipeline.read_ahead,
                "held_peak_bytes": pipeline.held_peak,
                "window_budget_bytes": pipeline.window_budget,
                "fetch_wait_seconds": pipeline.fetch_wait_seconds,
                "fetch_busy_seconds": pipeline.fetch_busy_seconds,
                "windows_read": pipeline.windows_read,
                "windows_inline": pipeline.windows_inline,
                "window_chunks": pipeline.window_chunks,
            }

    def _repositioned(self) -> str:
        """Why a pass begun before set_epoch or load_state_dict ends when asked for more.

        Each batch it yielded moved the dataset's position on: after a
        load_state_dict, state_dict() and the next pass then counted batches of
        the abandoned order, and a resume skipped their samples; after a
        set_epoch, its end moved the dataset past the epoch just set.
        """
        return (
            f"{self.version}: this iterator began before set_epoch() or load_state_dict() put "
            "the dataset elsewhere, so it has stopped (read on, it would have moved the new "
            "position by batches of the old order); iterate the dataset again (a new for "
            "loop, or iter(loader)) to read from where it was put"
        )

    def watch(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield ``batches`` (a DataLoader over this dataset), timing how long each is waited for.

        The time the training loop waits for data is ``edgecache_client_data_wait_seconds_total``
        (and ``stats()["wait_seconds"]``). With ``num_workers=0`` the dataset measures it by
        itself; with workers, only the main process sees the loop wait, so wrap the loader:
        ``for batch in ds.watch(loader)``.
        """
        self._watched = True
        iterator = iter(batches)
        while True:
            started = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            waited = time.perf_counter() - started
            self._counters.add({"wait": waited})
            self._delivered["wait_seconds"] += waited
            yield batch

    # ---------------------------------------------------------------- state

    def _identity(self) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
        components = [
            {
                "dataset": m.dataset,
                "version": m.version,
                "digest": m.digest,
                "weight": None if self.weights is None else self.weights[i],
            }
            for i, m in enumerate(self.manifests)
        ]
        order = {
            "shuffle": self.shuffle,
            "shuffle_windows": self.shuffle_windows,
            "lanes": self.lanes,
            "window_rows": list(self.window_rows),
            "samples_per_epoch": self.samples_per_epoch,
            "rows": None if self.rows is None else list(self.rows),
        }
        layout = {
            "world_size": self.world_size,
            "rank": self.rank,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }
        return components, order, layout

    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """Where this rank is: versions, seed, epoch, what was left, batches yielded since.

        With ``num_workers > 0`` pass ``batches``: your steps since the last
        ``load_state_dict`` or, without one, since the epoch began (a resumed run
        counts from 0 again, whether the resume was elastic or not). Under DDP every
        rank steps in lockstep, so rank 0's state resumes every rank, at any world size.

        With ``batch_size=None`` the dataset yields samples, so ``batches`` counts
        samples: pass steps × the DataLoader's batch size, at a step count that is a
        multiple of ``num_workers`` (each worker batches its own samples, so only then
        have all workers given equal shares, and what was read is a prefix of the
        epoch's order); at other steps no count resumes exactly.
        """
        self._follow_workers()
        seed, epoch, cursor, remaining = self.seed, self._epoch, self._cursor, self._remaining
        if batches is not None:
            batches = _integer("batches", batches, minimum=0)
            # Counted from where the dataset was put: a resume at the same layout keeps
            # the saved cursor, which these steps come after (replacing it read the
            # batches between the two checkpoints again).
            seed, epoch, cursor, remaining = self._origin
            if batches == self._finished_stretch:
                batches = 0  # that epoch was read to its end: the next one's start
            elif self._finished_from is not None and batches < (self._finished_stretch or 0):
                # Workers read the last pass to its end, but the loop took fewer steps:
                # it is still taking the batches they read ahead (or broke off there).
                seed, epoch, cursor, remaining = self._finished_from
            total = self._order(seed, epoch, remaining).batch_count - cursor
            if batches > total:
                raise ValueError(
                    f"batches={batches}, but this stretch of epoch {epoch} has {total} "
                    "batches on this rank; pass the steps taken since it began (or since the "
                    "last load_state_dict)"
                )
            cursor += batches
        elif self._position.started_since(self._position_seen) and get_worker_info() is None:
            self._say_uncounted()
        components, order, layout = self._identity()
        return make_state(
            components=components,
            order=order,
            seed=seed,
            epoch=epoch,
            remaining=remaining,
            layout=layout,
            batches=cursor,
            order_format=self._old_format(seed, epoch) or FORMAT,
        )

    def _say_uncounted(self) -> None:
        if not self._said_uncounted:
            self._said_uncounted = True
            log.warning(
                "%s: state_dict() in the training process cannot see what DataLoader workers "
                "yielded (it says batches=%d); pass your step count, state_dict(batches=steps "
                "since the last load_state_dict or the epoch's start)",
                self.version,
                self._cursor,
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off, at this dataset's world size and batch size.

        Refuses (StateMismatch) a state of other versions, weights, order knobs or seed.
        """
        components, order, layout = self._identity()
        resume = resume_from(
            state,
            components=components,
            order=order,
            layout=layout,
            lane_lengths=lambda seed, epoch: self._order(seed, epoch, None).lane_lengths,
            seed=self.seed,
            fixes={"rows": lambda rows: kept_rows(self.manifests, rows)},
            knob={"window_rows": f"window_bytes={self.window_bytes or 'None (the chunk size)'}"},
        )
        if resume.elastic:
            log.info(
                "%s: resuming epoch %d at world size %d, batch size %s: %d samples left",
                self.version,
                resume.epoch,
                self.world_size,
                self.batch_size,
                resume.remaining.samples if resume.remaining else 0,
            )
        self.seed, self._epoch = resume.seed, resume.epoch
        self._remaining, self._cursor = resume.remaining, resume.cursor
        old = resume.order_format
        self._old_order = None if old == FORMAT else (resume.seed, resume.epoch, old)
        self._placements += 1
        self._publish_position()

    # ---------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        """What this process delivered and saw (workers keep their own).

        ``last_pipeline`` describes the last pass over the data this process
        finished or stopped: how far it read ahead, the decoded bytes it held
        at most (beside its budget for the windows open at once), how long it
        waited for and spent on reads, and how many chunks its windows were
        decoded from (``window_chunks`` above
        ``windows_read`` means windows straddle chunks: see
        :mod:`edgecache.cache.row_grid`); ``windows_inline`` of its windows were
        read from a local cache on the assembling thread, not on a fetch thread
        (:meth:`~edgecache.clients.pipeline.Pipeline._submit` says why).
        """
        pool = self._open.pool if self._open is not None else None
        endpoints = self._endpoint_stats(pool)
        return {
            "version": self.version,
            **self._delivered,
            "bytes": sum(e["bytes"] for e in endpoints.values()),
            "failovers": self._closed_failovers + (pool.failovers if pool else 0),
            "endpoints": endpoints,
            "last_pipeline": dict(self._last_pipeline),
        }

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = None  # channels and LMDB environments never cross processes
        # Counted where it runs; made anew on unpickling: its lock cannot be pickled
        # (spawned DataLoader workers get the dataset pickled).
        state.pop("_counters", None)
        state["_orders"] = {}  # rebuilt where needed
        state.pop("_finalizer", None)
        return state

    def _metrics_label(self) -> str:
        """The ``dataset`` label of this dataset's metrics: the version, and its split.

        A training split and its evaluation split of one version (``rows=``)
        were one series: evaluation's waits counted as the training loop's.
        """
        if self.rows is None:
            return self.version
        start, end = self.rows
        return f"{self.version} rows {start}:{end}"

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._counters = ClientCounters(self.rank, self._metrics_label(), [])
