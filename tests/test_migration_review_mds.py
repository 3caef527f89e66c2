"""Migrating from other loaders' formats with publish (a reviewer's findings).

Real MDS written by mosaicml-streaming's MDSWriter (and merged by its merge_index),
real LitData chunks written by LitData's own writer, Hugging Face-shaped Parquet,
published through a real registry on file:// and read back as a node reads them.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from edgeutil import streaming_module
from typer.testing import CliRunner

from edgecache.cache.errors import MalformedShard, ObjectNotFound
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.preprocess import preprocess
from edgecache.cache.registry import Registry
from edgecache.clients.cli import app
from edgecache.v1 import manifest_pb2 as pb

runner = CliRunner()


def write_mds(out: Path, first: int, count: int, **options: object) -> None:
    """``count`` samples (id, text) from ``first``, six to a shard."""
    with streaming_module().MDSWriter(
        out=str(out), columns={"id": "int", "t": "str"}, size_limit=300, **options
    ) as writer:
        for i in range(first, first + count):
            writer.write({"id": i, "t": f"sample {i}"})


def publish(tmp_path: Path, source: str, name: str = "x", **kwargs: object) -> pb.Manifest:
    spec = kwargs.pop("spec", None) or preprocess_spec()
    return Registry.run(
        f"file://{tmp_path}/registry",
        lambda reg: reg.publish(source, name, spec=spec, **kwargs),  # type: ignore[arg-type]
    )


def rows_of(root: Path, manifest: pb.Manifest, column: str = "id") -> list[object]:
    """Every shard of the version read as a node reads it, in the version's order."""
    schema = pa.ipc.read_schema(pa.py_buffer(manifest.arrow_schema))
    out: list[object] = []
    for shard in manifest.shards:
        data = (root / shard.source_key).read_bytes()
        for batch in preprocess(
            data,
            fmt=manifest.source_format,
            source=shard.source_key,
            spec=manifest.preprocess,
            schema=schema,
        ):
            out += batch.column(column).to_pylist()
    return out


def cli(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["publish", *args])
    return result.exit_code, " ".join(result.output.split())


# ------------------------------------------------------------ 1. nested MDS: each shard once


@pytest.fixture
def nested(tmp_path: Path) -> Path:
    """Per-stream folders a/, b/ with their own index.json, and a merged root index."""
    root = tmp_path / "nested"
    write_mds(root / "a", 0, 12)
    write_mds(root / "b", 100, 12)
    streaming_module().base.util.merge_index(str(root), keep_local=True)
    assert len(json.loads((root / "index.json").read_text())["shards"]) > 2
    return root


def test_a_nested_mds_dataset_publishes_every_sample_once(tmp_path: Path, nested: Path) -> None:
    expected = [*range(12), *range(100, 112)]
    for source in (f"file://{nested}", f"file://{nested}/index.json"):
        manifest = publish(tmp_path, source)
        keys = [s.source_key for s in manifest.shards]
        assert len(keys) == len(set(keys)), keys
        assert sum(s.row_count for s in manifest.shards) == 24
        assert rows_of(nested, manifest) == expected  # the root index's order
    # Without the root, the streams' own indexes: the same shards, in the same order.
    (nested / "index.json").unlink()
    again = publish(tmp_path, f"file://{nested}")
    assert [s.source_key for s in again.shards] == keys


def test_indexes_disagreeing_about_a_shard_are_refused_naming_both(
    tmp_path: Path, nested: Path
) -> None:
    index = json.loads((nested / "index.json").read_text())
    index["shards"][0]["samples"] -= 1  # a stale root
    (nested / "index.json").write_text(json.dumps(index))
    with pytest.raises(MalformedShard) as caught:
        publish(tmp_path, f"file://{nested}")
    message = str(caught.value)
    assert f"{nested}/index.json says a/shard.00000.mds holds" in message
    assert f"{nested}/a/index.json says" in message and "stale" in message
    # --exclude leaves the stale root out: the streams' own indexes are whole.
    manifest = publish(tmp_path, f"file://{nested}", exclude=["index.json"])
    assert sum(s.row_count for s in manifest.shards) == 24


