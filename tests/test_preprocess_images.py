"""The images transform on real images no one here made (matplotlib's sample data), and a
node decoding them at the edge so EdgeDataset yields [B, H, W, C] uint8 tensors."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from datagen import tar_archive

from edgecache.cache.errors import MalformedShard
from edgecache.cache.manifest import manifest_schema, preprocess_spec
from edgecache.cache.preprocess import ShardContext, load_transform, preprocess
from edgecache.cache.preprocess.images import decoder_version
from edgecache.cache.registry import Registry
from edgecache.v1 import manifest_pb2 as pb

Image = pytest.importorskip("PIL.Image")
mpl = pytest.importorskip("matplotlib")
SAMPLES = Path(mpl.get_data_path()) / "sample_data"


def real_images() -> dict[str, bytes]:
    """A JPEG, a paletted/RGBA PNG, and the JPEG transcoded to WebP (none ship as WebP)."""
    jpeg = (SAMPLES / "grace_hopper.jpg").read_bytes()
    webp = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(webp, "WEBP", quality=80)
    return {
        "jpeg": jpeg,
        "png": (SAMPLES / "Minduka_Present_Blue_Pack.png").read_bytes(),
        "logo": (SAMPLES / "logo2.png").read_bytes(),
        "webp": webp.getvalue(),
    }


def batch_of(images: list[bytes | None], keys: list[str] | None = None) -> pa.RecordBatch:
    columns = {"image": pa.array(images, pa.binary()), "label": pa.array(range(len(images)))}
    if keys is not None:
        columns = {"__key__": pa.array(keys), **columns}
    return pa.RecordBatch.from_pydict(columns)


def spec(**params: str) -> pb.PreprocessSpec:
    return pb.PreprocessSpec(transform="images", params=params)


def run(batch: pa.RecordBatch, pool: ThreadPoolExecutor | None = None, **params: str):
    context = ShardContext()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    out = list(
        preprocess(
            sink.getvalue().to_pybytes(),
            fmt=pb.SOURCE_FORMAT_ARROW_IPC,
            source="s3://b/imgs/part-0.arrow",
            spec=spec(**params),
            context=context,
            pool=pool,
        )
    )
    return pa.Table.from_batches(out), context


def pixels(table: pa.Table, column: str = "image") -> np.ndarray:
    field = table.schema.field(column).type
    shape = []
    while pa.types.is_fixed_size_list(field):
        shape.append(field.list_size)
        field = field.value_type
    flat = table.column(column).combine_chunks().flatten().flatten().flatten()
    return flat.to_numpy().reshape(len(table), *shape)


def test_every_format_decodes_to_the_fixed_shape() -> None:
    images = real_images()
    table, _ = run(batch_of(list(images.values())), size="64")
    assert table.schema.field("image").type == pa.list_(pa.list_(pa.list_(pa.uint8(), 3), 64), 64)
    array = pixels(table)
    assert array.shape == (4, 64, 64, 3) and array.dtype == np.uint8
    assert table.column("label").to_pylist() == [0, 1, 2, 3]
    # The WebP is a lossy copy of the JPEG: the same picture, near enough, in R, G, B order.
    assert np.abs(array[0].astype(int) - array[3].astype(int)).mean() < 8
    reference = np.asarray(Image.open(io.BytesIO(images["jpeg"])).convert("RGB").resize((64, 75)))
    centre = reference[5:69].astype(int)  # crop keeps the centre rows of the portrait
    assert np.abs(array[0].astype(int) - centre).mean() < 12


def test_a_binary_view_column_decodes_like_a_binary_one() -> None:
    """Polars writes binary_view: refused ("is binary_view, not binary"), with no cast
    possible before the one transform a version has; and not found as the only binary
    column when column= is left out."""
    images = list(real_images().values())
    plain, _ = run(batch_of(images), size="16")
    batch = batch_of(images)
    viewed = batch.set_column(0, "image", batch.column(0).cast(pa.binary_view()))
    for params in ({"size": "16", "column": "image"}, {"size": "16"}):
        table, _ = run(viewed, **params)
        assert table.equals(plain), params


def test_crop_pad_gray_and_rectangles() -> None:
    jpeg = real_images()["jpeg"]  # 512 wide, 600 high
    padded = pixels(run(batch_of([jpeg]), height="48", width="96", fit="pad", fill="7")[0])[0]
    assert padded.shape == (48, 96, 3)
    assert (padded[:, :10] == 7).all() and (padded[:, -10:] == 7).all()  # bars left and right
    assert not (padded[:, 40:56] == 7).all()
    gray = pixels(run(batch_of([jpeg]), size="32", channels="gray")[0])
    assert gray.shape == (1, 32, 32, 1)


def test_output_is_the_same_bytes_serial_and_on_threads() -> None:
    images = list(real_images().values()) * 10
    serial, _ = run(batch_of(images), size="40", output="pixels")
    with ThreadPoolExecutor(4) as pool:
        threaded, _ = run(batch_of(images), pool=pool, size="40", output="pixels")
    assert serial.equals(threaded) and "pixels" in serial.column_names


def test_corrupt_image_fails_naming_object_and_sample() -> None:
    good = real_images()["jpeg"]
    images = [good, good, good[:300], good]
    with pytest.raises(MalformedShard) as info:
        run(batch_of(images, keys=["a", "b", "c", "d"]), size="16")
    message = str(info.value)
    assert "s3://b/imgs/part-0.arrow" in message and "sample 2 (key 'c')" in message
    assert "on_error=skip" in message


def test_skip_policy_drops_and_counts() -> None:
    good = real_images()["png"]
    images = [good, b"not an image", None, good]
    table, context = run(batch_of(images), size="16", on_error="skip")
    assert table.column("label").to_pylist() == [0, 3]
    assert context.skipped == 2 and "sample 1" in context.notes[0]
    # Pillow's reason named its in-memory file ("<_io.BytesIO object at 0x7f…>").
    assert "not an image Pillow can read" in context.notes[0], context.notes
    assert "object at 0x" not in " ".join(context.notes)


def test_bad_params_and_decoder_pin() -> None:
    with pytest.raises(ValueError, match="needs size=N"):
        load_transform("images", {})
    with pytest.raises(ValueError, match="fit='stretch'"):
        load_transform("images", {"size": "8", "fit": "stretch"})
    with pytest.raises(ValueError, match="install pillow==0.0.1"):
        load_transform("images", {"size": "8", "decoder": "pillow-0.0.1"})
    # The syntax its own message once gave (height=H,width=W) is one --param: say so.
    with pytest.raises(ValueError, match="each param as its own --param"):
        load_transform("images", {"height": "224,width=160"})
    with pytest.raises(ValueError, match="--param height=H --param width=W"):
        load_transform("images", {"size": "8", "height": "8"})
    with pytest.raises(MalformedShard, match="say which column"):
        run(pa.RecordBatch.from_pydict({"a": pa.array([b"x"]), "b": pa.array([b"y"])}), size="8")


def test_node_decodes_webdataset_images_for_edgedataset(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from edgecache.clients.dataset import EdgeDataset
    from edgecache.edge.config import NodeConfig
    from edgecache.edge.server import running_node

    images = real_images()
    kinds = ["jpeg", "png", "webp", "logo"]
    origin = tmp_path / "origin"
    origin.mkdir()
    for shard in range(2):
        members = []
        for i in range(6):
            kind = kinds[(shard + i) % 4]
            members += [
                (f"s{shard}_{i:02d}.cls", b"%d" % i),
                (f"s{shard}_{i:02d}.img", images[kind]),
            ]
        (origin / f"shard-{shard}.tar").write_bytes(tar_archive(members))
    registry = f"file://{tmp_path}/registry"
    publish_spec = preprocess_spec(transform="images", params={"column": "img", "size": "32"})
    manifest = Registry.run(
        registry, lambda reg: reg.publish(f"file://{origin}", "pics", spec=publish_spec)
    )
    assert manifest.preprocess.params["decoder"] == decoder_version()  # pinned at publish
    assert manifest_schema(manifest).field("img").type == pa.list_(
        pa.list_(pa.list_(pa.uint8(), 3), 32), 32
    )
    config = NodeConfig(
        region="r",
        cache_dir=tmp_path / "cache",
        registry=registry,
        listen="127.0.0.1:0",
        sync=False,
    )
    with running_node(config) as node:
        ds = EdgeDataset(
            "pics@1", endpoints=[node.address], batch_size=4, shuffle=False, columns=["img", "cls"]
        )
        batches = list(ds)
        assert node.node.metrics.value("edgecache_preprocess_cpu_seconds_total") > 0
        status = node.node.status()
        assert status.staging_bytes_per_second > 0 and status.staging_cpu_seconds_per_gb > 0
    images_seen = torch.cat([b["img"] for b in batches])
    assert images_seen.shape == (12, 32, 32, 3) and images_seen.dtype == torch.uint8
    # The node's pixels are the transform's pixels: decode the first tar here and compare.
    local, _ = run(batch_of([images[kinds[i % 4]] for i in range(6)]), size="32", column="image")
    assert images_seen[:6].numpy().tobytes() == pixels(local).tobytes()
