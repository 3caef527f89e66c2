"""Hostile parser input: fuzzed manifests, topology and schedule files, chunk frames.

Every input must be accepted, or refused with the project's own error and a
message a person can act on (ManifestError, ConfigFileError, CodecError);
what is accepted must be usable (tests/fuzz/fuzztargets.py says how each
input is fed and checked). Any other exception counts as a crash, and so
does an input slower than HANG_S; each test counts them all, reports inputs
tried and crashes as figures, then fails if there was any. Inputs are both structured
(valid documents and messages with fields replaced by hostile values) and
byte-level (flips, inserts, truncations and splices of valid bytes), with
checksums and digests recomputed where a mutation would otherwise never get
past them.

Hypothesis runs in every ``make test`` (counts scaled by chaosutil.count);
the atheris harnesses in tests/fuzz/ add coverage-guided runs when atheris
is installed. The regression cases at the end are what fuzzing found.
"""

from __future__ import annotations

import copy
import json
import resource
import struct
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
import zstandard
from chaosutil import FULL, count
from fuzz import fuzztargets as t
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgecache.cache.codec import decode_chunk
from edgecache.cache.errors import ChunkCorrupt, ConfigFileError, ManifestError
from edgecache.cache.frame import Codec as FrameCodec
from edgecache.cache.frame import pack_frame
from edgecache.cache.manifest import manifest_from_bytes
from edgecache.clients.topology import load_schedule, load_topology
from edgecache.v1 import manifest_pb2 as pb

HANG_S = 5.0  # one parse taking longer than this is a hang
RSS_GROWTH_MIB = 1024  # the whole test growing the process more than this is a huge allocation
SETTINGS = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

MANIFESTS = t.manifest_seeds()
MANIFEST_JSON = [t.manifest_to_json(m).encode() for m in MANIFESTS]
MANIFEST_BINARY = [m.SerializeToString() for m in MANIFESTS]
CHUNKS = t.chunk_seeds()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Tally:
    """Inputs tried, their outcomes and the crashes, for one fuzz test."""

    tried: int = 0
    accepted: int = 0
    crashes: list[str] = field(default_factory=list)
    slowest: float = 0.0
    slowest_input: str = ""
    rss_at_start: float = field(default_factory=_rss_mib)

    def feed(self, label: str, check: Callable[..., str], data: object, *args, **kw) -> None:
        """Run one check; anything but "accepted"/"rejected" is recorded as a crash."""
        self.tried += 1
        started = time.perf_counter()
        try:
            outcome = check(data, *args, **kw)
        except Exception as exc:  # noqa: BLE001 - counting these is the point
            where = "".join(traceback.format_tb(exc.__traceback__)[-3:])
            self.crashes.append(
                f"{label}: {type(exc).__name__}: {str(exc)[:300]}\n"
                f"  input {repr(data)[:300]}\n{where}"
            )
        else:
            self.accepted += outcome == t.ACCEPTED
        took = time.perf_counter() - started
        if took > HANG_S:
            self.crashes.append(f"{label}: took {took:.1f} s (a hang)\n  input {repr(data)[:300]}")
        if took > self.slowest:
            self.slowest, self.slowest_input = took, f"{label}: {repr(data)[:300]}"

    def report(self, figure: Callable[[str, object], None]) -> None:
        grown = _rss_mib() - self.rss_at_start
        figure("inputs tried", self.tried)
        figure("accepted", self.accepted)
        figure("crashes", len(self.crashes))
        figure("slowest input (s)", round(self.slowest, 3))
        print(f"slowest input: {self.slowest_input}")
        assert not self.crashes, f"{len(self.crashes)} crashes, e.g.:\n" + "\n".join(
            self.crashes[:5]
        )
        assert grown < RSS_GROWTH_MIB, f"peak memory grew by {grown:.0f} MiB"


# ---- strategies --------------------------------------------------------------------------

