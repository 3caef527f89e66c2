"""What each parser is fed and what it must do with it: shared by hypothesis and atheris.

The hostile-input rule is that a bad manifest, topology file,
schedule file or chunk frame gets the project's own error with a message a
person can act on, and nothing else: no KeyError, TypeError,
UnicodeDecodeError or RecursionError escaping a parser, no hang, no huge
allocation. Each ``check_*`` here feeds one input to a parser the way
edgecache receives it (a manifest from origin as JSON or over gRPC as
protobuf, a hand-written YAML file, a frame off the wire or out of LMDB) and
returns ``"accepted"`` or ``"rejected"``. Any other exception is a finding:
the hypothesis tests count it as a crash, atheris stops on it. What a parser
accepts must also be usable (an accepted manifest converts to JSON and back;
a schedule's end times exist; a decoded chunk has the rows its header says),
because the code after the parser trusts it.

The ``reseal``/``restamp`` helpers recompute a frame's checksum and a
manifest's digest after mutating them: without that nearly every mutation
stops at the checksum or digest check and the decoders behind it are never
reached. Seeds are valid inputs made here, so no corpus files are committed.
"""

from __future__ import annotations

import copy
import json
import struct
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import xxhash
import yaml
import zstandard
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from edgecache.cache import byte_split
from edgecache.cache.codec import CodecOptions, decode_chunk, encode_shard
from edgecache.cache.errors import CodecError, ConfigFileError, ManifestError
from edgecache.cache.frame import HEADER_SIZE, Codec, payload_view, read_header
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
from edgecache.cache.names import parse_spec
from edgecache.clients.topology import Topology, load_schedule, load_topology
from edgecache.v1 import manifest_pb2 as pb

ACCEPTED = "accepted"
REJECTED = "rejected"

# ---- seeds: valid inputs -------------------------------------------------------------------

TOKEN_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32(), 8)), ("label", pa.int64())])
MIXED_SCHEMA = pa.schema(
    [
        ("text", pa.string()),
        ("blob", pa.binary()),
        ("ids", pa.list_(pa.int32())),
        ("score", pa.float32()),
        ("meta", pa.struct([("lang", pa.dictionary(pa.int8(), pa.string())), ("ok", pa.bool_())])),
        ("at", pa.timestamp("ms", tz="UTC")),
    ]
)
SCHEMAS = (TOKEN_SCHEMA, MIXED_SCHEMA)


def sample_batch(schema: pa.Schema, rows: int, seed: int = 0) -> pa.RecordBatch:
    """A small batch of ``schema`` (one of SCHEMAS) with deterministic content."""
    rng = np.random.default_rng(seed)
    if schema.equals(TOKEN_SCHEMA):
        ids = pa.array(rng.integers(0, 50_000, rows * 8, dtype=np.int32))
        return pa.record_batch(
            [pa.FixedSizeListArray.from_arrays(ids, 8), pa.array(np.arange(rows, dtype=np.int64))],
            schema=schema,
        )
    langs = pa.array(["en", "de", None][i % 3] for i in range(rows)).dictionary_encode()
    meta = pa.StructArray.from_arrays(
        [
            langs.cast(pa.dictionary(pa.int8(), pa.string())),
            pa.array([i % 2 == 0 for i in range(rows)]),
        ],
        names=["lang", "ok"],
    )
    columns = [
        pa.array([f"row {i} ü" if i % 4 else None for i in range(rows)]),
        pa.array([bytes(rng.integers(0, 256, i % 7, dtype=np.uint8)) for i in range(rows)]),
        pa.array([list(range(i % 5)) for i in range(rows)], type=pa.list_(pa.int32())),
        pa.array(rng.random(rows, dtype=np.float32)),
        meta,
        pa.array([1_700_000_000_000 + i for i in range(rows)], type=pa.timestamp("ms", tz="UTC")),
    ]
    return pa.record_batch(columns, schema=schema)


def chunk_seeds() -> list[tuple[bytes, pa.Schema]]:
    """Valid frames: each schema, each codec, one and several rows.

    The encoder writes small chunks with little to split as plain zstd frames,
    so the byte-split seeds split every fixed-width buffer whatever its size.
    """
    frames = []
    for schema in SCHEMAS:
        for compression in ("zstd", "none"):
            for rows in (1, 6):
                options = CodecOptions(compression=compression)  # type: ignore[arg-type]
                for frame in encode_shard([sample_batch(schema, rows, rows)], schema, options):
                    frames.append((frame, schema))
        for rows in (1, 6, 200):
            with (
                mock.patch.object(byte_split, "MIN_REGION_BYTES", 2),
                mock.patch.object(byte_split, "MIN_SHARE", 0),
            ):
                frames += [
                    (frame, schema)
                    for frame in encode_shard([sample_batch(schema, rows, rows)], schema)
                ]
    return frames


