"""Images at the edge: decoder speed per core, and an epoch of edge-decoded images against
LitData decoding the same images in its DataLoader workers.

    python -m bench.images [--images 2000] [--size 224] [--repeat 3] [--json]

Images: matplotlib's sample photographs (grace_hopper.jpg, the Minduka PNG),
cut into ``--images`` crops re-encoded as ~500x375 JPEGs (ImageNet-like),
deterministically. All measured in one run:

(a) Decoders, one thread, images/s per core to a ``size``x``size`` RGB crop:
    Pillow (full decode, then resize), Pillow with JPEG DCT downscaling
    (``Image.draft``: what the images transform uses), simplejpeg (with
    ``min_height``/``min_width``) when installed, PyTurboJPEG when it can find
    libturbojpeg. The winner is what ``edgecache[images]`` installs.
(b) The images transform over all the images on 1 thread and on every core
    (images/s, and per core).
(c) One epoch, same output ([B, size, size, 3] uint8 tensors), batch 64:
    EdgeDataset reading a version whose images a local node decoded once at
    staging, against LitData (``litdata.optimize`` of the encoded bytes)
    decoding each image in its ``StreamingDataLoader`` workers (``num_workers``
    = cores) with the same decode function. Staging time is reported apart.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from bench import report
from bench.arguments import positive_int, require_modules
from edgecache.cache.preprocess import ShardContext, preprocess
from edgecache.cache.preprocess.images import ImageSpec, _decode
from edgecache.edge.config import usable_cores
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["main", "make_images"]


def make_images(count: int, seed: int = 0) -> list[bytes]:
    """``count`` JPEGs of about 500x375 cut from matplotlib's sample photographs."""
    import matplotlib
    from PIL import Image

    sample = Path(matplotlib.get_data_path()) / "sample_data"
    sources = [
        Image.open(sample / "grace_hopper.jpg").convert("RGB"),
        Image.open(sample / "Minduka_Present_Blue_Pack.png").convert("RGB"),
    ]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        image = sources[i % len(sources)]
        w, h = image.size
        box_w, box_h = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
        left, top = int(rng.integers(0, w - box_w + 1)), int(rng.integers(0, h - box_h + 1))
        crop = image.crop((left, top, left + box_w, top + box_h)).resize((500, 375))
        buffer = io.BytesIO()
        crop.save(buffer, "JPEG", quality=int(rng.integers(75, 95)))
        out.append(buffer.getvalue())
    return out


def _per_second(fn: Any, items: list[bytes], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.thread_time()
        for item in items:
            fn(item)
        best = min(best, time.thread_time() - started)
    return len(items) / best


def decoders(images: list[bytes], size: int, repeat: int) -> dict[str, float]:
    from PIL import Image

    spec = ImageSpec.parse({"size": str(size)})

    def pillow_full(data: bytes) -> np.ndarray:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        w, h = image.size
        scale = size / min(w, h)
        image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))))
        return np.asarray(image)[:size, :size]

    found = {
        "pillow (full decode + resize)": _per_second(pillow_full, images, repeat),
        "pillow + draft (the images transform)": _per_second(
            lambda d: _decode(d, spec), images, repeat
        ),
    }
    try:
        import simplejpeg

        def simple(data: bytes) -> np.ndarray:
            pixels = simplejpeg.decode_jpeg(data, "RGB", min_height=size, min_width=size)
            image = Image.fromarray(pixels)
            w, h = image.size
            scale = size / min(w, h)
            return np.asarray(
                image.resize((max(size, round(w * scale)), max(size, round(h * scale))))
            )

        found["simplejpeg (min size) + Pillow resize"] = _per_second(simple, images, repeat)
    except ImportError:
        pass
    try:
        from turbojpeg import TurboJPEG

        turbo = TurboJPEG()
        found["PyTurboJPEG (full decode)"] = _per_second(turbo.decode, images, repeat)
    except (ImportError, RuntimeError, OSError):
        pass  # not installed, or no libturbojpeg on this machine
    return {name: round(rate) for name, rate in found.items()}


