"""MosaicML Streaming (MDS) shards as a source.

An MDS dataset is a directory: ``index.json`` lists its shards with their
sample counts, column names and column encodings, and each shard file
(``shard.00000.mds``, or ``.mds.zstd`` / ``.mds.gz`` / ``.mds.bz2`` when
compressed) holds ``[count: u32][offsets: (count + 1) × u32][samples]``; a
sample is ``[sizes of its variable-size columns: u32 each][column bytes…]``
(``streaming.base.format.mds``). Publishing reads ``index.json`` alone — row
counts and the schema are there — so it never downloads the shards.

Encodings become Arrow types one to one:

* ``int``, ``int8``…``uint64``, ``float16``…``float64`` → that number type;
* ``str_int`` → int64, ``str_float`` → float64 (parsed from their text);
* ``str``, ``str_decimal``, ``json`` → string (JSON stays its text);
* ``ndarray:<dtype>:<d1,d2,…>`` → nested fixed-size lists of ``dtype``, so
  EdgeDataset yields ``[batch, d1, d2, …]`` tensors;
* ``bytes``, ``jpeg``, ``png`` and anything else (``pil``, ``pkl``, dynamic
  ``ndarray``, lists) → binary, the encoded bytes unchanged: ``pkl`` is never
  unpickled on a node (unpickling runs code), and ``jpeg``/``png`` columns
  can be decoded at the edge by the ``images`` transform (a ``pil`` column,
  raw pixels behind MDS's own header, is refused for it at publish:
  :func:`image_encoding_problem`).

A shard listed by several indexes (a root ``index.json`` from ``merge_index``
beside the streams' own) is one shard; a Streaming local cache's compressed
shard kept decompressed under its ``raw_data`` name is read from that file
(:attr:`MdsShard.raw`). LitData's ``index.json`` (``chunks`` and ``config``)
is told apart and refused: its chunks are no source (:func:`is_litdata_index`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.arrow_types import binary_column
from edgecache.cache.preprocess.fixes import FIX

__all__ = [
    "LITDATA_ADVICE",
    "MdsColumns",
    "MdsShard",
    "image_encoding_problem",
    "is_litdata_index",
    "mds_index",
    "mds_source",
]

_SCALARS = {
    "int": "int64",
    **{t: t for t in "int8 int16 int32 int64 uint8 uint16 uint32 uint64".split()},
    **{t: t for t in "float16 float32 float64".split()},
}
_STRINGS = frozenset({"str", "str_decimal", "json"})
_COMPRESSIONS = {None: "", "zstd": ".zstd", "gz": ".gz", "bz2": ".bz2"}
_MAX_SIDE = 1 << 31  # an ndarray side pyarrow's fixed-size lists can hold
MAX_SAMPLES = (1 << 32) - 1  # a shard's header counts its samples in a u32
# MDS encodings whose values are an image file Pillow opens (bytes may hold WebP or any).
_IMAGE_FILES = frozenset({"jpeg", "png", "bytes"})
LITDATA_ADVICE = (
    "LitData's .bin chunks are not a source edgecache reads: export the dataset to Parquet "
    "(iterate litdata.StreamingDataset and write the rows with pyarrow.parquet, or use "
    "LitData's own tools) and publish that"
)


def is_litdata_index(index: object) -> bool:
    """Whether a parsed ``index.json`` is LitData's (``optimize()``): ``chunks`` and ``config``.

    LitData names its index ``index.json`` too, beside ``chunk-*.bin`` files; read as
    anything else it was a one-row JSON Lines version of the index, or an MDS index
    missing its ``shards``.
    """
    return (
        isinstance(index, dict)
        and isinstance(index.get("chunks"), list)
        and isinstance(index.get("config"), dict)
        and "shards" not in index
    )


@dataclass(frozen=True, slots=True)
class MdsShard:
    """One shard as ``index.json`` lists it: its file (relative to the index) and samples."""

    key: str
    samples: int
    raw: str | None = None  # a compressed shard's decompressed file, as a local cache holds it


@dataclass(frozen=True, slots=True)
class MdsColumns:
    """The columns of an MDS dataset: names, encodings and fixed sizes (None: variable)."""

    names: tuple[str, ...]
    encodings: tuple[str, ...]
    sizes: tuple[int | None, ...]

    def to_option(self) -> str:
        """The form recorded in the version's ``source_options["columns"]``."""
        return json.dumps([list(self.names), list(self.encodings), list(self.sizes)])

    @classmethod
    def from_option(cls, text: str, source: str) -> MdsColumns:
        """Read back :meth:`to_option`; MalformedShard naming ``source`` if it is not that."""
        try:
            names, encodings, sizes = json.loads(text)
            return cls(tuple(map(str, names)), tuple(map(str, encodings)), tuple(sizes))
        except (ValueError, TypeError) as exc:
            raise MalformedShard(
                f"{source}: the version's MDS column list is damaged ({exc}); publish it again"
            ) from exc

    def schema(self) -> pa.Schema:
        """The Arrow schema of the rows."""
        return pa.schema(
            [pa.field(n, _arrow_type(e)) for n, e in zip(self.names, self.encodings, strict=True)]
        )


