"""Hive-style partitions: ``key=value`` folders become columns, as readers of such data have them.

Spark, Hive and pyarrow.dataset leave partition columns out of the files: the
values live in the keys alone (``events/year=2023/month=01/part-0.parquet``).
A version published from such a prefix used to lose them without a word.
Each test publishes through a real ``file://`` registry (or moto's S3) and
reads the rows back from a real node on loopback.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from edgeutil import node_settings, publish, read_shard_table, stub
from s3server import make_bucket, put_object
from typer.testing import CliRunner

from edgecache.cache.manifest import build_manifest, manifest_schema, preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.clients.cli import app
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

runner = CliRunner()

# (folders, rows): what Spark writes for a table partitioned by year, month and city.
LAYOUT = {
    "year=2023/month=01/city=Paris": 3,
    "year=2024/month=02/city=New%20York": 2,
    "year=__HIVE_DEFAULT_PARTITION__/month=12/city=__HIVE_DEFAULT_PARTITION__": 4,
}
EXPECTED = {  # the values a reader gets, per object
    "year=2023/month=01/city=Paris": (2023, 1, "Paris"),
    "year=2024/month=02/city=New%20York": (2024, 2, "New York"),
    "year=__HIVE_DEFAULT_PARTITION__/month=12/city=__HIVE_DEFAULT_PARTITION__": (None, 12, None),
}


def cli(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "400"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"not an error line but {result.exception!r}:\n{result.output}")
    return result.exit_code, result.output


def write_layout(root: Path, layout: dict[str, int], **extra: list[object]) -> None:
    start = 0
    for folders, rows in layout.items():
        (root / folders).mkdir(parents=True)
        columns: dict[str, list[object]] = {"x": list(range(start, start + rows))}
        columns.update({name: values[:rows] for name, values in extra.items()})
        pq.write_table(pa.table(columns), root / folders / "part-0.parquet")
        start += rows


def staged_rows(tmp_path: Path, registry: str, manifest: pb.Manifest) -> dict[str, list[dict]]:
    """Every shard's rows as a node serves them, by source key."""
    name, version = manifest.dataset, manifest.version
    with running_node(node_settings(tmp_path, registry)) as node:
        client = stub(node.address)
        last = list(client.Stage(edge_pb2.StageRequest(dataset=name, version=version)))[-1]
        assert last.finished and not last.shards_failed, last
        return {
            s.source_key: read_shard_table(client, name, version, s.index).to_pylist()
            for s in manifest.shards
        }


def test_partition_folders_become_typed_columns_read_back_per_row(tmp_path: Path) -> None:
    write_layout(tmp_path / "events", LAYOUT)
    registry = f"file://{tmp_path}/registry"
    manifest = publish(registry, str(tmp_path / "events"), "events")

    schema = manifest_schema(manifest)
    assert schema.names == ["x", "year", "month", "city"]  # after the file's own columns
    assert [schema.field(n).type for n in ("year", "month", "city")] == [
        pa.int64(),  # 2023, 2024 and a null
        pa.int64(),  # 01, 02, 12: integer literals
        pa.string(),
    ]
    assert manifest.preprocess.source_options["hive_partitions"] == (
        "year=int64,month=int64,city=string"
    )
    rows = staged_rows(tmp_path, registry, manifest)
    start = 0
    for folders, count in LAYOUT.items():
        year, month, city = EXPECTED[folders]
        assert rows[f"{folders}/part-0.parquet"] == [
            {"x": x, "year": year, "month": month, "city": city}
            for x in range(start, start + count)
        ]
        start += count


def test_publish_prints_the_partition_columns_and_none_turns_them_off(tmp_path: Path) -> None:
    write_layout(tmp_path / "events", LAYOUT)
    registry = f"file://{tmp_path}/registry"
    code, out = cli("publish", str(tmp_path / "events"), "--dataset", "e", "--registry", registry)
    assert code == 0, out
    assert "  x: int64\n  year: int64\n  month: int64\n  city: string\n" in out
    assert "hive_partitions=year=int64,month=int64,city=string" in out

    code, out = cli(
        "publish", str(tmp_path / "events"), "--dataset", "e", "--registry", registry,
        "--partitioning", "none",
    )  # fmt: skip
    assert code == 0, out
    assert "year" not in out.split("(3 shards, 9 rows)")[1]
    off = Registry.run(registry, lambda reg: reg.manifest("e", 2))
    assert manifest_schema(off).names == ["x"]
    assert dict(off.preprocess.source_options) == {}  # read as folders were before
    assert [r["x"] for rs in staged_rows(tmp_path, registry, off).values() for r in rs] == list(
        range(9)
    )