def test_a_stream_left_out_by_a_pattern_is_said_so_with_the_index_to_leave_out(
    tmp_path: Path, nested: Path
) -> None:
    """A hunt: --exclude 'b/*' kept the root index.json, which lists b's shards too, and
    they were called "not under" the prefix, with advice to upload the whole directory,
    which changes nothing: the directory was whole."""
    with pytest.raises(ObjectNotFound) as caught:
        publish(tmp_path, f"file://{nested}", exclude=["b/*"])
    message = " ".join(str(caught.value).split())
    assert message.startswith("index.json lists b/shard.00000.mds"), message
    assert "left out by --exclude 'b/*'" in message and "--exclude index.json" in message
    assert "upload the whole MDS directory" not in message, message
    # The fix it gives: the streams' own indexes, a/ alone.
    manifest = publish(tmp_path, f"file://{nested}", exclude=["b/*", "index.json"])
    assert rows_of(nested, manifest) == list(range(12))
    # One folder of one index: there is no other index to fall back on (a review).
    flat = tmp_path / "flat"
    write_mds(flat, 0, 12)
    with pytest.raises(ObjectNotFound) as caught:
        publish(tmp_path, f"file://{flat}", exclude=["shard.00001.mds"])
    said = " ".join(str(caught.value).split())
    assert "left out by --exclude 'shard.00001.mds'" in said, said
    assert "no other index lists the shards you keep" in said and "index.json:" not in said
    # A shard that is really missing is still said to be.
    next((nested / "a").glob("shard.*.mds")).unlink()
    with pytest.raises(ObjectNotFound, match="upload the whole MDS directory"):
        publish(tmp_path, f"file://{nested}", exclude=["b/*"])


# ------------------------------------------------------------ 2. a Streaming local cache


def test_a_streaming_local_cache_publishes_from_its_decompressed_shards(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    write_mds(root, 0, 10, compression="zstd")
    entries = json.loads((root / "index.json").read_text())["shards"]
    for entry in entries:  # as StreamingDataset(local=…) leaves them: raw, the zip gone
        zipped = root / entry["zip_data"]["basename"]
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(zipped.read_bytes())).read()
        (root / entry["raw_data"]["basename"]).write_bytes(raw)
        zipped.unlink()
    manifest = publish(tmp_path, f"file://{root}")
    assert [s.source_key for s in manifest.shards] == [e["raw_data"]["basename"] for e in entries]
    assert rows_of(root, manifest) == list(range(10))
    assert rows_of(root, manifest, "t")[3] == "sample 3"


# ------------------------------------------------------------ 3. an MDS pil column


def test_an_mds_pil_column_is_refused_by_images_at_publish(tmp_path: Path) -> None:
    from PIL import Image

    picture = Image.fromarray(np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3))
    root = tmp_path / "pix"
    with streaming_module().MDSWriter(
        out=str(root), columns={"id": "int", "pl": "pil", "jp": "jpeg"}
    ) as writer:
        for i in range(3):
            writer.write({"id": i, "pl": picture, "jp": picture})
    spec = preprocess_spec(transform="images", params={"column": "pl", "size": "4"})
    with pytest.raises(MalformedShard) as caught:
        publish(tmp_path, f"file://{root}", spec=spec)
    message = str(caught.value)
    assert "column 'pl' has MDS encoding 'pil'" in message
    assert "jp" in message and "on_error=skip" not in message
    assert not (tmp_path / "registry" / "x").exists()
    ok = publish(tmp_path, f"file://{root}", spec=preprocess_spec(
        transform="images", params={"column": "jp", "size": "4"}))  # fmt: skip
    assert len(rows_of(root, ok, "jp")[0]) == 4


# ------------------------------------------------------------ 4. LitData


@pytest.fixture
def litdata_dir(tmp_path: Path) -> Path:
    if importlib.util.find_spec("litdata") is None:
        pytest.skip("litdata is not installed")
    from litdata.streaming.writer import BinaryWriter  # what optimize() writes with

    out = tmp_path / "lit"
    writer = BinaryWriter(str(out), chunk_size=10)
    for i in range(30):
        writer.add_item(i, {"index": i, "text": f"t{i}"})
    writer.done()
    writer.merge()
    assert len(list(out.glob("chunk-*.bin"))) > 1
    return out


@pytest.mark.parametrize(
    ("where", "fmt"),
    [("", None), ("/index.json", None), ("", pb.SOURCE_FORMAT_MDS), ("", pb.SOURCE_FORMAT_JSONL)],
)
def test_a_litdata_output_is_refused_plainly(
    tmp_path: Path, litdata_dir: Path, where: str, fmt: int | None
) -> None:
    with pytest.raises(MalformedShard) as caught:
        publish(tmp_path, f"file://{litdata_dir}{where}", fmt=fmt)
    message = str(caught.value)
    assert f"{litdata_dir}/index.json is a LitData index" in message
    assert "export the dataset to Parquet" in message
    assert not (tmp_path / "registry" / "x").exists()


