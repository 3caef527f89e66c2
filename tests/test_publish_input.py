"""What `publish` and `versions` make of what a person types: paths, levels, registries."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from edgeutil import node_settings, read_shard_table, stub, write_parquet_shards
from typer.testing import CliRunner

from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.clients.cli import app
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2

runner = CliRunner()


def test_a_plain_path_is_published_as_a_file_url_a_node_can_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables = write_parquet_shards(tmp_path / "raw" / "pq", 2, rows=500)
    monkeypatch.chdir(tmp_path)
    # Relative paths for the source and the registry, as typed in a shell.
    result = runner.invoke(app, ["publish", "raw/pq", "--dataset", "pqz", "--registry", "reg"])
    assert result.exit_code == 0, result.output
    registry = f"file://{tmp_path}/reg"
    manifest = Registry.run(registry, lambda reg: reg.manifest("pqz", 1))
    # The stored prefix and the shard keys agree: prefix + key is each object's URL.
    assert manifest.source_url == f"file://{tmp_path}/raw/pq/"
    assert [s.source_key for s in manifest.shards] == ["part-00000.parquet", "part-00001.parquet"]
    # An absolute path is the same source, spelled the same way: the same content.
    result = runner.invoke(
        app,
        ["publish", str(tmp_path / "raw" / "pq"), "--dataset", "pqz", "--registry", registry],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "same content as pqz@1" in result.output
    settings = node_settings(tmp_path, registry)
    with running_node(settings) as node:
        client = stub(node.address)
        last = list(client.Stage(edge_pb2.StageRequest(dataset="pqz", version=1)))[-1]
        assert last.finished and last.shards_done == 2 and not last.shards_failed
        for shard, table in enumerate(tables):
            assert read_shard_table(client, "pqz", 1, shard).equals(table)


def test_a_path_that_is_not_there_is_bad_input(tmp_path: Path) -> None:
    registry = f"file://{tmp_path}/reg"
    result = runner.invoke(
        app, ["publish", str(tmp_path / "nope"), "--dataset", "x", "--registry", registry]
    )
    assert result.exit_code == 2
    assert f"there is no directory {tmp_path}/nope" in result.output
    assert not (tmp_path / "reg").exists()


def test_a_level_no_node_could_encode_is_refused_at_publish(tmp_path: Path) -> None:
    write_parquet_shards(tmp_path / "raw", 1, rows=100)
    registry = f"file://{tmp_path}/reg"
    result = runner.invoke(
        app,
        [
            *("publish", f"file://{tmp_path}/raw", "--dataset", "x", "--registry", registry),
            *("--compression", "zstd", "--level", "30"),
        ],
    )
    assert result.exit_code == 2
    # Named as the option it is, by the parser, as ops.md says of out-of-range options; the
    # codec's "zstd level must be in -7..22" alone named no option (a helper's hunt).
    said = " ".join(result.output.replace("│", " ").split())
    assert "Invalid value for '--level'" in said and "less than or equal to 22" in said, said
    assert not (tmp_path / "reg").exists()  # nothing published
    # The same check for every caller of the registry, and for every field it covers.
    with pytest.raises(ValueError, match="chunk_bytes must be in"):
        Registry.run(
            registry,
            lambda reg: reg.publish(
                f"file://{tmp_path}/raw", "x", spec=preprocess_spec(chunk_bytes=1)
            ),
        )


def test_level_0_is_refused_not_published_as_level_1(tmp_path: Path) -> None:
    """zstd's 0 (its default, 3) was taken and the version recorded as zstd-1 (0 is the spec's
    unset), so --level 1 --if-changed called it unchanged (a helper's hunt)."""
    write_parquet_shards(tmp_path / "raw", 1, rows=100)
    registry = f"file://{tmp_path}/reg"
    args = ("publish", f"file://{tmp_path}/raw", "--dataset", "x", "--registry", registry)
    result = runner.invoke(app, [*args, "--compression", "zstd", "--level", "0"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "give --level 3" in said, said
    assert not (tmp_path / "reg").exists()  # nothing published
    result = runner.invoke(app, [*args, "--compression", "zstd", "--level", "3", "--json"])
    assert result.exit_code == 0 and '"compression_level": 3' in result.output, result.output


def test_versions_of_what_is_not_there_is_bad_input_naming_what_is(tmp_path: Path) -> None:
    write_parquet_shards(tmp_path / "raw", 1, rows=100)
    registry = f"file://{tmp_path}/reg"
    published = runner.invoke(
        app, ["publish", f"file://{tmp_path}/raw", "--dataset", "pq", "--registry", registry]
    )
    assert published.exit_code == 0, published.output

    def versions(*args: str) -> tuple[int, str]:
        result = runner.invoke(app, ["versions", *args], env={"COLUMNS": "300"})
        return result.exit_code, result.output

    code, out = versions("pq", "--registry", registry, "--json")
    assert code == 0 and [v["version"] for v in json.loads(out)] == [1]
    code, out = versions("pq", "--registry", f"file://{tmp_path}/nonexistent")
    assert code == 2
    assert f"the registry file://{tmp_path}/nonexistent does not exist" in out
    assert "edgecache publish creates the registry" in out
    (tmp_path / "empty").mkdir()
    code, out = versions("pq", "--registry", str(tmp_path / "empty"))
    assert code == 2 and "holds no datasets" in out
    code, out = versions("nosuch", "--registry", registry)
    assert code == 2 and f"'nosuch' has no versions in {registry}, which holds pq" in out
    with pytest.raises(KeyError, match="which holds pq"):  # nosuch@1 too: what is there
        Registry.run(registry, lambda reg: reg.manifest("nosuch", 1))
    code, out = versions("pq", "--registry", "s3x://foo")
    assert code == 2 and "no object store serves s3x://" in out
    code, out = versions("--help")
    assert code == 0 and "Exit codes: 0 listed; 2 bad input" in out


def test_a_cast_that_would_lose_values_fails_staging_naming_column_object_and_values(
    tmp_path: Path,
) -> None:
    (tmp_path / "raw").mkdir()
    labels = pa.table({"label": pa.array([i % 10 for i in range(100)], pa.int64())})
    pq.write_table(labels, tmp_path / "raw" / "part-0.parquet")
    registry = f"file://{tmp_path}/reg"
    result = runner.invoke(
        app,
        [
            *("publish", str(tmp_path / "raw"), "--dataset", "t", "--registry", registry),
            *("--transform", "columns", "--param", "cast=label=bool"),
        ],
    )
    assert result.exit_code == 0, result.output  # the schema is known without reading values
    settings = node_settings(tmp_path, registry)
    with running_node(settings) as node, pytest.raises(grpc.RpcError) as failed:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="t", version=1)))
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    message = failed.value.details()
    assert f"shard 0: file://{tmp_path}/raw/part-0.parquet: transform 'columns': " in message
    assert "column 'label' cannot be cast from int64 to bool" in message
    assert "80 of 100 values in one batch would change, e.g. 2 → True, 3 → True" in message
    assert "cast 'label' to a type that holds its values, or leave it out of cast" in message


def test_versions_names_a_plain_path_registry_by_its_file_url_as_its_errors_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_parquet_shards(tmp_path / "raw", 1, rows=100)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "edgecache.yaml"
    config.write_text(f"registry: {tmp_path}/reg\nregions:\n  eu:\n    nodes: ['127.0.0.1:1']\n")
    published = runner.invoke(app, ["publish", "raw", "--dataset", "pq", "--config", str(config)])
    assert published.exit_code == 0, published.output
    for registry in (["--config", str(config)], ["--registry", "reg/"]):
        listed = runner.invoke(app, ["versions", "pq", *registry], env={"COLUMNS": "200"})
        assert listed.exit_code == 0, listed.output
        assert listed.output.splitlines()[0] == f"pq in file://{tmp_path}/reg"
        missing = runner.invoke(app, ["versions", "nope", *registry], env={"COLUMNS": "200"})
        assert missing.exit_code == 2
        assert f"'nope' has no versions in file://{tmp_path}/reg, which holds pq" in missing.output
