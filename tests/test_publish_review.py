"""`publish` as a new user meets it: the sources, registries and options they give.

An MDS index whose shards were not uploaded, a registry that cannot be written,
one file as the source, ``--level`` with uncompressed chunks, a transform's file
named ``./tokenizer.json``, and lists in messages. Real registries: ``file://``
in tmp and moto's S3 server where the registry's S3 path differs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from edgeutil import node_settings, read_shard_table, stub, write_parquet_shards
from s3server import make_bucket, upload_dir
from typer.testing import CliRunner

from edgecache.cache.errors import ObjectNotFound, VersionNotFound
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.clients.cli import app
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

runner = CliRunner()


@pytest.fixture(params=["file", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(registry URL, the URL the local folder ``tmp_path/src`` is found at)."""
    if request.param == "file":
        return f"file://{tmp_path}/registry", f"file://{tmp_path}/src"
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"pub-{uuid.uuid4().hex[:12]}"
    make_bucket(endpoint, bucket)
    request.node.stash_upload = lambda: upload_dir(endpoint, bucket, "src", tmp_path / "src")
    return f"s3://{bucket}/_edgecache", f"s3://{bucket}/src"


def uploaded(request: pytest.FixtureRequest) -> None:
    """Put ``tmp_path/src`` where the ``where`` fixture's S3 source is (file: nothing to do)."""
    upload = getattr(request.node, "stash_upload", None)
    if upload is not None:
        upload()


def mds_entry(shard: str, columns: tuple[str, ...] = ("n",)) -> dict:
    """One ``shards`` entry of an MDS index: uncompressed int64 columns, 2 samples."""
    return {
        "format": "mds",
        "compression": None,
        "column_names": list(columns),
        "column_encodings": ["int"] * len(columns),
        "column_sizes": [8] * len(columns),
        "raw_data": {"basename": shard},
        "samples": 2,
    }


def write_mds_index(folder: Path, *entries: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "index.json").write_text(json.dumps({"version": 2, "shards": list(entries)}))


def write_mds_shard(path: Path, columns: int = 1) -> None:
    """A real 2-sample MDS shard of ``columns`` int64s per sample."""
    size = 8 * columns
    header = [2, 12, 12 + size, 12 + 2 * size]  # count, then offsets of 2 samples
    body = b"".join(n.to_bytes(4, "little") for n in header)
    path.write_bytes(body + (7).to_bytes(8, "little") * columns * 2)


# ------------------------------------------------------------ 1. MDS without its shards