def test_an_index_without_shards_is_not_a_keyerror_repr(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "index.json").write_text('{"version": 2}')
    with pytest.raises(MalformedShard) as caught:
        publish(tmp_path, f"file://{tmp_path}/m", fmt=pb.SOURCE_FORMAT_MDS)
    assert "('shards')" not in str(caught.value)
    assert "it has no list of 'shards'" in str(caught.value)


# ------------------------------------------------------------ 5. --include / --exclude


@pytest.fixture
def hub(tmp_path: Path) -> Path:
    """A Hugging Face dataset repository's layout: a README and two splits."""
    root = tmp_path / "hub"
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text("---\nlicense: mit\n---\n# a dataset\n")
    for split, n in (("train", 5), ("test", 3)):
        table = pa.table({"id": list(range(n)), "split": [split] * n})
        pq.write_table(table, root / "data" / f"{split}-00000-of-00001.parquet")
    return root


def test_a_readme_beside_shards_is_advised_away_with_exclude(tmp_path: Path, hub: Path) -> None:
    code, out = cli(str(hub), "--dataset", "s", "--registry", str(tmp_path / "r"))
    assert code == 2, out
    assert "--exclude 'README.md'" in out and "--include '*.parquet'" in out
    code, out = cli(str(hub), "--dataset", "s", "--registry", str(tmp_path / "r"),
                    "--exclude", "README.md")  # fmt: skip
    assert code == 0, out
    assert "(2 shards, 8 rows)" in out


def test_include_chooses_a_split_and_a_glob_source_does_too(tmp_path: Path, hub: Path) -> None:
    by_flag = publish(tmp_path, f"file://{hub}", include=["data/train-*"])
    assert [s.source_key for s in by_flag.shards] == ["data/train-00000-of-00001.parquet"]
    by_glob = publish(tmp_path, f"file://{hub}/data/train-*.parquet")
    assert by_glob.source_url == f"file://{hub}/data/"
    assert [s.source_key for s in by_glob.shards] == ["train-00000-of-00001.parquet"]
    assert sum(s.row_count for s in by_glob.shards) == 5
    assert rows_of(hub / "data", by_glob, "split") == ["train"] * 5
    code, out = cli(f"{hub}/data/test-*", "--dataset", "t", "--registry", str(tmp_path / "r"))
    assert code == 0 and "(1 shard, 3 rows)" in out, out


def test_patterns_that_select_nothing_are_named(tmp_path: Path, hub: Path) -> None:
    with pytest.raises(ObjectNotFound) as caught:
        publish(tmp_path, f"file://{hub}/data/val-*")
    assert "the source's pattern 'val-*'" in str(caught.value)
    assert "train-00000-of-00001.parquet" in str(caught.value)
    with pytest.raises(ObjectNotFound, match=r"--include 'x\*', --exclude '\*\.md'"):
        publish(tmp_path, f"file://{hub}", include=["x*"], exclude=["*.md"])
    # One of two patterns a typo: it was dropped without a word (the other matched), and
    # the version published without that split.
    with pytest.raises(ObjectNotFound, match=r"--include 'data/tset-\*' selects no object"):
        publish(tmp_path, f"file://{hub}", include=["data/train-*", "data/tset-*"])


def test_publish_help_documents_include_and_exclude() -> None:
    result = runner.invoke(app, ["publish", "--help"], env={"COLUMNS": "200"})
    assert "--include" in result.output and "--exclude" in result.output
    assert "train-*.parquet" in result.output