def manifest_seeds() -> list[pb.Manifest]:
    """Valid manifests: with and without shards and params, each schema and compression."""
    out = []
    for i, schema in enumerate(SCHEMAS):
        for shards in (0, 3):
            out.append(
                build_manifest(
                    dataset=f"tokens-{i}.v{shards}",
                    version=1 + shards,
                    source_url="s3://bucket/tokens/",
                    source_format=pb.SOURCE_FORMAT_PARQUET if i else pb.SOURCE_FORMAT_JSONL,
                    schema=schema,
                    preprocess=preprocess_spec(
                        params={"max_len": "8", "b": "ü"} if shards else None,
                        compression=pb.COMPRESSION_NONE if i else pb.COMPRESSION_ZSTD,
                    ),
                    shards=[
                        pb.Shard(
                            index=n,
                            source_key=f"part-{n}.parquet",
                            source_etag=f'"e{n}"',
                            source_size=1000 + n,
                            row_count=10 + n,
                        )
                        for n in range(shards)
                    ],
                    created_at=datetime(2026, 11, 30, 12, 0, 1, 500, tzinfo=UTC),
                )
            )
    return out


TOPOLOGY_SEEDS = [
    b"""registry: s3://ml-data/_edgecache
regions:
  eu-west:
    nodes: [eu-1.internal:7070, eu-2.internal:7070]
    origin_bandwidth: 10Gbit/s
    egress_price_per_gb: 0.02
  us-east:
    nodes: [us-1.internal:7070]
    peers: {eu-west: 25Gbit/s}
""",
    b"""# a comment
registry: file:///srv/registry
regions:
  local:
    nodes:
      - 127.0.0.1:7070
    origin_bandwidth: 200MB/s
    peers: {}
""",
]

SCHEDULE_SEEDS = [
    b"""jobs:
  - name: llama-ft-eu
    region: eu-west
    start: 2026-12-01T08:00:00Z
    datasets: [tokens-en@3, tokens-de]
    priority: high
    epochs: 3
    duration: 6h
""",
    b"""jobs:
  - name: a
    region: us-east
    start: 2026-12-01T08:00:00+02:00
    datasets: [tokens@latest]
  - name: b
    region: eu-west
    start: '2026-12-02T00:00:00Z'
    datasets:
      - images.v2@12
    duration: 90m
    priority: low
""",
    b"jobs: []\n",
]

# The topology schedules are checked against (load_schedule with a topology).
TOPOLOGY = Topology.model_validate(yaml.safe_load(TOPOLOGY_SEEDS[0]))

# ---- helpers that keep mutations past the integrity checks -----------------------------------

_PREFIX = struct.Struct("<2sBBIQQ")  # the checksummed part of the header


def reseal(frame: bytes, *, fix_lengths: bool) -> bytes:
    """Recompute a (mutated) frame's checksum; with ``fix_lengths`` its length fields too.

    ``fix_lengths`` sets payload_len to what follows the header and raw_len to
    what the payload decodes to (its size when uncompressed, the zstd frame's
    declared size when compressed), so that only the payload itself is wrong.
    """
    if len(frame) < HEADER_SIZE:
        return frame
    magic, fmt, codec, rows, payload_len, raw_len = _PREFIX.unpack_from(frame)
    payload = frame[HEADER_SIZE:]
    if fix_lengths:
        payload_len = len(payload)
        if codec == Codec.ZSTD:
            try:
                raw_len = max(zstandard.frame_content_size(payload), 0)
            except zstandard.ZstdError:
                pass
        else:
            raw_len = len(payload)
    prefix = _PREFIX.pack(magic, fmt, codec, rows, payload_len, raw_len)
    digest = xxhash.xxh3_64(prefix + payload).intdigest()
    return prefix + digest.to_bytes(8, "little") + payload


def raw_payload(frame: bytes) -> bytes:
    """The Arrow IPC stream inside a valid frame, decompressed (and joined)."""
    header = read_header(frame)
    payload = bytes(payload_view(frame, header))
    if header.codec in (Codec.BYTE_SPLIT_ZSTD, Codec.BYTE_SPLIT_SPARSE_ZSTD):
        sparse = header.codec is Codec.BYTE_SPLIT_SPARSE_ZSTD
        regions, table = byte_split.unpack_regions(
            memoryview(payload), header.raw_len, sparse=sparse
        )
        split = pa.py_buffer(zstandard.decompress(payload[table:]))
        return byte_split.join(split, regions, header.raw_len).to_pybytes()
    return zstandard.decompress(payload) if header.codec is Codec.ZSTD else payload