def _ndarray(encoding: str) -> tuple[np.dtype, tuple[int, ...]] | None:
    """The dtype and shape of a fixed ``ndarray:<dtype>:<d1,…>``; None for anything else.

    Only numbers with positive sides: any other spelling (``ndarray:O:2``,
    ``ndarray:int8:-1``) is kept as binary, like every encoding not known here.
    """
    parts = encoding.split(":")
    if len(parts) != 3 or parts[0] != "ndarray":
        return None
    try:
        shape = tuple(int(d) for d in parts[2].split(","))
        dtype = np.dtype(parts[1])
    except (TypeError, ValueError):
        return None
    if dtype.kind not in "biuf" or not shape or min(shape) < 1 or max(shape) > _MAX_SIDE:
        return None
    return dtype, shape


def _arrow_type(encoding: str) -> pa.DataType:
    if encoding in _SCALARS:
        return pa.from_numpy_dtype(np.dtype(_SCALARS[encoding]))
    if encoding == "str_int":
        return pa.int64()
    if encoding == "str_float":
        return pa.float64()
    if encoding in _STRINGS:
        return pa.string()
    if (fixed := _ndarray(encoding)) is not None:
        arrow: pa.DataType = pa.from_numpy_dtype(fixed[0])
        for dim in reversed(fixed[1]):
            arrow = pa.list_(arrow, dim)
        return arrow
    return pa.binary()


def mds_index(text: bytes, source: str) -> tuple[MdsColumns, list[MdsShard]]:
    """Columns and shards from an MDS ``index.json``; all its shards must share columns.

    Raises:
        MalformedShard: not an MDS index (version 2), shards that disagree on columns, or
            a compression edgecache cannot read (brotli, snappy); the message says which.
    """
    try:
        index = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedShard(f"{source} is not an MDS index.json (not JSON: {exc}); {FIX}") from exc
    if is_litdata_index(index):
        raise MalformedShard(f"{source} is a LitData index (chunks and config), not MDS; "
                             f"{LITDATA_ADVICE}")  # fmt: skip
    entries = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(entries, list):
        raise MalformedShard(
            f"{source} is not an MDS index.json (it has no list of 'shards'); {FIX}"
        )
    if index.get("version") != 2:
        raise MalformedShard(
            f"{source} is not an MDS index.json of version 2 (it says version "
            f"{index.get('version')!r}); {FIX}"
        )
    columns: MdsColumns | None = None
    shards = []
    for number, entry in enumerate(entries):
        where = f"{source}: shard {number}"
        try:
            these, shard = _entry(entry, where)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, MalformedShard):
                raise
            raise MalformedShard(f"{where} is not an MDS shard entry ({exc!r}); {FIX}") from exc
        if columns is None:
            columns = these
        elif these != columns:
            raise MalformedShard(
                f"{where} has columns {list(these.names)} ({list(these.encodings)}) but shard 0 "
                f"has {list(columns.names)} ({list(columns.encodings)}); publish them apart"
            )
        shards.append(shard)
    if columns is None:
        raise MalformedShard(f"{source} lists no shards; {FIX}")
    return columns, shards


