"""WebDataset tar shards as a source: members grouped by key into rows.

WebDataset's convention (``webdataset.tariterators``): a member's *key* is its
path up to the first dot of its file name, the rest is its *extension*, and
consecutive members with the same key form one sample
(``n01/img_7.jpg`` + ``n01/img_7.cls`` → key ``n01/img_7``). Each sample
becomes one row: ``__key__`` (string), then one column per extension, in
sorted order so every node and every shard agrees on it:

* ``cls``, ``cls2``, ``index``, ``inx``, ``id`` → int64 (WebDataset decodes
  them as integers too);
* ``txt``, ``text``, ``transcript``, ``json``, ``jsn`` → string (JSON stays its
  text: a column of one Arrow type cannot hold arbitrary JSON);
* anything else (``jpg``, ``png``, ``npy``, …) → binary, the member's bytes
  unchanged: decode images at the edge with the ``images`` transform.

A sample without some extension gets a null there. Members' bytes are not
copied until a batch is built, and batches hold at most ``batch_bytes`` of
member data, so shards of large images stay bounded in memory.
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Iterator

import pyarrow as pa

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.arrow_types import binary_column
from edgecache.cache.preprocess.fixes import FIX

__all__ = ["BATCH_BYTES", "INT_EXTENSIONS", "TEXT_EXTENSIONS", "tar_schema", "tar_source"]

INT_EXTENSIONS = frozenset({"cls", "cls2", "index", "inx", "id"})
TEXT_EXTENSIONS = frozenset({"txt", "text", "transcript", "json", "jsn"})
BATCH_BYTES = 64 << 20
KEY = "__key__"
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext

Sample = tuple[str, dict[str, memoryview]]


def _field(ext: str) -> pa.Field:
    if ext in INT_EXTENSIONS:
        return pa.field(ext, pa.int64())
    return pa.field(ext, pa.string() if ext in TEXT_EXTENSIONS else pa.binary())


def _samples(data: memoryview, source: str) -> Iterator[Sample]:
    """(key, {extension: bytes}) per sample, in tar order."""
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:")  # noqa: SIM115
    except tarfile.TarError as exc:
        raise MalformedShard(f"{source} is not a readable tar archive ({exc}); {FIX}") from exc
    key: str | None = None
    fields: dict[str, memoryview] = {}
    try:
        for member in archive:
            if not member.isfile():
                continue
            match = _KEY_EXT.match(member.name)
            if match is None or member.name.rsplit("/", 1)[-1].startswith("__"):
                continue  # no extension, or WebDataset's own markers: not sample data
            name, ext = match.group(1), match.group(2).lower()
            if name != key:
                if key is not None:
                    yield key, fields
                key, fields = name, {}
            if ext in fields:
                raise MalformedShard(
                    f"{source}: sample {name!r} has two members with extension {ext!r} "
                    f"(the second is {member.name!r}); {FIX}"
                )
            end = member.offset_data + member.size
            if end > len(data):
                raise MalformedShard(
                    f"{source}: member {member.name!r} runs past the end of the archive "
                    f"(truncated tar); {FIX}"
                )
            fields[ext] = data[member.offset_data : end]
    except tarfile.TarError as exc:
        raise MalformedShard(f"{source}: damaged tar archive ({exc}); {FIX}") from exc
    if key is not None:
        yield key, fields


def tar_schema(data: bytes | memoryview, source: str) -> tuple[pa.Schema, int]:
    """The schema and sample count of a tar shard, from its member headers alone."""
    extensions: set[str] = set()
    count = 0
    for _, fields in _samples(memoryview(data), source):
        extensions.update(fields)
        count += 1
    if not count:
        raise MalformedShard(f"{source}: the tar archive holds no samples (key.ext members); {FIX}")
    return pa.schema([pa.field(KEY, pa.string()), *(_field(e) for e in sorted(extensions))]), count


def _batch(samples: list[Sample], schema: pa.Schema, source: str) -> pa.RecordBatch:
    columns: list[pa.Array] = [pa.array([key for key, _ in samples], pa.string())]
    for field in schema:
        if field.name == KEY:
            continue
        values = [fields.get(field.name) for _, fields in samples]
        if field.type == pa.int64():
            numbers: list[int | None] = []
            for (key, _), value in zip(samples, values, strict=True):
                if value is None:
                    numbers.append(None)
                    continue
                try:
                    numbers.append(int(bytes(value).strip() or b"x"))
                except ValueError:
                    raise MalformedShard(
                        f"{source}: sample {key!r}: {field.name} holds {bytes(value)[:40]!r}, not "
                        f"an integer (WebDataset's .{field.name} is a class number); {FIX}"
                    ) from None
            columns.append(pa.array(numbers, pa.int64()))
            continue
        try:
            columns.append(binary_column(values, string=field.type == pa.string()))
        except (ValueError, pa.ArrowInvalid) as exc:
            raise MalformedShard(
                f"{source}: a .{field.name} member is not UTF-8 text ({exc}); {FIX}"
            ) from exc
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def tar_source(
    data: bytes | memoryview, source: str, batch_rows: int, batch_bytes: int = BATCH_BYTES
) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int]:
    """The schema, the row batches and the sample count of a tar shard.

    Raises:
        MalformedShard: not a tar, truncated, a sample with a repeated extension, a bad
            integer or text member; the message names the object and the sample.
    """
    view = memoryview(data)
    schema, count = tar_schema(view, source)

    def batches() -> Iterator[pa.RecordBatch]:
        pending: list[Sample] = []
        size = 0
        for sample in _samples(view, source):
            pending.append(sample)
            size += sum(len(v) for v in sample[1].values())
            if len(pending) >= batch_rows or size >= batch_bytes:
                yield _batch(pending, schema, source)
                pending, size = [], 0
        if pending:
            yield _batch(pending, schema, source)

    return schema, batches(), count
