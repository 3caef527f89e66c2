"""WebDataset tar shards as a source: members grouped by key into rows.

WebDataset's convention (``webdataset.tariterators``): a member's *key* is its
path up to the first dot of its file name, the rest is its *extension*, and
consecutive members with the same key form one sample
(``n01/img_7.jpg`` + ``n01/img_7.cls`` → key ``n01/img_7``). Members that
WebDataset takes for metadata are skipped as it skips them: a top-level name
that starts and ends with ``__``, and anything under such a folder
(``__meta__/…``); a key whose file name merely starts with ``__`` (``x/__a``)
is a sample like any other. Each sample becomes one row: ``__key__``
(string), then one column per extension, in sorted order so every node and
every shard agrees on it, typed as WebDataset's ``.decode()`` types it, by
the extension's last part (``caption.txt`` is text, ``label.cls`` an integer;
the column keeps the full extension as its name):

* ``cls``, ``cls2``, ``index``, ``inx``, ``id`` → int64 (WebDataset decodes
  them as integers too; publish refuses a member that is not one, naming it);
* ``txt``, ``text``, ``transcript``, ``json``, ``jsn`` → string (JSON stays its
  text: a column of one Arrow type cannot hold arbitrary JSON);
* anything else (``jpg``, ``png``, ``npy``, …) → binary, the member's bytes
  unchanged: decode images at the edge with the ``images`` transform.

Versions published before these rules were WebDataset's own (keys whose
file name started with ``__`` were skipped, multi-dot extensions were binary)
are read as they were published: publish records ``members=webdataset`` in
the version's source options (:data:`MEMBER_RULES`), and a version without it
is read by the earlier rules, so its rows and types stay those its manifest
recorded.

A sample without some extension gets a null there. Members' bytes are not
copied until a batch is built, and batches hold at most ``batch_bytes`` of
member data, so shards of large images stay bounded in memory.

Publish reads each tar once, whole, as it reads CSV and JSON Lines: a tar has
no index, and its member headers lie throughout the file, each before its
member's bytes, so counting the samples takes the whole object (from S3, the
whole dataset is downloaded at publish). Only the headers are parsed then; no
member is decoded.
"""

from __future__ import annotations

import codecs
import io
import json
import re
import tarfile
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.arrow_types import binary_column
from edgecache.cache.preprocess.fixes import FIX

__all__ = [
    "BATCH_BYTES",
    "INT_EXTENSIONS",
    "MEMBER_RULES",
    "MEMBER_RULES_OPTION",
    "TEXT_EXTENSIONS",
    "tar_schema",
    "tar_source",
]

INT_EXTENSIONS = frozenset({"cls", "cls2", "index", "inx", "id"})
TEXT_EXTENSIONS = frozenset({"txt", "text", "transcript", "json", "jsn"})
BATCH_BYTES = 64 << 20
KEY = "__key__"
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator skip_meta
# The rules of versions published before MEMBER_RULES: the key's file name ended at its
# first dot or slash, any member whose file name started with __ was skipped, and a
# multi-dot extension was typed by the whole of it (binary).
_EARLIER_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
MEMBER_RULES_OPTION = "members"  # the source option publish records the rules in
MEMBER_RULES = "webdataset"  # WebDataset's own key, metadata and type rules

Sample = tuple[str, dict[str, memoryview]]


def _kind(ext: str) -> str:
    """The part of an extension that says its type: the last (``label.cls`` → ``cls``).

    WebDataset's decoders match the extension's last part alone
    (``autodecode.basichandlers``).
    """
    return ext.rsplit(".", 1)[-1]


def _field(ext: str, earlier: bool = False) -> pa.Field:
    kind = ext if earlier else _kind(ext)
    if kind in INT_EXTENSIONS:
        return pa.field(ext, pa.int64())
    return pa.field(ext, pa.string() if kind in TEXT_EXTENSIONS else pa.binary())


def _is_metadata(name: str) -> bool:
    """Whether WebDataset skips this member as metadata rather than sample data.

    Its rule exactly (``webdataset.tariterators.tar_file_iterator``): a top-level
    name that starts and ends with ``__``, or one matching ``__…__`` up to the end
    or a ``/`` from its start. ``x/__a.jpg`` and ``__a.jpg`` are samples.
    """
    top = "/" not in name and name.startswith("__") and name.endswith("__")
    return top or _META.match(name) is not None


