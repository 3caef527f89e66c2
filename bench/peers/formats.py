"""Converters: the same Parquet samples written in each peer's own format.

Each writes the layout its project documents as the normal one, with shards of
~64 MiB (the size edgecache's origin shards have here):

* MosaicML Streaming: ``MDSWriter`` with ``size_limit=64 MiB``; tokens as an
  ``ndarray:int32:2048`` column, images as ``bytes``, labels as ``int64``;
  once uncompressed and once with ``compression="zstd"`` (level 3, its default);
* LitData: ``litdata.optimize`` over the Parquet shards (one input per shard,
  ``fn`` yields its samples) with ``chunk_bytes="64MB"``, no compression (its
  default); tokens as 1-D int32 arrays (stored headerless), images as bytes;
* WebDataset: ``ShardWriter`` tar shards of ``maxsize=64 MiB``, members
  ``<key>.ids`` (the 8 KiB of int32s) or ``<key>.img`` (the blob) and
  ``<key>.cls`` (the label as text).

Conversion times are recorded for the record but are not what is compared.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peers.data import Source, samples
from bench.peers.torchvision_stub import import_streaming

__all__ = ["SHARD_BYTES", "Converted", "CONVERTERS", "disk_bytes"]

SHARD_BYTES = 64 << 20


@dataclass
class Converted:
    """Where a converted copy lives, its size on disk and how long writing took."""

    path: Path
    disk_bytes: int
    seconds: float


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _timed(write: Callable[[Source, Path], None]) -> Callable[[Source, Path], Converted]:
    def run(source: Source, out: Path) -> Converted:
        started = time.perf_counter()
        write(source, out)
        return Converted(out, disk_bytes(out), time.perf_counter() - started)

    return run


def _mds(source: Source, out: Path, compression: str | None) -> None:
    streaming = import_streaming()
    columns = (
        {"input_ids": "ndarray:int32:2048", "label": "int64"}
        if source.name == "tokens"
        else {"image": "bytes", "label": "int64"}
    )
    with streaming.MDSWriter(
        out=str(out), columns=columns, compression=compression, size_limit=SHARD_BYTES
    ) as writer:
        for path in source.files:
            for sample in samples(path, source.name):
                writer.write(sample)


def _litdata_samples(item: tuple[str, str]) -> Iterator[dict[str, Any]]:
    """``optimize``'s fn: one Parquet shard in, its samples out (top level: it is pickled)."""
    path, name = item
    yield from samples(Path(path), name)


def _litdata(source: Source, out: Path) -> None:
    import litdata

    inputs = [(str(p), source.name) for p in source.files]
    litdata.optimize(
        fn=_litdata_samples,
        inputs=inputs,
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=min(2, len(inputs)),
        mode="overwrite",
        verbose=False,
        start_method="fork",
    )


def _webdataset(source: Source, out: Path) -> None:
    import webdataset as wds

    out.mkdir(parents=True)
    field = "ids" if source.name == "tokens" else "img"
    key = 0
    with wds.ShardWriter(str(out / "shard-%05d.tar"), maxsize=SHARD_BYTES, verbose=0) as sink:
        for path in source.files:
            for sample in samples(path, source.name):
                data = sample["input_ids"].tobytes() if field == "ids" else sample["image"]
                sink.write(
                    {"__key__": f"{key:010d}", field: data, "cls": str(sample["label"]).encode()}
                )
                key += 1


CONVERTERS: dict[str, Callable[[Source, Path], Converted]] = {
    "mds": _timed(lambda s, o: _mds(s, o, None)),
    "mds-zstd": _timed(lambda s, o: _mds(s, o, "zstd")),
    "litdata": _timed(_litdata),
    "webdataset": _timed(_webdataset),
}
