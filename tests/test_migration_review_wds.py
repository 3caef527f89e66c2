"""Migrating WebDataset tars (and JSON Lines/CSV beside them) as a reviewer did: tars written
with webdataset's own TarWriter/ShardWriter, read back with webdataset's own reader, and
published through a real registry on file://; what edgecache publishes must be what
webdataset reads (keys, types), or a refusal that names the member and says what to do."""

from __future__ import annotations

import json
import tarfile
from decimal import Decimal
from io import BytesIO
from pathlib import Path

import pyarrow as pa
import pytest

from edgecache.cache.errors import MalformedShard
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.preprocess import canonical_options, read_source
from edgecache.cache.registry import Registry
from edgecache.v1 import manifest_pb2 as pb

wds = pytest.importorskip("webdataset")
WDS, CSV = pb.SOURCE_FORMAT_WEBDATASET, pb.SOURCE_FORMAT_CSV


def write_tar(path: Path, samples: list[dict]) -> Path:
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return path


def webdataset_samples(*paths: Path, decode: bool = False) -> list[dict]:
    """What webdataset's own reader yields for the shards, in order."""
    dataset = wds.WebDataset([str(p) for p in paths], shardshuffle=False)
    return list(dataset.decode() if decode else dataset)


def read(data: bytes, fmt: pb.SourceFormat.ValueType = WDS, **options: str) -> pa.Table:
    return pa.Table.from_batches(
        list(read_source(data, fmt=fmt, source="s3://b/x", options=canonical_options(fmt, options)))
    )


def publish(
    tmp_path: Path, source: Path, name: str, fmt: pb.SourceFormat.ValueType | None = None, **spec
) -> pb.Manifest:
    options = spec.pop("source_options", {})
    preprocess = preprocess_spec(**spec)
    preprocess.source_options.update(options)
    return Registry.run(
        f"file://{tmp_path}/registry",
        lambda reg: reg.publish(f"file://{source}", name, fmt=fmt, spec=preprocess),
    )