def _integer(value: memoryview) -> int | None:
    """The integer an int-typed member holds (as WebDataset's ``int(data)`` reads it)."""
    try:
        number = int(bytes(value).strip() or b"x")
    except ValueError:
        return None
    return number if -(2**63) <= number < 2**63 else None


def _not_integer(source: str, key: str, ext: str, value: memoryview) -> MalformedShard:
    """The error for an int-typed member that holds no int64, with what to do instead."""
    kind = _kind(ext)
    text = ext.rsplit(".", 1)[0] + ".txt" if "." in ext else f"{ext}.txt"
    try:
        int(bytes(value).strip() or b"x")
        what, decode = "an integer past int64", ""
    except ValueError:
        what, decode = "not an integer", " (its .decode() fails on this one too)"
    return MalformedShard(
        f"{source}: sample {key!r}: {ext} holds {bytes(value)[:40]!r}, {what} (member "
        f"{key}.{ext}); WebDataset reads a .{kind} member as an integer{decode}, and WebDataset "
        f"sources take no --column-types: to keep such values as text, name the members "
        f".{text} (a string column {text!r}); else {FIX}"
    )


def _check_text(source: str, key: str, ext: str, value: memoryview | bytes | None) -> None:
    """Raise :class:`MalformedShard` naming the sample unless a text member is UTF-8."""
    try:
        codecs.decode(value or b"", "utf-8")
    except UnicodeDecodeError as exc:
        raise _not_text(source, key, ext, exc) from None


def _not_text(source: str, key: str, ext: str, exc: UnicodeDecodeError) -> MalformedShard:
    """The error for a text-typed member that is not UTF-8, naming it and what to do."""
    return MalformedShard(
        f"{source}: sample {key!r}: member {key}.{ext} is not UTF-8 text ({exc.reason} at "
        f"byte {exc.start}); WebDataset reads a .{_kind(ext)} member as text: re-encode it as "
        f"UTF-8, or name such members with a binary extension (.bin) to keep their bytes; "
        f"else {FIX}"
    )


def _wids_index(data: memoryview) -> bool:
    """Whether ``data`` is a wids index (``train.json``: a JSON object with a shardlist)."""
    if len(data) > 64 << 20 or bytes(data[:64]).lstrip()[:1] != b"{":
        return False
    try:
        index = json.loads(bytes(data))
    except (ValueError, RecursionError):
        return False
    if not isinstance(index, dict):
        return False
    kind = index.get("__kind__")
    return isinstance(index.get("shardlist"), list) or (
        isinstance(kind, str) and kind.startswith("wids")
    )


def _not_a_tar(data: memoryview, source: str, exc: tarfile.TarError) -> MalformedShard:
    if _wids_index(data):
        name = source.rstrip("/").rsplit("/", 1)[-1]
        return MalformedShard(
            f"{source} is a wids index (a JSON list of the shards and their sample counts), "
            f"not a WebDataset shard; the shards it lists are the tars beside it: publish "
            f"without it (--exclude {name})"
        )
    return MalformedShard(f"{source} is not a readable tar archive ({exc}); {FIX}")


def _samples(data: memoryview, source: str, earlier: bool = False) -> Iterator[Sample]:
    """(key, {extension: bytes}) per sample, in tar order (``earlier``: the earlier rules)."""
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:")  # noqa: SIM115
    except tarfile.TarError as exc:
        raise _not_a_tar(data, source, exc) from exc
    key: str | None = None
    fields: dict[str, memoryview] = {}
    try:
        for member in archive:
            if not member.isfile():
                continue
            match = (_EARLIER_KEY_EXT if earlier else _KEY_EXT).match(member.name)
            if match is None or (
                member.name.rsplit("/", 1)[-1].startswith("__")
                if earlier
                else _is_metadata(member.name)
            ):
                continue  # no extension, or WebDataset's own metadata: not sample data
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
    _check_end(data, archive.offset, source)
    if key is not None:
        yield key, fields


_BLOCK = 512


def _check_end(data: memoryview, offset: int, source: str) -> None:
    """Refuse an archive that does not end with tar's end-of-archive (zero) blocks.

    ``tarfile`` ends its listing quietly at a member header cut short, damaged
    or missing anywhere past the first: a tar cut at a member's edge (an upload
    interrupted there) published with its last samples gone, or the last one
    short of some members (a helper's walk: 10 % of random cuts of one shard).
    What follows the last member must be zero blocks, as every tar writer ends.
    """
    rest = data[offset:]
    if len(rest) >= _BLOCK and not np.frombuffer(rest, np.uint8).any():
        return
    found = "nothing" if not len(rest) else "bytes that are no member header"
    raise MalformedShard(
        f"{source}: the tar archive has {found} at byte {offset:,} of {len(data):,} where "
        "the next member or the end-of-archive blocks should be: it is truncated or damaged "
        f"there (an interrupted upload or copy?), and the samples from there on would be lost; "
        f"{FIX}"
    )