def _ipc(images: list[bytes]) -> bytes:
    table = pa.table(
        {"image": pa.array(images, pa.binary()), "label": pa.array(range(len(images)))}
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def transform_rate(images: list[bytes], size: int, threads: int, repeat: int) -> float:
    data = _ipc(images)
    spec = pb.PreprocessSpec(transform="images", params={"size": str(size)})
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            started = time.perf_counter()
            rows = sum(
                b.num_rows
                for b in preprocess(
                    data,
                    fmt=pb.SOURCE_FORMAT_ARROW_IPC,
                    source="bench",
                    spec=spec,
                    context=ShardContext(),
                    pool=pool if threads > 1 else None,
                )
            )
            best = min(best, time.perf_counter() - started)
    assert rows == len(images)
    return len(images) / best


def _litdata_fn(item: tuple[str, int, int]) -> Any:
    path, start, stop = item
    table = pq.read_table(path)
    for i in range(start, stop):
        yield {
            "image": table.column("image")[i].as_py(),
            "label": int(table.column("label")[i].as_py()),
        }


def epoch(workdir: Path, images: list[bytes], size: int, console: Console) -> dict:
    import grpc
    import litdata
    import torch

    from bench.edge_node import start_node
    from edgecache.cache.manifest import preprocess_spec
    from edgecache.cache.registry import Registry
    from edgecache.clients.dataset import EdgeDataset
    from edgecache.edge.server import CHANNEL_OPTIONS
    from edgecache.v1 import edge_pb2, edge_pb2_grpc

    origin = workdir / "origin"
    origin.mkdir()
    per = 500
    for shard, start in enumerate(range(0, len(images), per)):
        part = images[start : start + per]
        table = pa.table(
            {
                "image": pa.array(part, pa.binary()),
                "label": pa.array(range(start, start + len(part))),
            }
        )
        pq.write_table(table, origin / f"part-{shard:04d}.parquet")
    registry = f"file://{workdir}/registry"
    spec = preprocess_spec(transform="images", params={"size": str(size), "column": "image"})
    Registry.run(registry, lambda reg: reg.publish(f"file://{origin}", "pics", spec=spec))
    node, address, _ = start_node(workdir, "cache", registry)
    cores = usable_cores()
    try:
        client = edge_pb2_grpc.EdgeCacheStub(
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        )
        started = time.perf_counter()
        list(client.Stage(edge_pb2.StageRequest(dataset="pics", version=1)))
        staging = time.perf_counter() - started
        ds = EdgeDataset(
            "pics@1", endpoints=[address], batch_size=64, seed=1, columns=["image", "label"]
        )
        list(ds)  # warm: connections, first buffers
        started = time.perf_counter()
        seen = 0
        for batch in ds:
            assert (
                batch["image"].shape[1:] == (size, size, 3) and batch["image"].dtype == torch.uint8
            )
            seen += len(batch["image"])
        ours = seen / (time.perf_counter() - started)
        ds.close()
    finally:
        node.terminate()
        node.wait(timeout=30)
    console.log("LitData: optimize the encoded images, then an epoch decoding in its workers")
    out = workdir / "litdata"
    inputs = [(str(p), 0, pq.read_metadata(p).num_rows) for p in sorted(origin.glob("*.parquet"))]
    litdata.optimize(fn=_litdata_fn, inputs=inputs, output_dir=str(out), chunk_bytes="64MB",
                     num_workers=min(2, len(inputs)), mode="overwrite", verbose=False,
                     start_method="fork")  # fmt: skip
    # DataLoader workers fork (Linux), so the class made here need not be importable.
    dataset = _decoding_dataset()(input_dir=str(out), shuffle=True, seed=1)
    dataset.size = size
    loader = litdata.StreamingDataLoader(dataset, batch_size=64, num_workers=cores)
    for _ in loader:  # warm: workers' imports, the chunk cache
        pass
    started = time.perf_counter()
    seen = 0
    for batch in loader:
        assert tuple(batch["image"].shape[1:]) == (size, size, 3)
        seen += len(batch["image"])
    theirs = seen / (time.perf_counter() - started)
    return {
        "measure": f"epoch of {len(images)} images, [B,{size},{size},3] uint8, batch 64",
        "baseline": f"LitData decoding in {cores} workers",
        "ours_images_s": round(ours),
        "baseline_images_s": round(theirs),
        "ratio": round(ours / theirs, 2),
        "staging_seconds": round(staging, 2),
        "staging_images_s": round(len(images) / staging),
    }


def _decoding_dataset() -> type:
    """LitData's StreamingDataset doing the images transform's decode in ``__getitem__``."""
    import litdata

    class DecodingDataset(litdata.StreamingDataset):  # type: ignore[misc]
        size = 224

        def __getitem__(self, index: Any) -> dict[str, Any]:
            sample = super().__getitem__(index)
            spec = ImageSpec.parse({"size": str(self.size)})
            # A writable copy: torch's collate warns about (and may not own) read-only arrays.
            return {"image": np.array(_decode(sample["image"], spec)), "label": sample["label"]}

    return DecodingDataset


def run(count: int, size: int, repeat: int, console: Console) -> dict:
    console.log(f"making {count} JPEGs from matplotlib's sample photographs")
    images = make_images(count)
    subset = images[: min(300, count)]
    console.log("(a) decoders, one thread")
    found: dict[str, Any] = {"decoders_images_s_per_core": decoders(subset, size, repeat)}
    console.log("(b) the images transform, 1 thread and every core")
    one = transform_rate(images, size, 1, repeat)
    cores = usable_cores()
    many = transform_rate(images, size, cores, repeat)
    found["transform"] = {
        "one_thread_images_s": round(one),
        f"{cores}_threads_images_s": round(many),
        "per_core_images_s": round(many / cores),
        "scaling": round(many / one, 2),
    }
    workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-images-"))
    try:
        console.log("(c) an epoch: EdgeDataset (decoded at the edge) against LitData")
        found["epoch"] = epoch(workdir, images, size, console)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    found["images"] = {
        "count": count,
        "mbytes": round(sum(map(len, images)) / 1e6, 1),
        "size": size,
    }
    found["cores"] = cores
    found["versions"] = report.versions("pillow", "pyarrow", "litdata", "torch", "edgecache")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=positive_int, default=2000)
    parser.add_argument("--size", type=positive_int, default=224)
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    require_modules(parser, ("matplotlib", "PIL", "litdata", "torch"), "bench.images")
    console = Console(stderr=args.json, width=150)
    results = run(args.images, args.size, args.repeat, console)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    console.print(f"images: {results['images']}; {results['cores']} cores")
    for name, rate in results["decoders_images_s_per_core"].items():
        console.print(f"(a) {name}: {rate} images/s per core")
    console.print(f"(b) images transform: {results['transform']}")
    e = results["epoch"]
    console.print(
        f"(c) {e['measure']}: EdgeDataset {e['ours_images_s']} images/s vs {e['baseline']} "
        f"{e['baseline_images_s']} images/s: {e['ratio']}x (staging, decoded once: "
        f"{e['staging_seconds']} s, {e['staging_images_s']} images/s)"
    )
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()))


if __name__ == "__main__":
    main()