HOSTILE_TEXT = [
    "",
    " ",
    "..",
    "../../etc/passwd",
    "/abs",
    "a/b",
    "nul\x00",
    "tokens",
    "Tokens",
    "tokens@1",
    "tokens@0",
    "tokens@-1",
    "tokens@\u0661",
    "tokens@99999999999999999999999",
    "tokens@latest@1",
    "10Gbit/s",
    "9" * 400 + "MB/s",
    "-5MB/s",
    "99999999999d",
    "0s",
    "1e400",
    "NaN",
    "-1",
    "2024-13-45T00:00:00Z",
    "9999-12-31T23:59:59Z",
    "0001-01-01T00:00:00+23:59",
    "\ufeff",
    "\u202e",
    "\U0001f600",
    "\t\n",
    "x" * 65_536,
]
BIG_TEXT = "y" * (1 << 20)
texts = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=30))
keys = st.one_of(
    st.sampled_from(["", "nodes", "jobs", "name", "<<", "x" * 200]), st.text(max_size=8)
)
ints = st.one_of(
    st.sampled_from(
        [0, -1, 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), 10**30]
    ),
    st.integers(),
)
json_leaves = st.one_of(st.none(), st.booleans(), ints, st.floats(), texts)
yaml_leaves = st.one_of(
    json_leaves,
    st.datetimes(timezones=st.none() | st.just(UTC)),
    st.builds(
        lambda when, minutes: when.replace(tzinfo=timezone(timedelta(minutes=minutes))),
        st.datetimes(),
        st.integers(-1439, 1439),
    ),
    st.dates(),
    st.binary(max_size=16),
)


def _nested(kids: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(kids, max_size=3) | st.dictionaries(keys, kids, max_size=3)


json_values = st.recursive(json_leaves, _nested, max_leaves=8)
yaml_values = st.recursive(yaml_leaves, _nested, max_leaves=8)


def _paths(doc: object, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*at, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            out += _paths(value, (*at, index))
    return out


@st.composite
def mutated_docs(draw: st.DrawFn, seeds: list, values: st.SearchStrategy) -> object:
    """A valid document with 1-3 fields replaced, deleted, added or wrapped in a list."""
    doc = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "wrap"]))
        value = draw(values)
        if not path:
            doc = value if op == "replace" else [doc] if op == "wrap" else doc
            continue
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        key = path[-1]
        if op == "replace":
            parent[key] = value
        elif op == "delete":
            del parent[key]
        elif op == "wrap":
            parent[key] = [parent[key]]
        elif isinstance(parent, dict):
            parent[draw(keys)] = value
        else:
            parent.insert(key, value)
    return doc


INTERESTING = [
    b"\x00",
    b"\xff",
    b"\x7f",
    b"\x80",
    b"\xff\xff\xff\xff",
    b"\x00\x00\x00\x80",
    b"\xff" * 8,
    b"{",
    b"[",
    b'"',
    b"\\",
    b"\xc3",
    b"\xed\xa0\x80",
    b"\n- ",
    b": ",
    b"&a ",
    b"*a",
    b"!!",
]