def test_an_mds_index_without_its_shards_is_refused_naming_them(
    tmp_path: Path, where: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    registry, source = where
    entries = [mds_entry(f"shard.{i:05d}.mds") for i in range(7)]
    write_mds_index(tmp_path / "src", *entries)  # index.json copied alone: no shard
    uploaded(request)
    # No --format: it was guessed JSON Lines and published as one row of the index.
    with pytest.raises(ObjectNotFound) as caught:
        Registry.run(registry, lambda reg: reg.publish(source, "x", spec=preprocess_spec()))
    message = str(caught.value)
    assert f"{source}/index.json lists 7 MDS shards, but 7 are not under {source}/" in message
    assert "shard.00000.mds, shard.00001.mds" in message and "and 2 more" in message
    assert "upload the whole MDS directory" in message
    assert Registry.run(registry, lambda reg: reg.versions("x")) == []


def test_an_mds_index_missing_some_shards_names_those_through_the_cli(tmp_path: Path) -> None:
    source = tmp_path / "m"
    write_mds_index(source, mds_entry("shard.00000.mds"), mds_entry("shard.00001.mds"))
    write_mds_shard(source / "shard.00000.mds")
    registry = tmp_path / "reg"
    result = runner.invoke(
        app, ["publish", str(source), "--dataset", "x", "--registry", str(registry)]
    )
    assert result.exit_code == 2, result.output
    assert "lists 2 MDS shards, but 1 is not under" in result.output
    assert "shard.00001.mds; upload the whole MDS directory" in result.output
    assert not registry.exists()


def test_an_index_json_of_another_shape_is_still_json_lines(tmp_path: Path) -> None:
    source = tmp_path / "jl"
    source.mkdir()
    (source / "index.json").write_text('{"page": 1, "title": "home"}\n')
    manifest = Registry.run(
        f"file://{tmp_path}/reg",
        lambda reg: reg.publish(str(source), "pages", spec=preprocess_spec()),
    )
    assert manifest.source_format == pb.SOURCE_FORMAT_JSONL
    assert sum(s.row_count for s in manifest.shards) == 1


def test_an_mds_index_given_as_the_source_publishes_its_directory(tmp_path: Path) -> None:
    source = tmp_path / "m"
    write_mds_index(source, mds_entry("shard.00000.mds"))
    write_mds_shard(source / "shard.00000.mds")
    manifest = Registry.run(
        f"file://{tmp_path}/reg",
        lambda reg: reg.publish(str(source / "index.json"), "m", spec=preprocess_spec()),
    )
    assert manifest.source_format == pb.SOURCE_FORMAT_MDS
    assert manifest.source_url == f"file://{source}/"
    assert [s.source_key for s in manifest.shards] == ["shard.00000.mds"]


# ------------------------------------------------------------ 2. a registry not writable


def test_a_file_as_the_registry_is_named_with_what_to_do(tmp_path: Path) -> None:
    write_parquet_shards(tmp_path / "raw", 1, rows=10)
    (tmp_path / "regfile").write_text("not a registry\n")
    result = runner.invoke(
        app,
        [
            "publish",
            str(tmp_path / "raw"),
            "--dataset",
            "s",
            "--registry",
            str(tmp_path / "regfile"),
        ],
    )
    assert result.exit_code == 1, result.output
    out = " ".join(result.output.split())
    assert f"cannot publish s@1: the registry file://{tmp_path}/regfile is not a directory" in out
    assert "nothing was published" in out and "give --registry" in out
    assert "Errno" not in out


def test_a_read_only_registry_is_named_with_what_to_do(tmp_path: Path) -> None:
    """A real read-only filesystem: a tmpfs mounted ro in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a read-only filesystem with")
    write_parquet_shards(tmp_path / "raw", 1, rows=10)
    mount = tmp_path / "ro"
    mount.mkdir()
    probe = subprocess.run(
        ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
        capture_output=True,
    )
    if probe.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {probe.stderr.decode().strip()}")
    cli = [sys.executable, "-m", "edgecache.clients.cli", "publish", str(tmp_path / "raw")]
    cli += ["--dataset", "s", "--registry", str(mount / "reg")]
    script = f'mount -t tmpfs -o ro,size=1m tmpfs {mount} && exec "$@"'
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *cli],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    err = " ".join(out.stderr.split())
    assert f"the registry file://{mount}/reg is not writable (read-only file system)" in err
    assert "nothing was published" in err and "--registry" in err


# ------------------------------------------------------------ 3. one object as the source


def test_one_object_as_the_source_is_a_version_of_one_shard(
    tmp_path: Path, where: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    registry, source = where
    write_parquet_shards(tmp_path / "src", 2, rows=50)
    uploaded(request)
    manifest = Registry.run(
        registry,
        lambda reg: reg.publish(f"{source}/part-00001.parquet", "one", spec=preprocess_spec()),
    )
    assert manifest.source_url == source + "/"  # nodes fetch prefix + key: the file
    assert [s.source_key for s in manifest.shards] == ["part-00001.parquet"]
    assert manifest.shards[0].row_count == 50


def test_one_file_from_the_cli_is_staged_by_a_node(tmp_path: Path) -> None:
    tables = write_parquet_shards(tmp_path / "raw", 2, rows=40)
    registry = f"file://{tmp_path}/reg"
    result = runner.invoke(
        app,
        ["publish", str(tmp_path / "raw" / "part-00000.parquet"), "--dataset", "one",
         "--registry", registry],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "(1 shard, 40 rows)" in result.output
    with running_node(node_settings(tmp_path, registry)) as node:
        client = stub(node.address)
        last = list(client.Stage(edge_pb2.StageRequest(dataset="one", version=1)))[-1]
        assert last.finished and last.shards_done == 1 and not last.shards_failed
        assert read_shard_table(client, "one", 1, 0).equals(tables[0])


# ------------------------------------------------------------ 4. --level with none


def test_a_level_with_no_compression_is_refused(tmp_path: Path) -> None:
    write_parquet_shards(tmp_path / "raw", 1, rows=10)
    registry = tmp_path / "reg"
    result = runner.invoke(
        app,
        ["publish", str(tmp_path / "raw"), "--dataset", "c", "--registry", str(registry),
         "--compression", "none", "--level", "5"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--compression none compresses nothing: drop --level" in " ".join(result.output.split())
    assert not registry.exists()


def test_levels_no_codec_reads_make_no_new_version(tmp_path: Path) -> None:
    """Uncompressed chunks read no level, and zstd's 0 is 1: the same content, one digest."""
    write_parquet_shards(tmp_path / "raw", 1, rows=10)
    registry = f"file://{tmp_path}/reg"

    def publish(compression: pb.Compression.ValueType, level: int) -> pb.Manifest:
        spec = preprocess_spec(compression=compression, compression_level=level)
        return Registry.run(
            registry,
            lambda reg: reg.publish(str(tmp_path / "raw"), "c", spec=spec, if_changed=True),
        )

    first = publish(pb.COMPRESSION_NONE, 1)
    again = publish(pb.COMPRESSION_NONE, 5)
    assert (again.version, again.digest) == (first.version, first.digest)
    assert again.preprocess.compression_level == 1
    zstd1 = publish(pb.COMPRESSION_ZSTD, 1)
    assert zstd1.version == 2
    assert publish(pb.COMPRESSION_ZSTD, 0).version == 2


# ------------------------------------------------------------ 5. ./tokenizer.json


def test_a_transform_file_named_with_dot_slash_is_not_a_shard(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    source = tmp_path / "docs"
    source.mkdir()
    (source / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "world hello"}\n')
    (source / "tokenizer.json").write_text(tok.to_str())
    manifest = Registry.run(
        f"file://{tmp_path}/reg",
        lambda reg: reg.publish(
            str(source),
            "docs",
            spec=preprocess_spec(transform="tokens", params={"tokenizer": "./tokenizer.json"}),
        ),
    )
    assert [s.source_key for s in manifest.shards] == ["a.jsonl"]


# ------------------------------------------------------------ 6. lists as plain text


def test_messages_list_versions_and_columns_as_plain_text(tmp_path: Path) -> None:
    registry = f"file://{tmp_path}/reg"
    write_parquet_shards(tmp_path / "raw", 1, rows=10)
    Registry.run(
        registry, lambda reg: reg.publish(str(tmp_path / "raw"), "t", spec=preprocess_spec())
    )
    with pytest.raises(VersionNotFound, match=r"\(known versions: 1\)$"):
        Registry.run(registry, lambda reg: reg.manifest("t", 3))
    source = tmp_path / "two"
    write_mds_index(source / "a", mds_entry("shard.00000.mds", ("tiny", "n")))
    write_mds_shard(source / "a" / "shard.00000.mds", columns=2)
    write_mds_index(source / "b", mds_entry("shard.00000.mds"))
    write_mds_shard(source / "b" / "shard.00000.mds")
    result = runner.invoke(
        app, ["publish", str(source), "--dataset", "two", "--registry", registry]
    )
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "lists columns n but" in out and "lists tiny, n; publish them apart" in out
    assert "[" not in out