def refused(tmp_path: Path, source: Path, name: str, **kwargs) -> str:
    with pytest.raises(MalformedShard) as info:
        publish(tmp_path, source, name, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------- keys starting with __


def test_keys_whose_file_name_starts_with_dunder_are_samples_as_webdataset_reads_them(
    tmp_path: Path,
) -> None:
    """Only what webdataset skips as metadata is skipped: a top-level ``__x__`` member or
    anything under a ``__x__/`` folder; ``x/__a``, ``y/__b__`` and ``__c`` are samples."""
    keys = ["plain", "x/__a", "y/__b__", "__c", "dir/_u", "__d__e"]
    (tmp_path / "wds").mkdir()
    shard = write_tar(
        tmp_path / "wds" / "s-0.tar",
        [{"__key__": k, "jpg": b"j%d" % i, "cls": b"%d" % i} for i, k in enumerate(keys)],
    )
    with tarfile.open(shard, "a") as tar:  # metadata webdataset skips
        for name in ("__meta__", "__info__/about.json", "__x__.json/a.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, BytesIO(b"{}"))
    theirs = webdataset_samples(shard)
    # "__x__.json/" is no __x__ folder: webdataset reads a sample there (key __x__.json/a).
    assert [s["__key__"] for s in theirs] == [*keys, "__x__.json/a"]
    table = read(shard.read_bytes())
    assert table.column("__key__").to_pylist() == [s["__key__"] for s in theirs]
    assert table.column("jpg").to_pylist() == [s.get("jpg") for s in theirs]
    manifest = publish(tmp_path, tmp_path / "wds", "dunder")
    assert [s.row_count for s in manifest.shards] == [len(theirs)]


# ---------------------------------------------------------------- multi-dot extensions


def test_multi_dot_extensions_are_typed_by_their_last_part_as_webdataset_decodes_them(
    tmp_path: Path,
) -> None:
    samples = [
        {
            "__key__": f"k{i}",
            "jpg": b"x%d" % i,
            "caption.txt": f"a cat {i}",
            "label.cls": i,
            "meta.json": {"a": i},
            "seg.png": bytes([i]) * 3,
        }
        for i in range(3)
    ]
    shard = write_tar(tmp_path / "s-0.tar", samples)
    theirs = webdataset_samples(shard, decode=True)
    assert type(theirs[0]["caption.txt"]) is str and type(theirs[0]["label.cls"]) is int
    table = read(shard.read_bytes())
    assert dict(zip(table.column_names, table.schema.types, strict=True)) == {
        "__key__": pa.string(),
        "caption.txt": pa.string(),
        "jpg": pa.binary(),
        "label.cls": pa.int64(),
        "meta.json": pa.string(),  # JSON stays its text, as a single-part .json does
        "seg.png": pa.binary(),
    }
    rows = table.to_pylist()
    for mine, their in zip(rows, theirs, strict=True):
        assert mine["caption.txt"] == their["caption.txt"]
        assert mine["label.cls"] == their["label.cls"]
        assert json.loads(mine["meta.json"]) == their["meta.json"]
        assert mine["seg.png"] == webdataset_samples(shard)[rows.index(mine)]["seg.png"]


# ---------------------------------------------------------------- .id holding text, wids index


def test_an_int_member_that_holds_text_is_refused_at_publish_naming_it(tmp_path: Path) -> None:
    (tmp_path / "wds").mkdir()
    shard = write_tar(
        tmp_path / "wds" / "s-0.tar",
        [{"__key__": f"k{i}", "jpg": b"x", "id": f"img-{i:03d}".encode()} for i in range(3)],
    )
    with pytest.raises(wds.autodecode.DecodingError):  # webdataset's .decode() fails too
        webdataset_samples(shard, decode=True)
    message = refused(tmp_path, tmp_path / "wds", "strid")
    assert "sample 'k0': id holds b'img-000'" in message
    assert "member k0.id" in message and "--column-types" in message and ".id.txt" in message
    huge = write_tar(tmp_path / "huge.tar", [{"__key__": "k", "cls": b"99999999999999999999"}])
    with pytest.raises(MalformedShard, match=r"'k': cls holds .*, an integer past int64"):
        read(huge.read_bytes())
    # Named as the message says, the same values publish as a string column.
    write_tar(
        shard,
        [{"__key__": f"k{i}", "jpg": b"x", "id.txt": f"img-{i:03d}"} for i in range(3)],
    )
    manifest = publish(tmp_path, tmp_path / "wds", "strid")
    assert [s.row_count for s in manifest.shards] == [3]
    assert read(shard.read_bytes()).column("id.txt").to_pylist() == [
        "img-000",
        "img-001",
        "img-002",
    ]


def test_a_wids_index_beside_the_shards_is_named_an_index_not_a_damaged_tar(
    tmp_path: Path,
) -> None:
    (tmp_path / "wds").mkdir()
    for n in range(2):
        write_tar(
            tmp_path / "wds" / f"train-{n}.tar",
            [{"__key__": f"s{n}_{i}", "cls": i} for i in range(2)],
        )
    index = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": "train",
        "shardlist": [{"url": f"train-{n}.tar", "nsamples": 2} for n in range(2)],
    }
    (tmp_path / "wds" / "train.json").write_text(json.dumps(index, indent=2))
    message = refused(tmp_path, tmp_path / "wds", "wids", fmt=WDS)
    assert "train.json is a wids index" in message and "--exclude train.json" in message
    assert "not a readable tar" not in message
    # A JSON file that is no index is still just not a tar.
    (tmp_path / "wds" / "train.json").write_text('{"a": 1}')
    assert "not a readable tar archive" in refused(tmp_path, tmp_path / "wds", "wids", fmt=WDS)


# ---------------------------------------------------------------- optional extensions


def test_shards_with_other_optional_extensions_are_told_the_select_that_publishes_them(
    tmp_path: Path,
) -> None:
    (tmp_path / "wds").mkdir()
    samples = [{"__key__": f"k{i}", "jpg": b"j%d" % i, "cls": i} for i in range(4)]
    samples[1]["json"] = {"note": 1}  # optional metadata, only in the first shard
    with wds.ShardWriter(str(tmp_path / "wds" / "s-%d.tar"), maxcount=2, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)
    message = refused(tmp_path, tmp_path / "wds", "diffext")
    assert "all objects of a version must agree" in message
    assert message.endswith("--transform columns --param select=__key__,cls,jpg")
    assert "leaving out json" in message
    manifest = publish(
        tmp_path,
        tmp_path / "wds",
        "diffext",
        transform="columns",
        params={"select": "__key__,cls,jpg"},
    )
    assert [s.row_count for s in manifest.shards] == [2, 2]
    theirs = webdataset_samples(*sorted((tmp_path / "wds").glob("s-*.tar")), decode=True)
    assert [s["cls"] for s in theirs] == [0, 1, 2, 3]


# ---------------------------------------------------------------- integers past 2**53


def test_a_csv_integer_past_2_53_beside_fractions_is_refused_not_rounded(tmp_path: Path) -> None:
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "d.csv").write_text("x,y\n1,a\n1.5,b\n9007199254740993,c\n")
    message = refused(tmp_path, tmp_path / "csv", "intfloat")
    assert "d.csv line 4: column 'x' holds the integer 9007199254740993" in message
    assert "9007199254740992.0" in message and "--column-types 'x=decimal128(38, 9)'" in message
    typed = read((tmp_path / "csv" / "d.csv").read_bytes(), CSV, column_types="x=decimal128(38, 9)")
    assert typed.column("x").to_pylist() == [Decimal(1), Decimal("1.5"), Decimal(2**53 + 1)]
    # A float64 holds 2**53 + 2 exactly: nothing is lost, nothing refused.
    (tmp_path / "csv" / "d.csv").write_text("x,y\n1,a\n1.5,b\n9007199254740994,c\n")
    assert [s.row_count for s in publish(tmp_path, tmp_path / "csv", "intfloat").shards] == [3]


def test_a_jsonl_integer_past_2_53_beside_fractions_is_refused_not_rounded() -> None:
    """9007199254740993 beside 1.5 became 9007199254740992.0: the check refused only
    integers past int64."""
    jsonl = pb.SOURCE_FORMAT_JSONL
    data = b'{"x": 1}\n{"x": 1.5}\n{"x": 9007199254740993}\n'
    with pytest.raises(
        MalformedShard,
        match=r"line 3: field 'x' holds the integer 9007199254740993.*'x=decimal128\(38, 9\)'",
    ):
        pa.Table.from_batches(list(read_source(data, fmt=jsonl, source="s3://b/x")))
    typed = read(data, jsonl, column_types="x=decimal128(38, 9)")
    assert typed.column("x").to_pylist()[2] == Decimal(2**53 + 1)