@st.composite
def mutated_bytes(draw: st.DrawFn, seeds: list[bytes], max_ops: int = 6) -> bytes:
    """Valid bytes with 1..max_ops flips, sets, inserts, deletes, truncations or splices."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "dup", "splice"]))
        pos = draw(st.integers(0, len(data)))
        last = min(pos, len(data) - 1)
        if op == "flip" and data:
            data[last] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[last] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.sampled_from(INTERESTING) | st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
        elif op == "dup":
            data[pos:pos] = data[pos : pos + draw(st.integers(1, 64))]
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            data[pos:] = other[draw(st.integers(0, len(other))) :]
    return bytes(data)


# ---- manifests -------------------------------------------------------------------------------

u64 = st.one_of(st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.one_of(
    st.sampled_from([-62135596801, 253402300800, -(2**63), 2**63 - 1]),
    st.integers(-(2**63), 2**63 - 1),
)
SCHEMA_BYTES = [
    s.serialize().to_pybytes()
    for s in (
        *t.SCHEMAS,
        pa.schema([("x", pa.decimal128(38, 4)), ("m", pa.map_(pa.string(), pa.int8()))]),
        pa.schema([("u", pa.dense_union([pa.field("a", pa.int8()), pa.field("b", pa.utf8())]))]),
        pa.schema([("r", pa.run_end_encoded(pa.int32(), pa.string()))], metadata={"k": "v"}),
    )
]
schema_bytes = st.one_of(
    st.sampled_from(SCHEMA_BYTES), mutated_bytes(SCHEMA_BYTES), st.binary(max_size=64)
)


@st.composite
def manifest_messages(draw: st.DrawFn) -> pb.Manifest:
    """A valid manifest with some fields set to hostile values (any the wire format allows)."""
    m = pb.Manifest()
    m.CopyFrom(draw(st.sampled_from(MANIFESTS)))
    fields = ["dataset", "version", "url", "format", "schema", "created", "spec", "shards"]
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=4)):
        if name == "dataset":
            m.dataset = draw(texts | st.just(BIG_TEXT))
        elif name == "version":
            m.version = draw(u64)
        elif name == "url":
            m.source_url = draw(texts | st.just(BIG_TEXT))
        elif name == "format":
            m.source_format = draw(i32)  # type: ignore[assignment] - open enum: any int32
        elif name == "schema":
            m.arrow_schema = draw(schema_bytes)
        elif name == "created":
            m.created_at.seconds, m.created_at.nanos = draw(i64), draw(i32)
        elif name == "spec":
            spec = m.preprocess
            spec.transform = draw(texts)
            spec.params.update(draw(st.dictionaries(texts, texts, max_size=3)))
            spec.compression = draw(i32)  # type: ignore[assignment]
            spec.compression_level, spec.chunk_bytes = draw(i32), draw(u64)
        else:
            shards = draw(
                st.lists(
                    st.builds(
                        pb.Shard,
                        index=u32,
                        source_key=texts,
                        source_etag=texts,
                        source_size=u64,
                        row_count=u64,
                        stored_size=u64,
                    ),
                    max_size=4,
                )
            )
            if draw(st.booleans()):
                for position, shard in enumerate(shards):
                    shard.index = position
            del m.shards[:]
            m.shards.extend(shards)
    return m


def test_fuzz_manifest_messages(figure) -> None:  # noqa: ANN001
    """Structured: hostile field values in protobuf and JSON, digest recomputed or stale."""
    tally = Tally()

    @settings(max_examples=count(250, 5000), **SETTINGS)
    @given(manifest=manifest_messages())
    def run(manifest: pb.Manifest) -> None:
        binary = manifest.SerializeToString()
        tally.feed("binary", t.check_manifest_bytes, binary)
        tally.feed("binary restamped", t.check_manifest_restamped, binary)
        try:
            text = json_format.MessageToJson(manifest, preserving_proto_field_name=True)
        except (json_format.Error, ValueError):  # a timestamp JSON cannot spell, for one
            return
        tally.feed("json", t.check_manifest_json, text)
        tally.feed("json restamped", t.check_manifest_restamped, text.encode(), from_json=True)

    run()
    tally.report(figure)


def test_fuzz_manifest_json_documents(figure) -> None:  # noqa: ANN001
    """Structured: manifest JSON documents with values of the wrong type, shape or size."""
    tally = Tally()
    docs = [json.loads(text) for text in MANIFEST_JSON]

    @settings(max_examples=count(300, 5000), **SETTINGS)
    @given(doc=mutated_docs(docs, json_values))
    def run(doc: object) -> None:
        text = json.dumps(doc)
        tally.feed("json", t.check_manifest_json, text)
        tally.feed("json restamped", t.check_manifest_restamped, text.encode(), from_json=True)

    run()
    tally.report(figure)


def test_fuzz_manifest_bytes(figure) -> None:  # noqa: ANN001
    """Byte-level: mutated JSON text and protobuf bytes, also with the digest recomputed."""
    tally = Tally()

    @settings(max_examples=count(300, 5000), **SETTINGS)
    @given(
        text=mutated_bytes(MANIFEST_JSON),
        binary=mutated_bytes(MANIFEST_BINARY),
        noise=st.binary(max_size=200),
    )
    def run(text: bytes, binary: bytes, noise: bytes) -> None:
        tally.feed("json", t.check_manifest_json, text)
        tally.feed("json restamped", t.check_manifest_restamped, text, from_json=True)
        tally.feed("binary", t.check_manifest_bytes, binary)
        tally.feed("binary restamped", t.check_manifest_restamped, binary)
        tally.feed("noise", t.check_manifest_bytes, noise)

    run()
    tally.report(figure)


# ---- topology and schedule files -------------------------------------------------------------

TOPOLOGY_DOCS = [yaml.safe_load(s) for s in t.TOPOLOGY_SEEDS]
SCHEDULE_DOCS = [yaml.safe_load(s) for s in t.SCHEDULE_SEEDS]
YAML_SNIPPETS = [
    "!!timestamp x",
    "!!bool maybe",
    "!!int ''",
    "!!int 0x",
    "!!float ''",
    "!!binary '@@'",
    "!!python/object:os.system ls",
    "!!set {a}",
    "!!omap [a: 1]",
    "!!pairs [a]",
    "&a [*a]",
    "&b {k: *b}",
    "*nowhere",
    "[" * 200 + "]" * 200,
    "[" * 3000,
    "{a: " * 1500,
    "? [a]\n: b",
    "<<: {x: 1}",
    "2024-02-30",
    "2024-01-01T00:00:00+99:00",
    "2024-01-01 10:00:00",
    "1" * 5000,
    ".inf",
    "-.nan",
    "0o777",
    "1:2:3",
    "~",
    "yes",
    "\t",
    "\x00",
    "\ufeff",
    "\x85",
    "%YAML 1.1\n---",
    "---\n---",
    "...",
    "'unterminated",
    '"\\xZZ"',
    "|\n  block",
    "a: b: c",
    "- - -",
]
snippets = st.one_of(st.sampled_from(YAML_SNIPPETS), texts)


@st.composite
def yaml_edits(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A valid file with lines inserted, deleted, re-indented or given hostile values."""
    lines = draw(st.sampled_from(seeds)).decode().splitlines()
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["insert", "value", "value", "delete", "indent"]))
        i = draw(st.integers(0, max(len(lines) - 1, 0)))
        if op == "insert" or not lines:
            indent = " " * draw(st.integers(0, 6))
            lines.insert(i, indent + draw(st.sampled_from(["", "- ", "x: "])) + draw(snippets))
        elif op == "value":
            head, sep, _ = lines[i].partition(": ")
            lines[i] = (head + sep if sep else lines[i] + " ") + draw(snippets)
        elif op == "delete":
            del lines[i]
        else:
            lines[i] = " " * draw(st.integers(0, 9)) + lines[i].lstrip()
    text = "\n".join(lines)
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "utf-16", "latin-1"]))
    return text.encode(encoding, errors="replace")


