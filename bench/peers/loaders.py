"""One DataLoader per system, each with its project's recommended reading setup.

A :class:`Spec` names the system, the data and the DataLoader settings;
:func:`open_loader` builds the dataset and its ``torch.utils.data.DataLoader``
(or the peer's own subclass of it) and returns it with a function that
releases it. What each does per sample is described in ``bench.peers``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, default_collate

from bench.peers.torchvision_stub import import_streaming

__all__ = [
    "EDGECACHE",
    "LOW_MEMORY",
    "PEERS",
    "SYSTEMS",
    "Spec",
    "open_loader",
    "preload",
    "prepare",
]

PEERS = ("mds", "mds-zstd", "litdata", "webdataset")
EDGECACHE = ("edgecache-grpc", "edgecache-lmdb", "edgecache-lmdb-none", "edgecache-lmdb-lowmem")
# The memory/shuffle trade (docs/dataset.md): one lane, batches drawn from 4 windows instead of
# 16, an 8 MiB read-ahead. Not the default; the default is measured beside it.
LOW_MEMORY = {"lanes": 1, "shuffle_windows": 4, "prefetch_bytes": 8 << 20}
SYSTEMS = (*PEERS, *EDGECACHE)
WDS_SHUFFLE_SAMPLES = (
    1000  # webdataset's documented buffer size: ~8 MB of tokens, ~100 MB of images
)


@dataclass
class Spec:
    """One epoch to run: which system reads which copy, and how."""

    system: str
    dataset: str  # "tokens" or "images"
    location: str  # a folder for the peers; host:port or lmdb://dir for edgecache
    version: str  # name@N (edgecache)
    batch_size: int
    workers: int
    rows: int
    raw_bytes: int
    label_sum: int
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prepare(spec: Spec) -> None:
    """Undo what an earlier epoch left behind that would make this one cheaper.

    MDS with compression decompresses each shard next to itself the first time
    it is read (``shard.N.mds.zstd`` → ``shard.N.mds``) and reads that copy
    afterwards; every mds-zstd epoch here starts from the compressed shards only.
    """
    if spec.system == "mds-zstd":
        for packed in Path(spec.location).glob("*.mds.zstd"):
            packed.with_suffix("").unlink(missing_ok=True)


def _mosaic(spec: Spec) -> tuple[Iterable[Any], Callable[[], None]]:
    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(
        local=spec.location,
        batch_size=spec.batch_size,
        shuffle=True,
        shuffle_seed=spec.seed,
    )
    loader = streaming.StreamingDataLoader(
        dataset, batch_size=spec.batch_size, num_workers=spec.workers
    )
    return loader, lambda: None


def _litdata(spec: Spec) -> tuple[Iterable[Any], Callable[[], None]]:
    import litdata

    dataset = litdata.StreamingDataset(input_dir=spec.location, shuffle=True, seed=spec.seed)
    loader = litdata.StreamingDataLoader(
        dataset, batch_size=spec.batch_size, num_workers=spec.workers
    )
    return loader, lambda: None


def _wds_tokens(sample: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": np.frombuffer(sample["ids"], dtype=np.int32), "label": int(sample["cls"])}


def _wds_images(sample: dict[str, Any]) -> dict[str, Any]:
    return {"image": sample["img"], "label": int(sample["cls"])}


def _webdataset(spec: Spec) -> tuple[Iterable[Any], Callable[[], None]]:
    import webdataset as wds

    urls = sorted(str(p) for p in Path(spec.location).glob("*.tar"))
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=spec.seed, empty_check=False)
        .shuffle(WDS_SHUFFLE_SAMPLES)
        .map(_wds_tokens if spec.dataset == "tokens" else _wds_images)
        .batched(spec.batch_size, collation_fn=default_collate, partial=True)
    )
    # Batching inside the pipeline (in the workers) is what webdataset recommends.
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=spec.workers)
    return loader, lambda: None


def _edgecache(spec: Spec) -> tuple[Iterable[Any], Callable[[], None]]:
    from edgecache.clients.dataset import EdgeDataset

    dataset = EdgeDataset(
        spec.version,
        endpoints=[spec.location],
        batch_size=spec.batch_size,
        shuffle=True,
        seed=spec.seed,
        **(LOW_MEMORY if spec.system == "edgecache-lmdb-lowmem" else {}),
    )
    # EdgeDataset batches itself (on background threads), so the DataLoader does not.
    return DataLoader(dataset, batch_size=None, num_workers=spec.workers), dataset.close


_OPENERS: dict[str, Callable[[Spec], tuple[Iterable[Any], Callable[[], None]]]] = {
    "mds": _mosaic,
    "mds-zstd": _mosaic,
    "litdata": _litdata,
    "webdataset": _webdataset,
    "edgecache-grpc": _edgecache,
    "edgecache-lmdb": _edgecache,
    "edgecache-lmdb-none": _edgecache,
    "edgecache-lmdb-lowmem": _edgecache,
}


def open_loader(spec: Spec) -> tuple[Iterable[Any], Callable[[], None]]:
    """The loader of ``spec`` (batches of dicts) and a function that releases it."""
    return _OPENERS[spec.system](spec)


def preload(system: str) -> None:
    """Import a system's package ahead of timing (imports are not part of an epoch)."""
    if system.startswith("mds"):
        import_streaming()
    elif system == "litdata":
        import litdata  # noqa: F401
    elif system == "webdataset":
        import webdataset  # noqa: F401
    else:
        import edgecache.clients.dataset  # noqa: F401