def test_a_wids_index_beside_tars_is_advised_away(tmp_path: Path) -> None:
    root = tmp_path / "wids"
    root.mkdir()
    for n in range(2):
        with tarfile.open(root / f"shard-{n}.tar", "w") as tar:
            for ext, body in (("txt", b"hello"), ("cls", b"1")):
                info = tarfile.TarInfo(f"s{n}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    (root / "train.json").write_text(json.dumps({"wids_version": 1, "shardlist": []}))
    with pytest.raises(MalformedShard, match=r"--include '\*\.tar'"):
        publish(tmp_path, f"file://{root}")
    manifest = publish(tmp_path, f"file://{root}", exclude=["train.json"])
    assert [s.source_key for s in manifest.shards] == ["shard-0.tar", "shard-1.tar"]


# ------------------------------------------------------------ 6. Hugging Face Image() structs


def test_a_hugging_face_image_struct_decodes_by_its_bytes_field(tmp_path: Path) -> None:
    from PIL import Image

    encoded = io.BytesIO()
    Image.new("RGB", (16, 12), (200, 10, 30)).save(encoded, format="PNG")
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": encoded.getvalue(), "path": f"{i}.png"} for i in range(3)], kind)
    root = tmp_path / "hf"
    root.mkdir()
    pq.write_table(pa.table({"image": images, "label": [0, 1, 2]}), root / "train.parquet")
    refused = preprocess_spec(transform="images", params={"column": "image", "size": "8"})
    with pytest.raises(MalformedShard, match="column=image.bytes"):
        publish(tmp_path, f"file://{root}", spec=refused)
    spec = preprocess_spec(transform="images", params={"column": "image.bytes", "size": "8"})
    manifest = publish(tmp_path, f"file://{root}", spec=spec)
    schema = pa.ipc.read_schema(pa.py_buffer(manifest.arrow_schema))
    assert schema.names == ["image", "label"]
    pixels = np.array(rows_of(root, manifest, "image"), np.uint8)
    assert pixels.shape == (3, 8, 8, 3) and pixels[0, 4, 4].tolist() == [200, 10, 30]


# ------------------------------------------------------------ 7. smaller ones


def test_a_tgz_webdataset_shard_tells_its_format(tmp_path: Path) -> None:
    root = tmp_path / "tgz"
    root.mkdir()
    for n, name in enumerate(("part-0.tar.gz", "part-1.tgz")):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo(f"s{n}.txt")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
        (root / name).write_bytes(gzip.compress(buffer.getvalue()))
    manifest = publish(tmp_path, f"file://{root}")
    assert manifest.source_format == pb.SOURCE_FORMAT_WEBDATASET
    assert sum(s.row_count for s in manifest.shards) == 2


def test_a_json_array_is_advised_to_become_json_lines(tmp_path: Path) -> None:
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "d.json").write_text(json.dumps([{"a": 1}, {"a": 2}], indent=1))
    with pytest.raises(MalformedShard) as caught:
        publish(tmp_path, f"file://{tmp_path}/j")
    assert "is a JSON array" in str(caught.value)
    assert "convert it to JSON Lines" in str(caught.value)
    assert "fix or remove the object" not in str(caught.value)


def test_one_mds_shard_as_the_source_is_a_version_of_that_shard(tmp_path: Path) -> None:
    root = tmp_path / "m"
    write_mds(root, 0, 10)
    entries = json.loads((root / "index.json").read_text())["shards"]
    assert len(entries) > 1
    key, first = entries[1]["raw_data"]["basename"], entries[0]["samples"]
    manifest = publish(tmp_path, f"file://{root}/{key}")
    assert [s.source_key for s in manifest.shards] == [key]
    assert rows_of(root, manifest) == list(range(first, first + entries[1]["samples"]))


def test_a_stale_index_count_is_named_stale_not_a_changed_origin(tmp_path: Path) -> None:
    """A shard holding other samples than its index.json said was reported as "origin
    changed under an immutable version", though publish never reads MDS shards."""
    from concurrent.futures import ThreadPoolExecutor

    from edgecache.cache.preprocess import load_transform
    from edgecache.edge.preprocessing import encode_raw_shard

    write_mds(tmp_path / "mds", 0, 6)
    index_path = tmp_path / "mds" / "index.json"
    index = json.loads(index_path.read_text())
    index["shards"][0]["samples"] -= 2  # stale: written before the shard's last samples
    index_path.write_text(json.dumps(index))
    manifest = publish(tmp_path, f"file://{tmp_path}/mds")
    shard = manifest.shards[0]
    data = (tmp_path / "mds" / shard.source_key).read_bytes()
    with ThreadPoolExecutor(1) as parts, pytest.raises(MalformedShard) as info:
        encode_raw_shard(data, manifest, shard, "s", load_transform("identity", {}), parts)
    message = str(info.value)
    assert "index is stale" in message and "origin changed" not in message, message
    assert f"recorded {shard.row_count}" in message, message