def _yaml(doc: object, flow: bool) -> bytes:
    return yaml.safe_dump(doc, default_flow_style=flow, allow_unicode=True).encode()


def test_fuzz_topology_files(figure, tmp_path: Path) -> None:  # noqa: ANN001
    """Structured documents, line edits and byte mutations of valid topology files."""
    tally = Tally()
    path = tmp_path / "edgecache.yaml"

    @settings(max_examples=count(250, 5000), **SETTINGS)
    @given(
        doc=mutated_docs(TOPOLOGY_DOCS, yaml_values),
        flow=st.booleans(),
        edited=yaml_edits(t.TOPOLOGY_SEEDS),
        mutated=mutated_bytes(t.TOPOLOGY_SEEDS),
    )
    def run(doc: object, flow: bool, edited: bytes, mutated: bytes) -> None:
        for label, data in (("document", _yaml(doc, flow)), ("edit", edited), ("bytes", mutated)):
            tally.feed(label, t.check_topology, data, path)

    run()
    tally.report(figure)


def test_fuzz_schedule_files(figure, tmp_path: Path) -> None:  # noqa: ANN001
    """The same for schedule files, alone and checked against a topology."""
    tally = Tally()
    path = tmp_path / "schedule.yaml"

    @settings(max_examples=count(250, 5000), **SETTINGS)
    @given(
        doc=mutated_docs(SCHEDULE_DOCS, yaml_values),
        flow=st.booleans(),
        edited=yaml_edits(t.SCHEDULE_SEEDS),
        mutated=mutated_bytes(t.SCHEDULE_SEEDS),
        with_topology=st.booleans(),
    )
    def run(doc: object, flow: bool, edited: bytes, mutated: bytes, with_topology: bool) -> None:
        topology = t.TOPOLOGY if with_topology else None
        for label, data in (("document", _yaml(doc, flow)), ("edit", edited), ("bytes", mutated)):
            tally.feed(label, t.check_schedule, data, path, topology)

    run()
    tally.report(figure)