def test_a_string_partition_with_an_integer_looking_value_stays_string(tmp_path: Path) -> None:
    write_layout(tmp_path / "src", {"shard=007": 1, "shard=a12": 1})
    manifest = publish(f"file://{tmp_path}/registry", str(tmp_path / "src"), "s")
    assert manifest_schema(manifest).field("shard").type == pa.string()
    rows = staged_rows(tmp_path, f"file://{tmp_path}/registry", manifest)
    assert rows["shard=007/part-0.parquet"] == [{"x": 0, "shard": "007"}]  # zeros kept


def test_a_file_column_named_like_a_partition_is_refused_naming_it(tmp_path: Path) -> None:
    write_layout(tmp_path / "src", {"year=2023": 2, "year=2024": 2}, year=[1, 2])
    registry = f"file://{tmp_path}/registry"
    code, out = cli("publish", str(tmp_path / "src"), "--dataset", "y", "--registry", registry)
    assert code == 2, out
    assert "already has a column 'year'" in out and "year=2023/part-0.parquet" in out
    assert "--partitioning none" in out
    assert cli("versions", "y", "--registry", registry)[0] == 2  # nothing published
    code, out = cli(
        "publish", str(tmp_path / "src"), "--dataset", "y", "--registry", registry,
        "--transform", "columns", "--param", "rename=year=file_year",
    )  # fmt: skip
    assert code == 0, out  # the fix the message gives
    assert "  x: int64\n  file_year: int64\n  year: int64\n" in out


def test_objects_whose_folders_disagree_are_refused_naming_two(tmp_path: Path) -> None:
    write_layout(tmp_path / "src", {"year=2023/month=01": 1, "month=02/year=2024": 1})
    registry = f"file://{tmp_path}/registry"
    code, out = cli("publish", str(tmp_path / "src"), "--dataset", "d", "--registry", registry)
    assert code == 2, out
    assert "disagree on their Hive partitions" in out
    assert "month=02/year=2024/part-0.parquet" in out and "year=2023/month=01/part-0" in out

    (tmp_path / "flat").mkdir()
    write_layout(tmp_path / "flat", {"year=2023": 1})
    pq.write_table(pa.table({"x": [5]}), tmp_path / "flat" / "loose.parquet")
    code, out = cli("publish", str(tmp_path / "flat"), "--dataset", "d", "--registry", registry)
    assert code == 2, out
    assert "loose.parquet" in out and "no key=value folder" in out


def test_a_version_published_before_partitions_reads_as_before(tmp_path: Path) -> None:
    # What publish wrote before folders were read: the file's schema, no recorded option.
    write_layout(tmp_path / "src", {"year=2023": 2, "year=2024": 1})
    registry, source = f"file://{tmp_path}/registry", f"file://{tmp_path}/src/"
    objects, _ = Registry.run(registry, lambda reg: reg.list_sources(source))
    old = build_manifest(
        dataset="old",
        version=1,
        source_url=source,
        source_format=pb.SOURCE_FORMAT_PARQUET,
        schema=pq.read_schema(objects[0].info.url.removeprefix("file://")),
        preprocess=preprocess_spec(),
        shards=[
            pb.Shard(
                index=i,
                source_key=obj.key,
                source_etag=obj.info.etag,
                source_size=obj.info.size,
                row_count=pq.read_metadata(obj.info.url.removeprefix("file://")).num_rows,
            )
            for i, obj in enumerate(sorted(objects, key=lambda o: o.key))
        ],
    )
    Registry.run(registry, lambda reg: reg.commit(old))
    assert staged_rows(tmp_path, registry, old) == {
        "year=2023/part-0.parquet": [{"x": 0}, {"x": 1}],
        "year=2024/part-0.parquet": [{"x": 2}],
    }