def wrap_payload(raw: bytes, *, rows: int, zstd: bool) -> bytes:
    """A correct frame around arbitrary (mutated) Arrow IPC bytes, optionally zstd-compressed."""
    payload = zstandard.ZstdCompressor(level=1).compress(raw) if zstd else raw
    codec = Codec.ZSTD if zstd else Codec.NONE
    prefix = _PREFIX.pack(b"EC", 1, codec, rows, len(payload), len(raw))
    return prefix + xxhash.xxh3_64(prefix + payload).intdigest().to_bytes(8, "little") + payload


def restamp(manifest: pb.Manifest) -> bytes:
    """Binary form of ``manifest`` with its digest recomputed over whatever it now holds."""
    stamped = copy.deepcopy(manifest)
    stamped.digest = content_digest(stamped)
    return stamped.SerializeToString()


# ---- the checks ------------------------------------------------------------------------------


def _message(exc: BaseException) -> str:
    text = str(exc).strip()
    if not text:
        raise AssertionError(f"{type(exc).__name__} raised without a message")
    return text


def check_manifest_json(data: bytes | str) -> str:
    """A manifest as read from origin (JSON)."""
    try:
        manifest = manifest_from_json(data, source="fuzzed.json")
    except ManifestError as exc:
        _message(exc)
        return REJECTED
    _usable(manifest)
    return ACCEPTED


def check_manifest_bytes(data: bytes) -> str:
    """A manifest as received over gRPC (protobuf)."""
    try:
        manifest = manifest_from_bytes(data, source="fuzzed manifest")
    except ManifestError as exc:
        _message(exc)
        return REJECTED
    _usable(manifest)
    return ACCEPTED


def check_manifest_restamped(data: bytes, *, from_json: bool = False) -> str:
    """Parse leniently, recompute the digest, then check: reaches the checks behind the digest."""
    manifest = pb.Manifest()
    try:
        if from_json:
            json_format.Parse(data, manifest)
        else:
            manifest.ParseFromString(data)
    except (json_format.ParseError, DecodeError, UnicodeDecodeError):
        return REJECTED  # the strict parsers refuse these the same way (checked elsewhere)
    return check_manifest_bytes(restamp(manifest))


def _usable(manifest: pb.Manifest) -> None:
    """What the node, the client and the CLI do with an accepted manifest must work."""
    manifest_schema(manifest)
    summarize(manifest).created_at.ToJsonString()
    known = copy.deepcopy(manifest)
    known.DiscardUnknownFields()
    again = manifest_from_json(manifest_to_json(manifest), source="round trip")
    assert again == known, "an accepted manifest does not survive a JSON round trip"
    assert manifest_from_bytes(known.SerializeToString()) == known


def check_topology(data: bytes, path: Path) -> str:
    """A topology file (edgecache.yaml) as written by hand."""
    path.write_bytes(data)
    try:
        topology = load_topology(path)
    except ConfigFileError as exc:
        _named(exc, path)
        return REJECTED
    for region in topology.regions.values():
        assert region.nodes and all(rate >= 0 for rate in region.peers.values())
    return ACCEPTED


def check_schedule(data: bytes, path: Path, topology: Topology | None = None) -> str:
    """A schedule file, alone or checked against a topology."""
    path.write_bytes(data)
    try:
        schedule = load_schedule(path, topology)
    except ConfigFileError as exc:
        _named(exc, path)
        return REJECTED
    for job in schedule.jobs:  # what the planner computes from every job
        assert job.end >= job.start
        for spec in job.datasets:
            parse_spec(spec)
    return ACCEPTED


def _named(exc: ConfigFileError, path: Path) -> None:
    if str(path) not in _message(exc):
        raise AssertionError(f"error does not name the file: {exc}")


def check_chunk(frame: bytes, schema: pa.Schema | None = None, *, verify: bool = True) -> str:
    """A chunk frame as received from a node (verify) or read back from LMDB (verify=False)."""
    try:
        batch = decode_chunk(frame, schema, verify=verify)
    except CodecError as exc:
        _message(exc)
        return REJECTED
    rows = struct.unpack_from("<I", frame, 4)[0]
    assert batch.num_rows == rows, "decoded rows differ from the header"
    assert schema is None or batch.schema.equals(schema)
    batch.validate()
    return ACCEPTED


def manifest_dict(manifest: pb.Manifest) -> dict:
    """``manifest`` as the JSON document origin holds, parsed."""
    return json.loads(manifest_to_json(manifest))