# ---- chunk frames ----------------------------------------------------------------------------

FRAMES = [frame for frame, _ in CHUNKS]
RAW_PAYLOADS = [t.raw_payload(frame) for frame in FRAMES]
expected_schemas = st.sampled_from([None, *t.SCHEMAS])


@st.composite
def header_edits(draw: st.DrawFn) -> bytes:
    """A valid frame with header fields set to any value, then resealed or not."""
    frame = bytearray(draw(st.sampled_from(FRAMES)))
    layout = {"format": (2, "<B"), "codec": (3, "<B"), "rows": (4, "<I")}
    layout |= {"payload_len": (8, "<Q"), "raw_len": (16, "<Q")}
    for name in draw(st.lists(st.sampled_from(sorted(layout)), min_size=1, max_size=3)):
        offset, fmt = layout[name]
        width = struct.calcsize(fmt) * 8
        special = st.sampled_from([0, 1, 2**width - 1, 2 ** (width - 1)])
        struct.pack_into(fmt, frame, offset, draw(special | st.integers(0, 2**width - 1)))
    return t.reseal(bytes(frame), fix_lengths=False) if draw(st.booleans()) else bytes(frame)


def test_fuzz_chunk_frames(figure) -> None:  # noqa: ANN001
    """Structured: hostile header fields; payload mutations behind a correct checksum."""
    tally = Tally()

    @settings(max_examples=count(300, 5000), **SETTINGS)
    @given(
        header=header_edits(),
        payload=mutated_bytes(FRAMES),
        raw=mutated_bytes(RAW_PAYLOADS),
        rows=st.integers(0, 2**32 - 1) | st.integers(0, 8),
        zstd=st.booleans(),
        schema=expected_schemas,
        verify=st.booleans(),
    )
    def run(header, payload, raw, rows, zstd, schema, verify) -> None:  # noqa: ANN001
        tally.feed("header", t.check_chunk, header, schema, verify=verify)
        resealed = t.reseal(payload, fix_lengths=True)
        tally.feed("payload resealed", t.check_chunk, resealed, schema, verify=verify)
        wrapped = t.wrap_payload(raw, rows=rows, zstd=zstd)
        tally.feed("arrow ipc", t.check_chunk, wrapped, schema, verify=verify)

    run()
    tally.report(figure)


def test_fuzz_chunk_bytes(figure) -> None:  # noqa: ANN001
    """Byte-level: damaged frames as they come off a wire or a disk, and plain noise."""
    tally = Tally()

    @settings(max_examples=count(300, 5000), **SETTINGS)
    @given(
        frame=mutated_bytes(FRAMES),
        noise=st.binary(max_size=100),
        schema=expected_schemas,
        verify=st.booleans(),
    )
    def run(frame: bytes, noise: bytes, schema: pa.Schema | None, verify: bool) -> None:
        tally.feed("frame", t.check_chunk, frame, schema, verify=verify)
        tally.feed("noise", t.check_chunk, noise, schema, verify=verify)
        tally.feed("noise with header", t.check_chunk, b"EC\x01\x01" + noise, schema)

    run()
    tally.report(figure)