def _check_key(source: str, key: str) -> None:
    """Refuse a sample key that is not UTF-8 text, naming it (the ``__key__`` column is text).

    tarfile reads such a member name with surrogate escapes: it published, and
    every node then failed the shard ("surrogates not allowed"), naming no member.
    """
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raw = key.encode("utf-8", "surrogateescape")
        raise MalformedShard(
            f"{source}: the sample key {raw!r} is not UTF-8 (a member name written in another "
            "encoding, such as Latin-1), and keys are text; rename the members to UTF-8 (e.g. "
            "convmv -f latin1 -t utf8 on the files) and pack the tar again"
        ) from None


def tar_schema(
    data: bytes | memoryview, source: str, rules: str = MEMBER_RULES
) -> tuple[pa.Schema, int]:
    """The schema and sample count of a tar shard, from its member headers.

    Members typed as integers (``.cls``, ``.id``, …: a few bytes each) are read
    too, so one that holds no integer is refused at publish, naming it, rather
    than failing every read of the shard. ``rules``: the version's recorded
    :data:`MEMBER_RULES_OPTION` ("" for a version published before it).
    """
    earlier = rules != MEMBER_RULES
    extensions: set[str] = set()
    count = 0
    for key, fields in _samples(memoryview(data), source, earlier):
        _check_key(source, key)
        extensions.update(fields)
        count += 1
        for ext, value in fields.items():
            kind = ext if earlier else _kind(ext)
            if kind in INT_EXTENSIONS and _integer(value) is None:
                raise _not_integer(source, key, ext, value)
            if kind in TEXT_EXTENSIONS:
                # Refused here, naming the sample: unchecked, the version published and
                # every node then failed the shard at staging, naming no sample.
                _check_text(source, key, ext, value)
    if not count:
        raise MalformedShard(f"{source}: the tar archive holds no samples (key.ext members); {FIX}")
    columns = [_field(e, earlier) for e in sorted(extensions)]
    return pa.schema([pa.field(KEY, pa.string()), *columns]), count


def _batch(samples: list[Sample], schema: pa.Schema, source: str) -> pa.RecordBatch:
    columns: list[pa.Array] = [pa.array([key for key, _ in samples], pa.string())]
    for field in schema:
        if field.name == KEY:
            continue
        values = [fields.get(field.name) for _, fields in samples]
        if field.type == pa.int64():
            numbers: list[int | None] = []
            for (key, _), value in zip(samples, values, strict=True):
                number = None if value is None else _integer(value)
                if value is not None and number is None:
                    raise _not_integer(source, key, field.name, value)
                numbers.append(number)
            columns.append(pa.array(numbers, pa.int64()))
            continue
        try:
            columns.append(binary_column(values, string=field.type == pa.string()))
        except (ValueError, pa.ArrowInvalid) as exc:
            # A version published before publish checked text members: name the sample.
            for (key, _), value in zip(samples, values, strict=True):
                _check_text(source, key, field.name, value)
            raise MalformedShard(
                f"{source}: a .{field.name} member is not UTF-8 text ({exc}); {FIX}"
            ) from exc
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def tar_source(
    data: bytes | memoryview,
    source: str,
    batch_rows: int,
    batch_bytes: int = BATCH_BYTES,
    rules: str = MEMBER_RULES,
) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int]:
    """The schema, the row batches and the sample count of a tar shard.

    ``rules``: as for :func:`tar_schema`.

    Raises:
        MalformedShard: not a tar, truncated, a sample with a repeated extension, a bad
            integer or text member; the message names the object and the sample.
    """
    view = memoryview(data)
    schema, count = tar_schema(view, source, rules)
    earlier = rules != MEMBER_RULES

    def batches() -> Iterator[pa.RecordBatch]:
        pending: list[Sample] = []
        size = 0
        for sample in _samples(view, source, earlier):
            pending.append(sample)
            size += sum(len(v) for v in sample[1].values())
            if len(pending) >= batch_rows or size >= batch_bytes:
                yield _batch(pending, schema, source)
                pending, size = [], 0
        if pending:
            yield _batch(pending, schema, source)

    return schema, batches(), count