def _entry(entry: dict, where: str) -> tuple[MdsColumns, MdsShard]:
    """One ``shards`` entry of an index, checked: it comes from origin, not from MDSWriter."""
    if entry.get("format") != "mds":
        raise MalformedShard(
            f"{where} has format {entry.get('format')!r}; only MDS shards are read (publish "
            "JSON/CSV MDS-style shards with --format jsonl or csv)"
        )
    compression = (entry.get("compression") or None) and str(entry["compression"]).split(":")[0]
    if compression not in _COMPRESSIONS:
        raise MalformedShard(
            f"{where} is {compression}-compressed, which edgecache cannot read; rewrite the "
            "dataset with compression zstd, gz or bz2 (or none)"
        )
    names, encodings, sizes = (entry[k] for k in ("column_names", "column_encodings",
                                                  "column_sizes"))  # fmt: skip
    if not all(isinstance(v, list) for v in (names, encodings, sizes)) or not (
        len(names) == len(encodings) == len(sizes)
    ):
        raise MalformedShard(f"{where}: column_names, _encodings and _sizes must be lists alike")
    if not all(isinstance(v, str) for v in (*names, *encodings)):
        raise MalformedShard(f"{where}: column names and encodings must be strings")
    if not all(z is None or (type(z) is int and z >= 0) for z in sizes):
        raise MalformedShard(f"{where}: column sizes must be whole numbers or null")
    if len(set(names)) != len(names):
        raise MalformedShard(f"{where}: column names repeat ({names}); {FIX}")
    columns = MdsColumns(tuple(names), tuple(encodings), tuple(sizes))
    key = _basename(entry.get("zip_data") if compression else entry.get("raw_data"), where)
    if key is None:
        raise MalformedShard(f"{where} names no data file; {FIX}")
    # A Streaming local cache keeps a compressed shard decompressed, under its raw_data
    # name: the index still says zstd, and the zip file is gone.
    raw = _basename(entry.get("raw_data"), where) if compression else None
    samples = entry["samples"]
    if type(samples) is not int or not 0 <= samples <= MAX_SAMPLES:
        raise MalformedShard(
            f"{where} says it holds {samples!r} samples; an MDS shard holds 0..{MAX_SAMPLES} "
            f"(its header counts them in 32 bits); {FIX}"
        )
    return columns, MdsShard(key=key, samples=samples, raw=raw)


def _basename(data: object, where: str) -> str | None:
    """The file a ``raw_data``/``zip_data`` entry names; None when it names none."""
    if not isinstance(data, dict) or not data.get("basename"):
        return None
    key = data["basename"]
    if not isinstance(key, str) or not _inside(key):
        raise MalformedShard(
            f"{where} names its file {key!r}, which is not a file name in the index's "
            f"directory (no '..', '/' at the start, URL, backslash or NUL); {FIX}"
        )
    return key


def image_encoding_problem(columns: MdsColumns, column: str | None) -> str | None:
    """Why the ``images`` transform cannot decode an MDS column; None when it can.

    The transform opens image files (JPEG, PNG, WebP). MDS's ``pil`` encoding is raw
    pixels behind a small header, and ``pkl``, ``ndarray`` and image lists are no image
    file either: accepted at publish, every read of such a version failed, and
    ``on_error=skip`` would have dropped every sample. ``column`` None: the transform's
    default, the only binary column.
    """
    schema = columns.schema()
    if column is None:
        binary = [f.name for f in schema if pa.types.is_binary(f.type)]
        if len(binary) != 1:
            return None  # the transform asks for column=NAME itself
        column = binary[0]
    if column not in columns.names:
        return None  # the transform names what is missing
    encoding = columns.encodings[columns.names.index(column)]
    if encoding in _IMAGE_FILES or not pa.types.is_binary(_arrow_type(encoding)):
        return None  # an image file; or no binary column, which the transform refuses
    pictures = [n for n, e in zip(columns.names, columns.encodings, strict=True)
                if e in ("jpeg", "png")]  # fmt: skip
    other = f" (this dataset's {', '.join(pictures)} {'is' if len(pictures) == 1 else 'are'})"
    return (
        f"images: column {column!r} has MDS encoding {encoding!r}, "
        + ("raw pixels behind MDS's own header, " if encoding == "pil" else "")
        + "not an image file the images transform decodes; it decodes MDS jpeg and png "
        f"columns (or bytes holding JPEG, PNG or WebP){other if pictures else ''}: pass "
        "column= one of those, or write the images with MDSWriter's jpeg or png encoding "
        "and publish again"
    )