# ---- atheris (coverage-guided) ---------------------------------------------------------------


def test_atheris_harnesses_run_clean(figure, tmp_path: Path) -> None:  # noqa: ANN001
    """Each harness in tests/fuzz/ briefly (a minute each with EDGECACHE_CHAOS=full)."""
    pytest.importorskip("atheris")
    from fuzz import run as fuzz_run

    runs, seconds = (None, 60) if FULL else (2000, None)
    results = fuzz_run.run_all(list(fuzz_run.TARGETS), tmp_path, runs=runs, seconds=seconds)
    for r in results:
        figure(f"atheris {r.target} inputs tried", r.tried)
        figure(f"atheris {r.target} crashes", int(r.crashed))
    crashed = [f"{r.target}: {r.detail} (log {r.log})" for r in results if r.crashed]
    assert not crashed, "\n".join(crashed)
    assert all(r.tried >= (runs or 1) for r in results), [(r.target, r.tried) for r in results]


# ---- what fuzzing found: each was an exception other than the project's, now a clear error ----

TOPOLOGY_HEAD = "registry: s3://b/r\nregions:\n  eu:\n    nodes: [a:1]\n"
JOB_HEAD = "jobs:\n- name: a\n  region: eu\n  datasets: [tokens]\n"


@pytest.mark.parametrize(
    ("loader", "text", "message"),
    [
        (load_topology, b"registry: \xff\xfe\n", "not UTF-8"),  # was UnicodeDecodeError
        (load_topology, b"registry: " + b"[" * 5000, "not valid YAML"),  # was RecursionError
        (load_topology, TOPOLOGY_HEAD + "    origin_bandwidth: [1]\n", "invalid rate"),
        (load_topology, TOPOLOGY_HEAD + "    origin_bandwidth: 1.5\n", "invalid rate"),  # Attr.
        (load_topology, TOPOLOGY_HEAD + "    peers: {eu: null}\n", "invalid rate"),  # AttrErr.
        (load_topology, TOPOLOGY_HEAD + f"    origin_bandwidth: {'9' * 400}MB/s\n", "too large"),
        (load_topology, TOPOLOGY_HEAD + "    peers: {us: 1GB/s}\n", "is not a region"),  # no path
        # Rates under 1 byte/s were taken for "not given" (the plan used 1 Gbit/s).
        (load_topology, TOPOLOGY_HEAD + "    origin_bandwidth: 0\n", ":5: .* under 1 byte/s"),
        (load_topology, TOPOLOGY_HEAD + "    origin_bandwidth: 7bit/s\n", "under 1 byte/s"),
        (
            load_schedule,
            JOB_HEAD + "  start: 2026-01-01T00:00:00Z\n  duration: 99999999999d\n",
            "too long",
        ),  # was OverflowError
        (
            load_schedule,
            JOB_HEAD + "  start: 9999-12-31T00:00:00Z\n  duration: 2d\n",
            "past the year 9999",
        ),  # was OverflowError in the planner (job.end)
        # Impossible times, unquoted: named by line and field as the quoted form is.
        (
            load_schedule,
            JOB_HEAD + "  start: 2026-13-45T00:00:00Z\n",
            r":5: jobs.0.start: .* not a time",
        ),
        (
            load_schedule,
            JOB_HEAD + "  start: 2026-01-01T00:00:00+99:00\n",
            r":5: jobs.0.start: .* not a time",
        ),
        (load_schedule, JOB_HEAD + "  start: !!timestamp x\n", "not valid YAML"),  # AttributeErr.
        (load_schedule, JOB_HEAD + "  start: !!bool maybe\n", "not valid YAML"),  # KeyError
        (load_schedule, JOB_HEAD + "  epochs: !!int ''\n", "not valid YAML"),  # IndexError
        (load_schedule, JOB_HEAD + "  epochs: " + "1" * 5000 + "\n", "not valid YAML"),
    ],
)
def test_found_config_file_errors(loader, text, message: str, tmp_path: Path) -> None:  # noqa: ANN001
    path = tmp_path / "file.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigFileError, match=message) as info:
        loader(path)
    assert str(path) in str(info.value)


