"""Hostile origin objects: bombs, path tricks and absurd counts, each refused plainly.

The standard (docs/security.md, "A compromised origin"): bad input gets a clear
error naming the object and loses nothing; what an origin serves never takes a
node down (memory, disk, a hung thread) and never leaves a partial entry. Each
test builds a small crafted object and, where the danger is size, lowers the
limit (``cache/preprocess/limits.py``) and measures what would have been
allocated instead of allocating gigabytes.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from edgeutil import node_settings, publish, read_shard_table, stub

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess import limits, read_source
from edgecache.cache.preprocess.compressed import decompress
from edgecache.cache.preprocess.fixes import FIX
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

MiB = 1 << 20
COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": lambda d: gzip.compress(d, 9),
    "zstd": lambda d: zstandard.ZstdCompressor(level=19).compress(d),
    "bz2": lambda d: bz2.compress(d, 9),
    "xz": lambda d: lzma.compress(d, format=lzma.FORMAT_XZ),
}


def peak_python_bytes(fn: Callable[[], object]) -> tuple[BaseException | None, int]:
    """Run ``fn``; what it raised and the peak bytes Python allocated meanwhile."""
    tracemalloc.start()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - returned for the test to judge
        return exc, tracemalloc.get_traced_memory()[1]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return None, peak


# ------------------------------------------------------------ decompression bombs


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_a_compressed_bomb_is_refused_without_inflating_it(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "MAX_DECOMPRESSED_BYTES", 1 * MiB)
    bomb = COMPRESSORS[kind](b"\n" * (48 * MiB))  # a few KB that inflate 48 MiB
    assert len(bomb) < 64 << 10
    error, peak = peak_python_bytes(lambda: decompress(bomb, f"s3://b/docs.jsonl.{kind}"))
    assert isinstance(error, MalformedShard), error
    assert f"docs.jsonl.{kind}" in str(error) and "1.0 MiB" in str(error)
    assert peak < 16 * MiB, f"{kind}: {peak / MiB:.1f} MiB allocated to refuse a 1 MiB limit"


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_a_bomb_under_the_absolute_limit_is_refused_by_its_ratio(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fetch could hold 4 GiB of a few KB of zeros: eight at once (the default fetch and
    staging concurrency) passed a pod's 8 GiB. An object may inflate MAX_INFLATION times its
    size (past a floor), and real data far less: 3-20x."""
    monkeypatch.setattr(limits, "MIN_INFLATION_LIMIT", 1024)  # bz2 makes this bomb ~100 B
    bomb = COMPRESSORS[kind](b"\n" * (48 * MiB))  # far under the 4 GiB limit, 1000x+
    ratio_limit = limits.MAX_INFLATION * len(bomb)
    assert 1024 < ratio_limit < 48 * MiB < limits.MAX_DECOMPRESSED_BYTES
    error, peak = peak_python_bytes(lambda: decompress(bomb, f"s3://b/docs.jsonl.{kind}"))
    assert isinstance(error, MalformedShard), error
    assert f"{limits.MAX_INFLATION}x its size" in str(error), str(error)
    assert peak < ratio_limit + 16 * MiB
    # Real text (Python's own sources, ~4x) is read whole under the same limits.
    text = Path(json.__file__).read_bytes() * 20
    data, found = decompress(COMPRESSORS[kind](text), f"s3://b/src.txt.{kind}")
    assert found == kind and bytes(data) == text


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_a_small_bomb_is_refused_at_the_floor_and_says_so(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the floor the limit is the floor, not 200x the object: the message said
    "200x its size" of a 21 KB object (4 MB) while refusing it at 256 MiB."""
    monkeypatch.setattr(limits, "MIN_INFLATION_LIMIT", 8 * MiB)
    bomb = COMPRESSORS[kind](b"\n" * (16 * MiB))
    assert limits.MAX_INFLATION * len(bomb) < 8 * MiB  # the floor is the limit here
    error, _ = peak_python_bytes(lambda: decompress(bomb, f"s3://b/docs.jsonl.{kind}"))
    assert isinstance(error, MalformedShard), error
    said = str(error)
    assert "more than 8.0 MiB (the most a node expands an object of this size to" in said, said
    assert "x its size" not in said and "past that" not in said, said


def test_a_zstd_frame_declaring_a_huge_size_is_refused_before_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits, "MAX_DECOMPRESSED_BYTES", 1 * MiB)
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"a" * (2 * MiB))
    with pytest.raises(MalformedShard, match=r"x\.csv\.zst .*declares 2,097,152 bytes"):
        decompress(frame, "x.csv.zst")


def test_an_xz_header_asking_for_a_4_gib_dictionary_is_refused_without_allocating_it() -> None:
    small = lzma.compress(
        b"x" * 1000, format=lzma.FORMAT_XZ, filters=[{"id": lzma.FILTER_LZMA2, "dict_size": 4096}]
    )
    data = bytearray(small)
    size = (data[12] + 1) * 4  # the block header follows the 12-byte stream header
    header = data[12 : 12 + size]
    at = header.find(b"\x21\x01")  # LZMA2's filter id, then its one property byte
    header[at + 2] = 40  # the dictionary size: 4 GiB - 1
    header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")
    data[12 : 12 + size] = header
    error, peak = peak_python_bytes(lambda: decompress(bytes(data), "notes.txt.xz"))
    assert isinstance(error, MalformedShard) and "notes.txt.xz" in str(error), error
    assert "dictionary" in str(error)
    assert peak < 64 * MiB, f"{peak / MiB:.0f} MiB allocated for a 1 KB object"


def test_objects_under_the_limit_still_decompress_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_DECOMPRESSED_BYTES", 1 * MiB)
    rows = b"".join(b'{"n": %d}\n' % i for i in range(1000))
    for kind, compress in COMPRESSORS.items():
        twice = compress(rows) + compress(rows)  # concatenated members / frames
        data, found = decompress(twice, "x")
        assert (bytes(data), found) == (rows + rows, kind)
    exactly = b"x" * MiB
    assert bytes(decompress(gzip.compress(exactly), "x")[0]) == exactly


def test_a_node_fails_a_bomb_shard_naming_it_and_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    rows = b"".join(b'{"n": %d}\n' % i for i in range(100))
    (origin / "a.jsonl.gz").write_bytes(gzip.compress(rows))
    (origin / "b.jsonl.gz").write_bytes(gzip.compress(rows + b"\n" * (4 * MiB)))
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{origin}", "bomb")  # published while the limit allowed it
    monkeypatch.setattr(limits, "MAX_DECOMPRESSED_BYTES", 1 * MiB)
    with running_node(
        node_settings(tmp_path, registry, region="hostile", capacity="64MiB")
    ) as node:
        client = stub(node.address)
        with pytest.raises(grpc.RpcError) as info:
            read_shard_table(client, "bomb", 1, 1)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "b.jsonl.gz" in info.value.details() and "1.0 MiB" in info.value.details()
        assert read_shard_table(client, "bomb", 1, 0).num_rows == 100  # still serving
        status = client.Status(edge_pb2.StatusRequest())
        assert status.versions[0].shard_count == 1  # nothing of the bomb was cached


# ------------------------------------------------------------- absurd counts


def test_a_bad_jsonl_with_a_huge_line_is_named_without_copying_it_into_python_objects() -> None:
    good = b'{"a": [1, 2]}\n'
    huge = b'{"a": [' + b"1," * (16 * MiB) + b"1]}\n"  # 32 MiB on one line
    data = good + huge + b"{not json\n" + good
    error, peak = peak_python_bytes(
        lambda: list(read_source(data, fmt=pb.SOURCE_FORMAT_JSONL, source="s3://b/x.jsonl"))
    )
    assert isinstance(error, MalformedShard), error
    assert "s3://b/x.jsonl line 3: not valid JSON" in str(error)
    assert peak < 24 * MiB, f"{peak / MiB:.0f} MiB of Python objects to name a bad line"


def test_a_csv_whose_first_cell_is_larger_than_pythons_csv_field_limit_reads() -> None:
    data = b"text\n" + b'"' + b"a" * (200 << 10) + b'"\n' + b"b\n"
    rows = [r for b in read_source(data, fmt=pb.SOURCE_FORMAT_CSV, source="x.csv")
            for r in b.to_pylist()]  # fmt: skip
    assert [len(r["text"]) for r in rows] == [200 << 10, 1]
    headerless = b'"' + b"a" * (200 << 10) + b'"\n' + b"b\n"
    rows = [r for b in read_source(headerless, fmt=pb.SOURCE_FORMAT_CSV, source="x.csv",
            options={"header": "false"}) for r in b.to_pylist()]  # fmt: skip
    assert len(rows) == 2
    with pytest.raises(MalformedShard, match="x.csv"):  # header auto: a 200 KB header cell
        list(read_source(b"a" * (200 << 10) + b",1\n", fmt=pb.SOURCE_FORMAT_CSV, source="x.csv"))


# ------------------------------------------------------------ MDS indexes


def mds_entry(**overrides: object) -> dict:
    entry: dict = {
        "format": "mds",
        "compression": None,
        "column_names": ["n"],
        "column_encodings": ["int"],
        "column_sizes": [8],
        "raw_data": {"basename": "shard.00000.mds"},
        "samples": 2,
    }
    entry.update(overrides)
    return entry


def write_mds(folder: Path, *entries: dict) -> None:
    """An MDS directory: ``index.json`` and a real 2-sample shard of int64s."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "index.json").write_text(json.dumps({"version": 2, "shards": list(entries)}))
    header = [2, 16, 24, 32]  # count, then offsets of 2 samples of 8 bytes
    body = b"".join(n.to_bytes(4, "little") for n in header)
    (folder / "shard.00000.mds").write_bytes(body + (7).to_bytes(8, "little") * 2)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (mds_entry(raw_data={"basename": "../other/shard.mds"}), "not a file name in the index"),
        (mds_entry(raw_data={"basename": "/etc/shard.mds"}), "not a file name in the index"),
        (mds_entry(raw_data={"basename": "s3://other/shard.mds"}), "not a file name in the index"),
        (mds_entry(raw_data={"basename": "a\0.mds"}), "not a file name in the index"),
        (mds_entry(samples=2**40), "holds 1099511627776 samples"),
        (mds_entry(samples=-1), "holds -1 samples"),
        (mds_entry(samples="2"), "holds '2' samples"),
        (mds_entry(samples=1000), "too small for their offsets"),
        (mds_entry(raw_data="shard.00000.mds"), "names no data file"),
        (mds_entry(column_sizes=[]), "lists alike"),
        (
            mds_entry(column_names=["n", "n"], column_encodings=["int"] * 2, column_sizes=[8, 8]),
            "column names repeat",
        ),  # fmt: skip
        ([1, 2], "is not an MDS shard entry"),
        ({"format": "mds"}, "is not an MDS shard entry"),
    ],
)
def test_a_hostile_mds_index_is_a_publish_error_naming_it(
    tmp_path: Path, entry: object, message: str
) -> None:
    write_mds(tmp_path / "mds", entry)  # type: ignore[arg-type]
    with pytest.raises(MalformedShard, match="index.json") as info:
        publish(f"file://{tmp_path}/registry", f"file://{tmp_path}/mds", "mds")
    assert message in str(info.value)
    assert not (tmp_path / "registry").exists()  # nothing published


