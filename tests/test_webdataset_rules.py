"""WebDataset versions published before publish took WebDataset's own member rules still
stage as they were recorded: the rules are a recorded source option (``members``), and a
version without it is read by the earlier ones (keys whose file name started with ``__``
skipped, a multi-dot extension binary), so its row counts and types stay its manifest's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest

from edgecache.cache.errors import MalformedShard
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.preprocess import canonical_options, load_transform, read_source
from edgecache.cache.registry import Registry
from edgecache.edge.preprocessing import encode_raw_shard
from edgecache.v1 import manifest_pb2 as pb

wds = pytest.importorskip("webdataset")
WDS = pb.SOURCE_FORMAT_WEBDATASET
KEYS = ["plain", "x/__a", "y/__b__", "dir/c"]


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """One tar: two keys whose file names start with ``__``, a multi-dot integer member."""
    (tmp_path / "wds").mkdir()
    path = tmp_path / "wds" / "s-0.tar"
    with wds.TarWriter(str(path)) as sink:
        for i, key in enumerate(KEYS):
            sink.write({"__key__": key, "jpg": b"j%d" % i, "label.cls": b"%d" % i})
    return path


def _table(data: bytes, options: dict[str, str]) -> pa.Table:
    return pa.Table.from_batches(
        list(read_source(data, fmt=WDS, source="s3://b/s", options=options))
    )


def test_the_rules_a_version_records_decide_its_rows_and_types(shard: Path) -> None:
    data = shard.read_bytes()
    now = _table(data, canonical_options(WDS, {}))  # what publish records today
    assert now.column("__key__").to_pylist() == KEYS
    assert now.schema.field("label.cls").type == pa.int64()
    earlier = _table(data, {})  # a version recorded before: no members option
    assert earlier.column("__key__").to_pylist() == ["plain", "dir/c"]
    assert earlier.schema.field("label.cls").type == pa.binary()


def test_publish_records_webdataset_rules_and_refuses_other_reader_options(
    tmp_path: Path, shard: Path
) -> None:
    registry = f"file://{tmp_path}/registry"
    manifest = Registry.run(
        registry, lambda reg: reg.publish(f"file://{shard.parent}", "w", spec=preprocess_spec())
    )
    assert dict(manifest.preprocess.source_options) == {"members": "webdataset"}
    assert manifest.shards[0].row_count == len(KEYS)
    with pytest.raises(ValueError, match="WebDataset sources take no reader options"):
        canonical_options(WDS, {"members": "other"})


def test_a_version_published_under_the_earlier_rules_still_stages(
    tmp_path: Path, shard: Path
) -> None:
    """A node read such a version by today's rules: 4 rows where the manifest recorded 2,
    and every shard failed "origin changed under an immutable version"."""
    manifest = Registry.run(
        f"file://{tmp_path}/registry",
        lambda reg: reg.publish(f"file://{shard.parent}", "w", spec=preprocess_spec()),
    )
    earlier = pb.Manifest()
    earlier.CopyFrom(manifest)  # as a node holds one published before the option existed
    del earlier.preprocess.source_options["members"]
    earlier.shards[0].row_count = 2
    data = shard.read_bytes()
    recorded = _table(data, {}).schema
    earlier.arrow_schema = recorded.serialize().to_pybytes()
    with ThreadPoolExecutor(2) as parts:
        for held, rows in ((earlier, 2), (manifest, len(KEYS))):
            encoded = encode_raw_shard(
                data, held, held.shards[0], "s-0.tar", load_transform("identity", {}), parts
            )
            assert encoded.frames and rows == held.shards[0].row_count
        wrong = pb.Manifest()
        wrong.CopyFrom(manifest)
        wrong.shards[0].row_count = 2  # today's rules give 4: a changed origin is still caught
        with pytest.raises(MalformedShard, match="gave 4 rows but the version recorded 2"):
            encode_raw_shard(
                data, wrong, wrong.shards[0], "s-0.tar", load_transform("identity", {}), parts
            )