def test_partitions_from_an_s3_source(tmp_path: Path, s3_endpoint: str) -> None:
    bucket = f"hive-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    for year, month, value in ((2023, "01", 1), (2024, "02", 2)):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"v": [value]}), sink)
        key = f"events/year={year}/month={month}/part-0.parquet"
        put_object(s3_endpoint, bucket, key, sink.getvalue().to_pybytes())
    registry = f"s3://{bucket}/_reg"
    manifest = publish(registry, f"s3://{bucket}/events", "ev")
    rows = staged_rows(tmp_path, registry, manifest)
    assert rows == {
        "year=2023/month=01/part-0.parquet": [{"v": 1, "year": 2023, "month": 1}],
        "year=2024/month=02/part-0.parquet": [{"v": 2, "year": 2024, "month": 2}],
    }


def test_an_unknown_partitioning_is_refused_naming_the_choices(tmp_path: Path) -> None:
    write_layout(tmp_path / "src", {"year=2023": 1})
    spec = pb.PreprocessSpec(source_options={"partitioning": "auto"})
    with pytest.raises(ValueError, match="partitioning must be hive or none, got 'auto'"):
        Registry.run(
            f"file://{tmp_path}/registry",
            lambda reg: reg.publish(str(tmp_path / "src"), "p", spec=spec),
        )


def test_a_partition_name_a_rename_makes_is_said_as_the_renames_with_a_fix_that_works(
    tmp_path: Path,
) -> None:
    """A hunt: rename=v=code over code=… folders was said as the file having a column 'code',
    with the fix rename=code=NEW ("column 'code' (in rename) is missing"), and adding it as a
    second --param rename was refused ("given more than once")."""
    write_layout(tmp_path / "src", {"code=007": 1, "code=x1": 1}, v=[1], s=["a"])
    registry = f"file://{tmp_path}/registry"
    publish = ["publish", str(tmp_path / "src"), "--dataset", "h", "--registry", registry]
    code, out = cli(*publish, "--transform", "columns", "--param", "rename=v=code,s=t")
    said = " ".join(out.split())
    assert code == 2 and "the columns transform's rename=v=code makes a column 'code'" in said
    assert "already has a column" not in said and "(--param rename=s=t,v=NEW)" in said, said
    code, out = cli(*publish, "--transform", "columns", "--param", "rename=s=t,v=NEW")
    assert code == 0, out  # the fix it gives
    # A column of the file's own under a columns transform: one rename param, both pairs.
    write_layout(tmp_path / "own", {"code=007": 1}, code=[5], s=["a"])
    own = ["publish", str(tmp_path / "own"), "--dataset", "o", "--registry", registry]
    code, out = cli(*own, "--transform", "columns", "--param", "rename=s=t")
    said = " ".join(out.split())
    assert code == 2 and "already has a column 'code'" in said, said
    assert "in the same --param rename (s=t,code=NEW: it is given once)" in said, said
    code, out = cli(*own, "--transform", "columns", "--param", "rename=s=t,code=NEW")
    assert code == 0, out


def test_a_partition_collision_message_quotes_names_and_gives_fixes_that_parse() -> None:
    """A review: rename pairs were split by hand ('"a,b"=code' said as 'b"=code', and the
    fix it gave was refused), and a column the images transform keeps from the object was
    blamed on the transform, with advice (name its output otherwise) that changed nothing."""
    from edgecache.cache.errors import MalformedShard
    from edgecache.cache.preprocess import load_transform
    from edgecache.cache.preprocess.partitions import with_partitions

    schema = pa.schema([("code", pa.int64()), ("t", pa.string())])
    field = [pa.field("code", pa.string())]
    params = {"rename": '"a,b"=code,s=t'}
    with pytest.raises(MalformedShard) as caught:
        with_partitions(schema, field, "src/x", transform="columns", params=params)
    said = str(caught.value)
    assert """rename="a,b"=code makes a column 'code' of src/x's 'a,b'""" in said, said
    fix = re.search(r"--param rename=(\S+)\)", said)
    assert fix is not None and fix.group(1) == 's=t,"a,b"=NEW', said
    load_transform("columns", {"rename": fix.group(1)})  # a fix the transform takes
    images = pa.schema([("image", pa.binary()), ("label", pa.int64())])
    with pytest.raises(MalformedShard) as caught:
        with_partitions(images, [pa.field("label", pa.string())], "src/y", transform="images")
    said = str(caught.value)
    assert "src/y, after the images transform, has a column 'label'" in said, said
    assert "output" not in said and "rename that column before publishing" in said, said