def test_a_deeply_nested_mds_index_is_a_publish_error(tmp_path: Path) -> None:
    write_mds(tmp_path / "mds", mds_entry())
    (tmp_path / "mds" / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MalformedShard, match="index.json is not an MDS index"):
        publish(f"file://{tmp_path}/registry", f"file://{tmp_path}/mds", "mds")


def test_an_mds_column_of_a_non_numeric_ndarray_is_kept_as_bytes(tmp_path: Path) -> None:
    write_mds(tmp_path / "mds", mds_entry(column_encodings=["ndarray:O:8"]))
    manifest = publish(f"file://{tmp_path}/registry", f"file://{tmp_path}/mds", "mds")
    schema = pa.ipc.read_schema(pa.py_buffer(manifest.arrow_schema))
    assert schema.field("n").type == pa.binary()


# ------------------------------------------------------------ Parquet


def dictionary_parquet(value_bytes: int, rows: int) -> bytes:
    """One random value repeated on every row: dictionary-encoded, the file stays tiny."""
    value = np.random.default_rng(0).bytes(value_bytes).hex()[:value_bytes]
    column = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array([value]))
    out = io.BytesIO()
    pq.write_table(pa.table({"s": column}), out, compression="zstd", store_schema=False)
    return out.getvalue()


def test_a_parquet_dictionary_bomb_is_refused_before_expanding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = dictionary_parquet(32 << 10, 4096)  # 128 MiB of strings when expanded
    assert len(data) < 64 << 10
    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 16 * MiB)
    pool = pa.default_memory_pool()
    before = pool.bytes_allocated()
    refused = r"s3://b/p\.parquet decodes to more than 16\.0 MiB"
    with pytest.raises(MalformedShard, match=refused) as e:
        list(read_source(data, fmt=pb.SOURCE_FORMAT_PARQUET, source="s3://b/p.parquet"))
    assert pool.bytes_allocated() - before < 16 * MiB
    # Raised while decoding, it reaches the caller as it was, not wrapped as "corrupt data".
    message = str(e.value)
    assert message.startswith("s3://b/p.parquet decodes to more than"), message
    assert message.count(FIX) == 1, message