def _zstd_header(content_size: int) -> bytes:
    """A zstd frame that declares ``content_size`` and holds one empty last raw block."""
    single_segment_8_byte_size = 0xE0
    return struct.pack("<IBQ", 0xFD2FB528, single_segment_8_byte_size, content_size) + b"\1\0\0"


@pytest.mark.parametrize(
    ("payload", "raw_len", "message"),
    [
        (zstandard.compress(b"x" * 1000), 2**64 - 1, "declares 1000 bytes"),  # was OverflowError
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"x"), 2**40, "no size"),
        (_zstd_header(1 << 30), 100, "declares 1073741824 bytes"),  # allocated 1 GiB first
        (_zstd_header(1 << 45), 1 << 45, "of zstd can hold"),  # was MemoryError
        (_zstd_header(2**64 - 3), 2**64 - 3, "of zstd can hold"),  # was OverflowError
    ],
)
def test_found_zstd_sizes_are_checked_before_allocating(payload, raw_len, message) -> None:  # noqa: ANN001
    rss = _rss_mib()
    frame = pack_frame(payload, codec=FrameCodec.ZSTD, rows=1, raw_len=raw_len)
    with pytest.raises(ChunkCorrupt, match=message):
        decode_chunk(frame)
    assert _rss_mib() - rss < 256


def _ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _patched(raw: bytes, old: bytes, new: bytes, fails: Callable[[bytes], bool]) -> bytes:
    """``raw`` with the one occurrence of ``old`` replaced that makes ``fails`` true."""
    at = -1
    while (at := raw.find(old, at + 1)) >= 0:
        candidate = raw[:at] + new + raw[at + len(old) :]
        if fails(candidate):
            return candidate
    raise AssertionError("no such patch")


def _raises(kind: type[BaseException], fn: Callable[[], object]) -> bool:
    try:
        fn()
    except kind:
        return True
    except Exception:  # noqa: BLE001
        return False
    return False


def _read(raw: bytes) -> pa.RecordBatch:
    return pa.ipc.open_stream(raw).read_next_batch()


def test_found_arrow_errors_become_chunk_corrupt() -> None:
    # An Int of 128 bits in the schema: ArrowNotImplementedError, not ArrowInvalid.
    wide = _patched(
        _ipc(pa.record_batch([pa.array([1], pa.int64())], names=["x"])),
        b"\x40\0\0\0",
        b"\x80\0\0\0",
        lambda raw: _raises(pa.ArrowNotImplementedError, lambda: _read(raw)),
    )
    with pytest.raises(ChunkCorrupt, match="Integers with more than 64 bits"):
        decode_chunk(t.wrap_payload(wide, rows=1, zstd=False))
    # A column name that is not UTF-8: pyarrow reads it, and raises when the name is used.
    named = _patched(
        _ipc(pa.record_batch([pa.array([1], pa.int8())], names=["é"])),
        "é".encode(),
        b"\xff\xfe",
        lambda raw: _raises(UnicodeDecodeError, lambda: _read(raw).schema.names),
    )
    for schema in (None, pa.schema([("x", pa.int8())])):
        with pytest.raises(ChunkCorrupt, match="not UTF-8"):
            decode_chunk(t.wrap_payload(named, rows=1, zstd=True), schema)
    # A validity bitmap shorter than the column: read without complaint, unsafe to use.
    short = _patched(
        _ipc(pa.record_batch([pa.array([1, None], pa.int64())], names=["x"])),
        struct.pack("<qq", 0, 1),  # offset and length of the validity bitmap
        struct.pack("<qq", 0, 0),
        lambda raw: _raises(pa.ArrowInvalid, lambda: _read(raw).validate()),
    )
    with pytest.raises(ChunkCorrupt, match="too small"):
        decode_chunk(t.wrap_payload(short, rows=2, zstd=False))


