import json
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from datagen import TOKEN_SCHEMA
from hypothesis import given
from hypothesis import strategies as st

from edgecache.cache.errors import InvalidName, ManifestError
from edgecache.cache.manifest import (
    build_manifest,
    content_digest,
    manifest_from_bytes,
    manifest_from_json,
    manifest_schema,
    manifest_to_json,
    preprocess_spec,
    summarize,
)
from edgecache.v1 import manifest_pb2 as pb


def make(dataset: str = "tokens-en", version: int = 1, **overrides: object) -> pb.Manifest:
    shards = [
        pb.Shard(
            index=i,
            source_key=f"part-{i}.parquet",
            source_etag=f'"e{i}"',
            source_size=1000 + i,
            row_count=10 + i,
        )
        for i in range(3)
    ]
    args: dict = dict(
        dataset=dataset,
        version=version,
        source_url="s3://bucket/tokens/",
        source_format=pb.SOURCE_FORMAT_PARQUET,
        schema=TOKEN_SCHEMA,
        preprocess=preprocess_spec(params={"b": "2", "a": "1"}),
        shards=shards,
        created_at=datetime(2026, 11, 30, tzinfo=UTC),
    )
    args.update(overrides)
    return build_manifest(**args)


def test_digest_is_stable_and_content_only() -> None:
    a = make()
    b = make(dataset="other", version=9, created_at=datetime(2027, 1, 1, tzinfo=UTC))
    assert a.digest.startswith("sha256:")
    assert a.digest == b.digest == content_digest(a)


def test_digest_changes_with_content() -> None:
    base = make()
    assert make(preprocess=preprocess_spec(compression_level=3)).digest != base.digest
    assert make(source_url="s3://bucket/other/").digest != base.digest
    assert make(schema=pa.schema([("x", pa.int8())])).digest != base.digest


def test_map_order_does_not_change_digest() -> None:
    a = make(preprocess=preprocess_spec(params={"a": "1", "b": "2"}))
    b = make(preprocess=preprocess_spec(params={"b": "2", "a": "1"}))
    assert a.digest == b.digest


def test_json_round_trip_and_binary_round_trip() -> None:
    m = make()
    text = manifest_to_json(m)
    assert json.loads(text)["dataset"] == "tokens-en"
    assert manifest_from_json(text) == m
    assert manifest_from_bytes(m.SerializeToString()) == m
    assert manifest_schema(m).equals(TOKEN_SCHEMA)


def test_summary() -> None:
    s = summarize(make())
    assert (s.shard_count, s.row_count, s.source_bytes) == (3, 33, 3003)


def test_tampered_manifest_is_refused() -> None:
    doc = json.loads(manifest_to_json(make()))
    doc["shards"][0]["row_count"] = "999"
    with pytest.raises(ManifestError, match="does not match its content"):
        manifest_from_json(json.dumps(doc), source="s3://b/_edgecache/tokens-en/1.json")


@pytest.mark.parametrize("text", ["{", "[]", '{"dataset": 5}', '{"nope": 1}', b"\xff\xfe"])
def test_malformed_json_is_refused(text: str) -> None:
    with pytest.raises(ManifestError):
        manifest_from_json(text)


def test_garbage_binary_is_refused() -> None:
    with pytest.raises(ManifestError):
        manifest_from_bytes(b"\xff\xff\xff\xff")


def test_bad_names_and_numbers() -> None:
    with pytest.raises(InvalidName):
        make(dataset="../x")
    with pytest.raises(ManifestError):
        make(version=0)
    doc = json.loads(manifest_to_json(make()))
    doc["dataset"] = "../../etc"
    with pytest.raises(ManifestError, match="invalid dataset name"):
        manifest_from_json(json.dumps(doc))


def test_shards_must_be_numbered_in_order() -> None:
    with pytest.raises(ManifestError, match="index"):
        make(shards=[pb.Shard(index=1, source_key="a")])
    with pytest.raises(ManifestError, match="source_key"):
        make(shards=[pb.Shard(index=0)])


@given(
    params=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=6),
    rows=st.lists(st.integers(0, 2**40), max_size=5),
)
def test_digest_survives_json_round_trip(params: dict[str, str], rows: list[int]) -> None:
    shards = [pb.Shard(index=i, source_key=f"k{i}", row_count=r) for i, r in enumerate(rows)]
    m = make(preprocess=preprocess_spec(params=params), shards=shards)
    again = manifest_from_json(manifest_to_json(m))
    assert content_digest(again) == m.digest