def test_parquet_dictionary_strings_expand_a_slice_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = dictionary_parquet(32 << 10, 256)  # 8 MiB expanded
    monkeypatch.setattr(limits, "BATCH_DECODED_BYTES", 1 * MiB)
    batches = list(read_source(data, fmt=pb.SOURCE_FORMAT_PARQUET, source="p.parquet"))
    assert sum(b.num_rows for b in batches) == 256
    assert all(b.schema.field("s").type == pa.string() for b in batches)
    assert max(b.nbytes for b in batches) <= 1 * MiB + (32 << 10) + 4096
    assert len({b.column(0)[0].as_py() for b in batches}) == 1


def test_an_all_null_parquet_string_column_still_reads() -> None:
    out = io.BytesIO()
    pq.write_table(pa.table({"s": pa.array([None, None], pa.string())}), out)
    batches = list(read_source(out.getvalue(), fmt=pb.SOURCE_FORMAT_PARQUET, source="p"))
    assert [b.to_pylist() for b in batches] == [[{"s": None}, {"s": None}]]


# ------------------------------------------------------------ transform files


def test_a_tokenizer_file_over_the_limit_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / "a.jsonl").write_text('{"text": "hello"}\n')
    (origin / "tokenizer.json").write_bytes(b" " * (2 * MiB))
    monkeypatch.setattr(limits, "MAX_RESOURCE_BYTES", 1 * MiB)
    with pytest.raises(MalformedShard, match=r"tokenizer.json is 2,097,152 bytes"):
        publish(f"file://{tmp_path}/registry", f"file://{origin}", "text",
                transform="tokens", params={"tokenizer": "tokenizer.json"})  # fmt: skip