def test_found_manifest_errors() -> None:
    base = MANIFESTS[0]
    schema_named = _patched(
        pa.schema([("é", pa.int8())]).serialize().to_pybytes(),
        "é".encode(),
        b"\xff\xfe",
        lambda raw: _raises(
            UnicodeDecodeError, lambda: pa.ipc.read_schema(pa.py_buffer(raw)).names
        ),
    )
    wide = _patched(
        pa.schema([("x", pa.int64())]).serialize().to_pybytes(),
        b"\x40\0\0\0",
        b"\x80\0\0\0",
        lambda raw: _raises(
            pa.ArrowNotImplementedError, lambda: pa.ipc.read_schema(pa.py_buffer(raw))
        ),
    )
    for arrow_schema, message in ((schema_named, "not UTF-8"), (wide, "cannot be decoded")):
        bad = copy.deepcopy(base)
        bad.arrow_schema = arrow_schema
        with pytest.raises(ManifestError, match=message):
            manifest_from_bytes(t.restamp(bad))
    # Shard sizes whose sum does not fit the listing's uint64: summarize() raised ValueError.
    bad = copy.deepcopy(MANIFESTS[1])
    bad.shards[0].source_size = bad.shards[1].source_size = 2**63
    with pytest.raises(ManifestError, match="source_size values add up"):
        manifest_from_bytes(t.restamp(bad))
    # A creation time outside what protobuf's Timestamp allows: the CLI's listing raised.
    for seconds, nanos in ((2**62, 0), (0, -5)):
        bad = copy.deepcopy(base)
        bad.created_at.seconds, bad.created_at.nanos = seconds, nanos
        with pytest.raises(ManifestError, match="created_at"):
            manifest_from_bytes(t.restamp(bad))


def test_big_values_finish_quickly(tmp_path: Path) -> None:
    """Long values are parsed or refused in linear time, well within the hang limit.

    PyYAML's pure-Python parser is slow (about 150 KB/s, or 8,000 tokens/s,
    and topology.py parses twice: for the data and for line numbers), so the
    YAML values are 256 KiB here and 1 MiB in full runs.
    """
    size = count(256 << 10, 1 << 20)
    path = tmp_path / "edgecache.yaml"
    tally = Tally()
    for text in (
        TOPOLOGY_HEAD.replace("s3://b/r", "r" * size),
        TOPOLOGY_HEAD + f"    origin_bandwidth: {'9' * size}\n",
    ):
        tally.feed("topology", t.check_topology, text.encode(), path)
    big = copy.deepcopy(MANIFESTS[1])
    big.source_url = BIG_TEXT
    tally.feed("manifest", t.check_manifest_restamped, big.SerializeToString())
    big.dataset = BIG_TEXT
    tally.feed("manifest", t.check_manifest_json, t.manifest_to_json(big))
    assert tally.accepted == 2  # the long registry and source_url
    assert not tally.crashes, tally.crashes


def test_a_negative_or_zero_duration_is_refused(tmp_path: Path) -> None:
    """Found by the full-count fuzz: ``duration: -1`` (seconds) ended a job before it began."""
    topology = tmp_path / "edgecache.yaml"
    topology.write_text("registry: file:///r\nregions:\n  eu-west:\n    nodes: ['a:1']\n")
    for duration in ("-1", "0", "0m"):
        schedule = tmp_path / "schedule.yaml"
        schedule.write_text(
            "jobs:\n  - name: j\n    region: eu-west\n    start: 2026-12-01T08:00:00Z\n"
            f"    datasets: [tokens@1]\n    duration: {duration}\n"
        )
        with pytest.raises(ConfigFileError, match="duration"):
            load_schedule(schedule, load_topology(topology))