def _inside(key: str) -> bool:
    """Whether ``key`` is a path below the index's directory, not out of it or elsewhere."""
    if not key or key.startswith("/") or "://" in key or "\\" in key or "\0" in key:
        return False
    return all(part not in ("", ".", "..") for part in key.split("/"))


def _column(
    values: list[memoryview], encoding: str, field: pa.Field, source: str, first: int
) -> pa.Array:
    try:
        if encoding in _SCALARS or _ndarray(encoding) is not None:
            dtype = np.dtype(_SCALARS.get(encoding) or encoding.split(":")[1]).newbyteorder("<")
            flat = np.frombuffer(b"".join(values), dtype)
            array: pa.Array = pa.array(flat.astype(dtype.newbyteorder("=")))
            if _ndarray(encoding) is not None:
                for dim in reversed(_ndarray(encoding)[1]):  # type: ignore[index]
                    array = pa.FixedSizeListArray.from_arrays(array, dim)
            return array.cast(field.type)
        if encoding in ("str_int", "str_float"):
            kind = int if encoding == "str_int" else float
            return pa.array([kind(bytes(v).decode()) for v in values], field.type)
        return binary_column(values, string=field.type == pa.string())
    except (ValueError, UnicodeDecodeError, pa.ArrowInvalid) as exc:
        raise MalformedShard(
            f"{source}: column {field.name!r} ({encoding}) of samples "
            f"{first}..{first + len(values) - 1} cannot be read ({exc}); {FIX}"
        ) from exc


def mds_source(
    data: bytes | memoryview, options: Mapping[str, str], source: str, batch_rows: int
) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int]:
    """The schema, row batches and sample count of one (decompressed) MDS shard file.

    ``options["columns"]`` is what publish recorded from ``index.json``.

    Raises:
        MalformedShard: offsets or sizes that do not fit the file, or a value that does
            not decode as its encoding; the message names the object and the samples.
    """
    if "columns" not in options:
        raise MalformedShard(
            f"{source}: the version records no MDS columns; publish the directory holding "
            "index.json with --format mds"
        )
    columns = MdsColumns.from_option(options["columns"], source)
    schema = columns.schema()
    view = memoryview(data)
    if len(view) < 8:
        raise MalformedShard(f"{source} is too short to be an MDS shard; {FIX}")
    count = int(np.frombuffer(view[:4], "<u4")[0])
    if 4 * (count + 2) > len(view):
        raise MalformedShard(f"{source}: header says {count} samples, more than the file holds")
    offsets = np.frombuffer(view[4 : 4 * (count + 2)], "<u4").astype(np.int64)
    if offsets[0] < 4 * (count + 2) or np.any(np.diff(offsets) < 0) or offsets[-1] > len(view):
        raise MalformedShard(f"{source}: sample offsets do not fit the file (damaged); {FIX}")
    variable = [i for i, size in enumerate(columns.sizes) if not size]

    def batches() -> Iterator[pa.RecordBatch]:
        for first in range(0, count, batch_rows):
            cells: list[list[memoryview]] = [[] for _ in columns.names]
            for i in range(first, min(first + batch_rows, count)):
                start, end = int(offsets[i]), int(offsets[i + 1])
                sizes = list(columns.sizes)
                head = start + 4 * len(variable)
                if variable:
                    for j, size in zip(
                        variable, np.frombuffer(view[start:head], "<u4"), strict=True
                    ):
                        sizes[j] = int(size)
                pos = head
                for j, size in enumerate(sizes):
                    cells[j].append(view[pos : pos + int(size or 0)])
                    pos += int(size or 0)
                if pos != end:
                    raise MalformedShard(
                        f"{source}: sample {i} is {end - start} bytes but its columns take "
                        f"{pos - start} (damaged, or not these columns); {FIX}"
                    )
            arrays = [
                _column(values, encoding, field, source, first)
                for values, encoding, field in zip(cells, columns.encodings, schema, strict=True)
            ]
            yield pa.RecordBatch.from_arrays(arrays, schema=schema)

    return schema, batches(), count
