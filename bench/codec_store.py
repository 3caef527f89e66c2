"""Codec and store against the raw libraries they wrap, on the same bytes, in one run.

    python -m bench.codec_store [--mib 256] [--repeat 5] [--json]

Figures (MB/s of uncompressed Arrow data for the codec, of stored bytes for the store):

* encode: ShardEncoder (slice, IPC-serialize, zstd, checksum) vs plain zstandard compress
  of the same IPC bytes;
* decode: decode_chunk (verify, zstd, IPC read) vs raw zstd decompress + Arrow IPC read;
  and decode on 2 threads vs 1 (the GIL is released);
* the byte-split codec (the default for new versions) against plain zstd-1, both through
  ShardEncoder and decode_chunk: encode time, and decode time, which must not be slower
  (readers decode every chunk; target >= 1.0x);
* put: CacheStore.put_shard vs raw LMDB puts of the same frames, one transaction a shard;
* get: CacheStore.read_shard verified zero-copy views vs raw LMDB ``buffers=True`` + one copy
  out; and CacheStore.iter_chunks (verified copies) vs raw LMDB ``get``.

Data: ``tokens`` (Zipf ids, bench.datasets), ``text-tokens`` (the ids of real text: the
standard library's sources through a BPE of 32,000 ids trained in the run, at most 32 MiB)
and ``images``. The compression ratio of each codec is printed per dataset.

Each pair runs interleaved, best of ``--repeat``; the ratio is ours / baseline.
Targets: store get >= 0.8x raw LMDB read; codec decode >= 0.8x raw zstd + IPC read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import pyarrow as pa
import zstandard
from rich.console import Console

from bench import datasets, report
from bench.arguments import positive_int
from bench.report import ratio_table
from edgecache.cache.codec import CodecOptions, decode_chunk, encode_shard
from edgecache.cache.frame import payload_view, read_header
from edgecache.cache.keys import ShardKey, chunk_key
from edgecache.cache.store import CacheStore

CHUNK_BYTES = 4 << 20
TEXT_MIB = 32
CHUNKS_PER_SHARD = 16


def best_of(
    ours: Callable[[], object], base: Callable[[], object], repeat: int
) -> tuple[float, float]:
    """Best wall time of each, run alternately so drift hits both alike."""
    t_ours, t_base = float("inf"), float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        ours()
        t2 = time.perf_counter()
        t_base, t_ours = min(t_base, t1 - t0), min(t_ours, t2 - t1)
    return t_ours, t_base


def row(
    results: list[dict],
    data: str,
    what: str,
    baseline: str,
    nbytes: int,
    times: tuple[float, float],
    target: float | None = None,
) -> None:
    t_ours, t_base = times
    results.append(
        {
            "data": data,
            "measure": what,
            "baseline": baseline,
            "mbytes": round(nbytes / 1e6, 1),
            "ours_mb_s": round(nbytes / t_ours / 1e6),
            "baseline_mb_s": round(nbytes / t_base / 1e6),
            "ratio": round(t_base / t_ours, 3),
            "target": target,
        }
    )


def bench_dataset(
    name: str, batches: list[pa.RecordBatch], repeat: int, workdir: Path
) -> list[dict]:
    schema = batches[0].schema
    results: list[dict] = []
    opts = CodecOptions(compression="zstd", level=1, chunk_bytes=CHUNK_BYTES)
    raw_frames = encode_shard(
        batches, schema, CodecOptions(compression="none", chunk_bytes=CHUNK_BYTES)
    )
    raw_ipc = [bytes(payload_view(f, read_header(f))) for f in raw_frames]
    raw_bytes = sum(map(len, raw_ipc))

    # -- codec: encode
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    frames: list[bytes] = []

    def ours_encode() -> None:
        frames[:] = encode_shard(batches, schema, opts)

    times = best_of(ours_encode, lambda: [cctx.compress(b) for b in raw_ipc], repeat)
    row(results, name, "codec encode (zstd-1)", "zstandard.compress", raw_bytes, times)
    stored = sum(map(len, frames))
    compressed = [bytes(payload_view(f, read_header(f))) for f in frames]

    # -- codec: decode
    dctx = zstandard.ZstdDecompressor()

    def base_decode() -> None:
        for payload in compressed:
            pa.ipc.open_stream(pa.py_buffer(dctx.decompress(payload))).read_next_batch()

    def ours_decode() -> None:
        for frame in frames:  # each batch dropped at once, like the baseline's
            decode_chunk(frame, schema)

    times = best_of(ours_decode, base_decode, repeat)
    row(results, name, "codec decode (zstd-1)", "zstd decompress + IPC read", raw_bytes, times, 0.8)

    with ThreadPoolExecutor(2) as pool:

        def threaded_decode() -> None:
            for _ in pool.map(lambda f: decode_chunk(f, schema), frames):
                pass

        times = best_of(threaded_decode, ours_decode, repeat)
    row(results, name, "codec decode, 2 threads", "same, 1 thread", raw_bytes, times)

    # -- the byte-split codec against plain zstd-1, both ours
    split_opts = CodecOptions(compression="byte-split-zstd", level=1, chunk_bytes=CHUNK_BYTES)
    split_frames: list[bytes] = []

    def split_encode() -> None:
        split_frames[:] = encode_shard(batches, schema, split_opts)

    times = best_of(split_encode, ours_encode, repeat)
    row(results, name, "codec encode, byte-split zstd-1", "same, plain zstd-1", raw_bytes, times)

    def split_decode() -> None:
        for frame in split_frames:
            decode_chunk(frame, schema)

    times = best_of(split_decode, ours_decode, repeat)
    # Where nothing is worth splitting (images: their offsets are under MIN_SHARE of the
    # bytes) the codec writes the plain zstd-1 frames, so the ratio is 1 give or take the
    # machine's noise: reported, with no target.
    split_anything = split_frames != frames
    row(
        results,
        name,
        "codec decode, byte-split zstd-1"
        + ("" if split_anything else " (nothing to split: the same frames)"),
        "same, plain zstd-1",
        raw_bytes,
        times,
        1.0 if split_anything else None,
    )
    split_stored = sum(map(len, split_frames))

    # -- store: put and get, same frames, same LMDB settings
    shards = [frames[i : i + CHUNKS_PER_SHARD] for i in range(0, len(frames), CHUNKS_PER_SHARD)]
    cache_dir, raw_dir = workdir / f"{name}-store", workdir / f"{name}-raw"
    store = CacheStore(cache_dir, capacity_bytes=4 * stored, sync=False)
    env = lmdb.open(
        str(raw_dir),
        map_size=8 * stored + (256 << 20),
        sync=False,
        metasync=False,
        meminit=False,
        max_dbs=2,
    )
    raw_db = env.open_db(b"chunks")
    keys = [ShardKey(name, 1, i) for i in range(len(shards))]

    def ours_put() -> None:
        store.evict_version(name, 1)
        for key, shard in zip(keys, shards, strict=True):
            store.put_shard(key, shard)

    def base_put() -> None:
        with env.begin(write=True) as txn:
            txn.drop(raw_db, delete=False)
        for key, shard in zip(keys, shards, strict=True):
            with env.begin(write=True) as txn:
                for index, frame in enumerate(shard):
                    txn.put(chunk_key(key.encode(), index), frame, db=raw_db)

    times = best_of(ours_put, base_put, repeat)
    row(results, name, "store put", "raw LMDB put", stored, times)

    def ours_get_views() -> None:
        for key in keys:
            with store.read_shard(key) as reader:
                for _ in reader:
                    pass

    def base_get_copy() -> None:
        with env.begin(buffers=True) as txn:
            for key, shard in zip(keys, shards, strict=True):
                for index in range(len(shard)):
                    bytes(txn.get(chunk_key(key.encode(), index), db=raw_db))

    times = best_of(ours_get_views, base_get_copy, repeat)
    row(
        results,
        name,
        "store get, verified views",
        "raw LMDB buffers=True + copy",
        stored,
        times,
        0.8,
    )

    def ours_get_bytes() -> None:
        for key in keys:
            for _ in store.iter_chunks(key):
                pass

    def base_get_bytes() -> None:
        with env.begin() as txn:
            for key, shard in zip(keys, shards, strict=True):
                for index in range(len(shard)):
                    txn.get(chunk_key(key.encode(), index), db=raw_db)

    times = best_of(ours_get_bytes, base_get_bytes, repeat)
    row(results, name, "store get, verified copies", "raw LMDB get (bytes)", stored, times)
    store.close()
    env.close()
    for r in results:
        r["compression_ratio"] = round(raw_bytes / stored, 2)
        r["byte_split_compression_ratio"] = round(raw_bytes / split_stored, 2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mib", type=positive_int, default=256, help="uncompressed MiB per dataset (default 256)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=5, help="runs per measurement; best is kept"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    console = Console(stderr=args.json, width=150)
    workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-"))
    results: list[dict] = []
    try:
        for name, make, mib in (
            ("tokens", datasets.tokens, args.mib),
            # Real text's ids: a BPE trained on the sources in this run (its time grows
            # with the text), so at most TEXT_MIB; eight chunks show the ratio.
            ("text-tokens", datasets.text_tokens, min(args.mib, TEXT_MIB)),
            ("images", datasets.images, args.mib),
        ):
            console.log(f"generating {mib} MiB of {name}")
            batches = make(mib << 20)
            console.log(f"measuring {name}")
            results += bench_dataset(name, batches, args.repeat, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    versions = report.versions("pyarrow", "zstandard", "lmdb", "xxhash", "edgecache")
    if args.json:
        print(
            json.dumps(
                {"versions": versions, "chunk_bytes": CHUNK_BYTES, "results": results}, indent=2
            )
        )
        return
    title = (
        f"edgecache codec and store vs raw libraries ({args.mib} MiB per dataset, text-tokens "
        f"{min(args.mib, TEXT_MIB)} MiB, "
        f"{CHUNK_BYTES >> 20} MiB chunks, best of {args.repeat})"
    )
    table = ratio_table(title, results, ("data", "measure", "baseline"))
    console.print(table)
    first = {r["data"]: r for r in results}  # every row of a dataset carries its ratios
    console.print(
        "compression ratio, plain zstd-1 / byte-split zstd-1: "
        + ", ".join(
            f"{d} {r['compression_ratio']}× / {r['byte_split_compression_ratio']}×"
            for d, r in first.items()
        )
    )
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))


if __name__ == "__main__":
    main()