# ------------------------------------------------------------ keys reaching outside


@pytest.mark.parametrize(
    ("source_url", "key", "refused"),
    [
        ("file:///data/ds/", "../../etc/passwd", True),  # a node would read and serve it
        ("file:///data/ds/", "a/../../b.parquet", True),
        ("file:///data/ds/", "sub\x00.parquet", True),
        ("file:///data/ds/", "/etc/passwd", False),  # appended: file:///data/ds//etc/passwd
        ("file:///data/ds/", "part-0.parquet", False),
        ("s3://bucket/ds/", "a/../b.parquet", False),  # an S3 key is a literal name
    ],
)
def test_a_manifest_key_outside_a_filesystem_prefix_is_refused(
    source_url: str, key: str, refused: bool
) -> None:
    """A registry written by someone else must not point a node at any file it can read."""
    from edgecache.cache.errors import ManifestError
    from edgecache.cache.manifest import build_manifest, preprocess_spec

    def build() -> pb.Manifest:
        return build_manifest(
            dataset="d",
            version=1,
            source_url=source_url,
            source_format=pb.SOURCE_FORMAT_PARQUET,
            schema=pa.schema([("x", pa.int64())]),
            preprocess=preprocess_spec(),
            shards=[pb.Shard(index=0, source_key=key, source_size=1, row_count=1)],
        )

    if refused:
        with pytest.raises(ManifestError, match="outside the source prefix"):
            build()
    else:
        assert build().shards[0].source_key == key


def test_a_transform_file_key_may_not_climb_out_of_the_prefix() -> None:
    from edgecache.cache.registry import resource_url

    assert resource_url("s3://b/ds", "tok/tokenizer.json") == "s3://b/ds/tok/tokenizer.json"
    assert resource_url("s3://b/ds", "s3://b/other/t.json") == "s3://b/other/t.json"  # as given
    with pytest.raises(ValueError, match="climbs out of the source prefix"):
        resource_url("file:///data/ds/", "../secrets/tokenizer.json")
    # An absolute path is a local file, not a key with its '/' dropped: nodes reading a
    # file:// source read it there; nodes reading an object store cannot.
    assert resource_url("file:///data/ds", "/opt/tok.json") == "file:///opt/tok.json"
    with pytest.raises(ValueError, match="path on this machine.*give its key .e.g. tok.json"):
        resource_url("s3://b/ds", "/opt/tok.json")
