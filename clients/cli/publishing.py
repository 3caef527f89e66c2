"""Commands on the registry: ``publish`` a version, list ``versions``."""

from __future__ import annotations

import json
from datetime import UTC
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from edgecache.cache.errors import ConfigFileError
from edgecache.clients.cli.app import app
from edgecache.clients.cli.context import (
    ConfigOption,
    ExitCode,
    JsonOption,
    Options,
    exit_with,
    reporting,
)
from edgecache.clients.cli.render import (
    Column,
    error,
    format_bytes,
    json_time,
    line,
    table,
    warning,
)

if TYPE_CHECKING:
    from edgecache.v1 import manifest_pb2 as pb


class Partitioning(StrEnum):
    """How key=value folders in the source's keys are read (cache.preprocess.partitions)."""

    HIVE = "hive"
    NONE = "none"


class Compression(StrEnum):
    """The chunk codecs a version may use (edgecache.cache.codec.COMPRESSIONS)."""

    BYTE_SPLIT_ZSTD = "byte-split-zstd"
    ZSTD = "zstd"
    NONE = "none"


RegistryOption = Annotated[
    str | None, typer.Option(help="Registry URL (s3://…, file://…; default: from --config).")
]


def _registry_url(registry: str | None, options: Options) -> str:
    """``--registry``, else the topology file's ``registry:``."""
    if registry:
        return registry
    try:
        return options.topology.registry
    except ConfigFileError as exc:
        if "no topology file" not in str(exc):
            raise
        raise ConfigFileError(
            "no registry: pass --registry URL (e.g. s3://bucket/_edgecache or "
            "file:///srv/registry), or a topology file whose registry: is used "
            "(--config FILE, $EDGECACHE_CONFIG or ./edgecache.yaml)"
        ) from None


def schema_lines(schema_bytes: bytes) -> list[str]:
    """``name: type`` per column of a manifest's schema, types as a person reads them."""
    import pyarrow as pa

    from edgecache.cache.preprocess.arrow_types import quote_name, type_label

    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    # Names quoted as params write them (select=, cast=): "a, b" is one column, not two.
    return [f"{_visible(quote_name(f.name))}: {type_label(f.type)}" for f in schema]


def schema_json(schema_bytes: bytes) -> list[dict[str, object]]:
    """The schema for ``--json``: name, Arrow type, nullable."""
    import pyarrow as pa

    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]


def _visible(value: str) -> str:
    """A recorded value as text, a control character (a tab) escaped, never printed raw."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in value)


def _codec(spec: pb.PreprocessSpec) -> tuple[str | None, int, int]:
    """The chunk codec's name, zstd level and chunk size, as the nodes read the spec.

    A spec the nodes would refuse is shown as recorded, its codec's name None if this
    edgecache does not know it.
    """
    from edgecache.cache.codec import COMPRESSIONS, CodecOptions
    from edgecache.cache.row_grid import DEFAULT_CHUNK_BYTES

    try:
        codec = CodecOptions.from_spec(spec)
    except ValueError:
        known = {kind: name for name, kind in COMPRESSIONS.items()}
        size = spec.chunk_bytes or DEFAULT_CHUNK_BYTES
        return known.get(spec.compression), spec.compression_level, size
    return codec.compression, codec.level, codec.chunk_bytes


def preparation_lines(manifest: pb.Manifest) -> list[str]:
    """How a version was prepared, in two lines of plain text (not markup).

    ``source URL (FORMAT; reader options)`` and ``transform T (params) · chunks
    CODEC-LEVEL, SIZE``: what tells ``iris@2`` from ``iris@3`` when their sources
    are read differently. Empty parts are left out (no reader options; the identity
    transform without params), and so are MDS's recorded columns (the schema shows
    them). A delimiter is named as ``--delimiter`` takes it (``tab``, ``semicolon``).
    """
    from edgecache.cache.preprocess import KIND_NAMES
    from edgecache.cache.preprocess.source_options import CSV_OPTIONS, DELIMITERS
    from edgecache.v1 import manifest_pb2 as pb

    spec = manifest.preprocess
    options = dict(spec.source_options)
    if manifest.source_format == pb.SOURCE_FORMAT_MDS:
        options.pop("columns", None)
    if options.get("null_values") == "":  # the default every CSV version records
        del options["null_values"]
    if "delimiter" in options:
        named = {char: name for name, char in DELIMITERS.items()}
        options["delimiter"] = named.get(options["delimiter"], options["delimiter"])
    order = [k for k in CSV_OPTIONS if k in options] + sorted(set(options) - set(CSV_OPTIONS))
    read_as = ", ".join(f"{k}={_visible(options[k])}" for k in order)
    kind = KIND_NAMES.get(manifest.source_format, "")
    how = "; ".join(part for part in (kind, read_as) if part)
    source = f"source {_visible(manifest.source_url)}" + (f" ({how})" if how else "")

    parts = []
    transform = spec.transform or "identity"
    if transform != "identity" or spec.params:
        params = ", ".join(f"{k}={_visible(v)}" for k, v in sorted(spec.params.items()))
        parts.append(f"transform {transform}" + (f" ({params})" if params else ""))
    compression, level, chunk_bytes = _codec(spec)
    if compression is None:
        codec = f"compression {spec.compression} (unknown to this edgecache)"
    elif compression == "none":
        codec = "none"
    else:
        codec = f"{compression}-{level}" if level >= 0 else f"{compression} level {level}"
    parts.append(f"chunks {codec}, {format_bytes(chunk_bytes)}")
    return [source, " · ".join(parts)]


def preparation_json(manifest: pb.Manifest) -> dict[str, object]:
    """How a version was prepared, for ``--json``: what republishing it the same way takes.

    ``format`` is the name ``--format`` takes (``csv``), None where the manifest has
    none; ``source_options`` and ``params`` are as recorded (a tab delimiter as JSON
    escapes a tab); ``compression``, ``compression_level`` and ``chunk_bytes`` are
    what the nodes encode with (``compression`` None: a codec this edgecache does
    not know).
    """
    from edgecache.cache.preprocess import FORMATS

    spec = manifest.preprocess
    compression, level, chunk_bytes = _codec(spec)
    return {
        "source_url": manifest.source_url,
        # The first name of each format in FORMATS is the one --format's help gives.
        "format": next((n for n, kind in FORMATS.items() if kind == manifest.source_format), None),
        "source_options": dict(sorted(spec.source_options.items())),
        "transform": spec.transform or "identity",
        "params": dict(sorted(spec.params.items())),
        "compression": compression,
        "compression_level": level,
        "chunk_bytes": chunk_bytes,
    }


CSV_HELP = "CSV reader options"


def _params(given: list[str]) -> dict[str, str]:
    """``--param KEY=VALUE`` options as a dict; a bare or repeated key is refused, naming it.

    A repeated key used to keep the last value silently (or fail with a message that did
    not say which); one value per key is what the transform records.
    """
    params: dict[str, str] = {}
    for each in given:
        key, eq, value = each.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--param {each!r}: expected KEY=VALUE, e.g. --param size=224")
        if key in params:
            raise ValueError(
                f"--param {key} is given more than once ({params[key]!r} and {value!r}); give "
                "it once: a param of several values takes them in one (select=a,b or "
                "cast=a=int8,b=float16)"
            )
        params[key] = value
    return params


def _chunk_size(text: str) -> int:
    """``--chunk-size`` in bytes, in the range the nodes encode."""
    from edgecache.cache.codec import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
    from edgecache.cache.units import parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise ValueError(f"--chunk-size: {exc}") from None
    if not MIN_CHUNK_BYTES <= size <= MAX_CHUNK_BYTES:
        raise ValueError(
            f"--chunk-size {text} is {format_bytes(size)}; give 4KiB..256MiB (default 4MiB)"
        )
    return size


@app.command()
def publish(
    source_url: Annotated[
        str,
        typer.Argument(
            metavar="SOURCE_URL",
            help="Prefix of raw shards: s3://…, file://…, or a local directory; or one "
            "object (a version of one shard: one .mds file too; an MDS index.json is its "
            "whole directory); or a pattern in the last part, …/data/train-*.parquet, which "
            "selects as --include does.",
        ),
    ],
    dataset: Annotated[str, typer.Option(help="Dataset name.")],
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="parquet, jsonl, csv, arrow, webdataset or mds (default: from the names).",
        ),
    ] = None,
    transform: Annotated[
        str, typer.Option(help="Transform: identity, columns, images, tokens or a plugin.")
    ] = "identity",
    param: Annotated[
        list[str] | None,
        typer.Option(
            help="Transform parameter KEY=VALUE (repeatable), e.g. select=a,b or size=224 "
            "(see docs/preprocessing.md)."
        ),
    ] = None,
    header: Annotated[
        bool | None,
        typer.Option(
            "--header/--no-header",
            help="CSV: the first row (after --skip-rows) is / is not a header (default: a "
            "header unless it holds numbers, which is refused).",
            rich_help_panel=CSV_HELP,
        ),
    ] = None,
    column_names: Annotated[
        str | None,
        typer.Option(
            help="CSV: column names a,b,c (the first row is then data, unless --header).",
            rich_help_panel=CSV_HELP,
        ),
    ] = None,
    delimiter: Annotated[
        str | None,
        typer.Option(
            help="CSV: one character, or comma, tab, space, semicolon, pipe, whitespace "
            "(runs of blanks) (default: comma; tab when every object is .tsv).",
            rich_help_panel=CSV_HELP,
        ),
    ] = None,
    skip_rows: Annotated[
        int | None,
        typer.Option(
            min=0, help="CSV: rows to drop before the header or data.", rich_help_panel=CSV_HELP
        ),
    ] = None,
    column_types: Annotated[
        str | None,
        typer.Option(
            help="CSV and JSON Lines: Arrow types per column, a=int32,b=string (default: "
            "inferred; JSON integers past int64 need one, e.g. id=uint64).",
            rich_help_panel=CSV_HELP,
        ),
    ] = None,
    null_values: Annotated[
        str | None,
        typer.Option(
            help="CSV: cell texts that read as null besides an empty cell, NA,N/A (default: "
            "none; NA, null and nan are then text, or NaN in a float column).",
            rich_help_panel=CSV_HELP,
        ),
    ] = None,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            help="Publish only the objects whose key (path under the source prefix) "
            "matches this pattern (repeatable: any of them; fnmatch: * and ? match / too), "
            "e.g. --include 'data/train-*'.",
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            "--exclude",
            help="Leave out the objects whose key matches this pattern (repeatable), e.g. "
            "--exclude README.md --exclude '*.json'.",
        ),
    ] = None,
    partitioning: Annotated[
        Partitioning,
        typer.Option(
            help="hive: key=value folders in the keys (year=2024/month=02/…, as Spark and "
            "pyarrow write them) become columns after the data's own; none: folders are "
            "only where the objects are.",
        ),
    ] = Partitioning.HIVE,
    compression: Annotated[
        Compression,
        typer.Option(
            help="Chunk codec: byte-split-zstd (fixed-width values' bytes split into streams "
            "before zstd: the smallest and fastest for numbers and token ids), zstd (the "
            "Arrow stream as it is), or none (zero-copy reads, the most bytes).",
        ),
    ] = Compression.BYTE_SPLIT_ZSTD,
    level: Annotated[
        int | None,
        typer.Option(
            help="zstd level (-7..22 but 0; default 1); not with --compression none.",
            show_default=False,
            # The parser's range check names --level and its range, as the other options'
            # do; past it, the codec's own check said "zstd level must be in …" alone.
            min=-7,
            max=22,
        ),
    ] = None,
    chunk_size: Annotated[
        str | None,
        typer.Option(
            "--chunk-size",
            help="Decoded bytes per stored chunk, e.g. 512KiB (4KiB..256MiB; default 4MiB). "
            "A reader's shuffle window is a chunk: a small version mixes better with "
            "smaller chunks (at a little compression), see docs/dataset.md.",
            show_default=False,
        ),
    ] = None,
    if_changed: Annotated[
        bool,
        typer.Option(
            "--if-changed",
            help="If a version has this very content (same digest), print it (the "
            "newest such) instead of publishing a copy.",
        ),
    ] = False,
    registry: RegistryOption = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Snapshot a prefix as the next immutable version of a dataset; print its schema.

    Objects may be gzip/zstd/bz2/xz-compressed (part-0.csv.gz, docs.jsonl.zst).
    Hive-style key=value folders (year=2024/month=02/part-0.parquet) become columns.
    --include/--exclude choose objects under the prefix by pattern (a split, no README).

    Exit codes: 0 published (or, with --if-changed, the same content found);
    2 bad input (no objects, mixed formats, an unreadable object, a --level out of
    range or with --compression none, a --chunk-size out of range); 1 failed (a
    registry or source that cannot be reached, or a registry that cannot be
    written, is named, with what to do; with --if-changed, an earlier version
    whose manifest cannot be read to compare: nothing is published).
    """
    from edgecache.cache.codec import COMPRESSIONS
    from edgecache.cache.manifest import preprocess_spec
    from edgecache.cache.preprocess import format_from_name
    from edgecache.cache.preprocess.nulls import NullCount, null_warnings
    from edgecache.cache.preprocess.partitions import partition_fields
    from edgecache.cache.registry import Dropped, Registry, dropped_text, unread_text
    from edgecache.cache.row_grid import DEFAULT_CHUNK_BYTES

    with reporting():
        if compression is Compression.NONE and level is not None:
            # It used to be taken and ignored, yet recorded: another version of the
            # same chunks.
            raise ValueError(
                f"--level {level} sets the zstd level, but --compression none compresses "
                "nothing: drop --level, or pick --compression zstd or byte-split-zstd"
            )
        if level == 0:
            # zstd reads 0 as its default level (3), and the version's spec cannot record a
            # 0 (protobuf's unset): it was published and recorded as level 1.
            raise ValueError(
                "--level 0 is zstd's way of asking for its default level, 3: give --level 3 "
                "(or leave --level out for edgecache's default, 1)"
            )
        params = _params(param or [])
        spec = preprocess_spec(
            transform=transform,
            params=params,
            compression=COMPRESSIONS[compression.value],
            compression_level=1 if level is None else level,
            chunk_bytes=DEFAULT_CHUNK_BYTES if chunk_size is None else _chunk_size(chunk_size),
        )
        reader = {
            "header": None if header is None else str(header).lower(),
            "column_names": column_names,
            "delimiter": delimiter,
            "skip_rows": None if skip_rows is None else str(skip_rows),
            "column_types": column_types,
            "null_values": null_values,
        }
        spec.source_options.update({k: v for k, v in reader.items() if v is not None})
        if partitioning is Partitioning.NONE:  # hive, the default, is not recorded as given
            spec.source_options["partitioning"] = partitioning.value
        source_format = format_from_name(fmt) if fmt else None

        nulls: list[NullCount] = []
        dropped: list[Dropped] = []
        found: list[str] = []  # warnings, said after the version line

        async def go(reg: Registry) -> tuple[pb.Manifest, pb.Manifest | None, bool, int]:
            before = await reg.versions(dataset)
            done = await reg.publish(
                source_url,
                dataset,
                fmt=source_format,
                spec=spec,
                if_changed=if_changed,
                include=include or (),
                exclude=exclude or (),
                nulls=nulls,
                dropped=dropped,
            )
            if done.version in before:  # --if-changed found it unchanged
                return done, None, True, max(before)
            # Any earlier version, not the newest alone: tok@1's content published
            # again after tok@2 is still a copy. The version is written now: this is
            # advice, and nothing here may fail the command (a retrying script would
            # publish a copy).
            try:
                skipped: list[int] = []
                same = await reg.same_content(dataset, done.digest, before, skipped)
                if skipped:
                    found.append(unread_text(dataset, skipped))
            except Exception as exc:  # noqa: BLE001 - the version is written; a warning
                same = None
                found.append(f"could not compare with earlier versions' content: {exc}")
            return done, same, False, done.version

        manifest, same, reused, newest = Registry.run(_registry_url(registry, Options(config)), go)
    name = f"{manifest.dataset}@{manifest.version}"
    rows = sum(s.row_count for s in manifest.shards)
    folders = {f.name for f in partition_fields(manifest.preprocess.source_options)}
    own = [str(f["name"]) for f in schema_json(manifest.arrow_schema) if f["name"] not in folders]
    # A select= of the data's columns (no partition's), under the publish's own transform.
    spec_given = manifest.preprocess
    found[:0] = null_warnings(nulls, own, spec_given.transform, dict(spec_given.params))
    if dropped:
        found.insert(0, dropped_text(dropped, rows))
    if same is not None and not reused:
        found.append(
            f"{name} has the same content as {same.dataset}@{same.version} (same digest): "
            "nothing changed at the source; pass --if-changed to reuse the existing version"
        )
    if reused and newest > manifest.version:
        found.append(
            f"{name} has this content, but {manifest.dataset}@{newest} is newer (other "
            f"content), and {manifest.dataset} (or @latest) resolves to it: nothing was "
            f"published and latest stays; read {name} to train on this content"
        )
    if as_json:
        print(
            json.dumps(
                {
                    # "version" is name@N, what warm and EdgeDataset take (scripts pass it
                    # on as is); "number" is N alone, as versions --json gives it.
                    "version": name,
                    "dataset": manifest.dataset,
                    "number": manifest.version,
                    "digest": manifest.digest,
                    "shards": len(manifest.shards),
                    "rows": rows,
                    "schema": schema_json(manifest.arrow_schema),
                    "reused": reused,
                    "same_content_as": None if same is None else f"{same.dataset}@{same.version}",
                    **preparation_json(manifest),
                    "nulls": [
                        {"column": n.column, "type": n.kind, "object": n.url, "count": n.count}
                        for n in nulls
                    ],
                    "dropped": [
                        {"object": d.url, "count": d.samples, "samples": list(d.notes)}
                        for d in dropped
                    ],
                    "warnings": found,
                }
            )
        )
        return
    count = len(manifest.shards)
    summary = (
        f"{name}  {manifest.digest}  ({count} shard{'' if count == 1 else 's'}, "
        f"{rows:,} row{'' if rows == 1 else 's'})"
    )
    line(escape(summary + (": unchanged" if reused else "")))
    for each in [*preparation_lines(manifest), *schema_lines(manifest.arrow_schema)]:
        line("  " + escape(each))
    for text in found:  # the same on stdout's JSON, as "warnings", with --json
        warning(text)


@app.command()
def versions(
    dataset: Annotated[
        str,
        typer.Argument(
            help="Dataset name (all its versions), or NAME@N / NAME@latest (one).",
            metavar="NAME[@N]",
        ),
    ],
    registry: RegistryOption = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """List a dataset's published versions; NAME@N or NAME@latest shows that one alone.

    Exit codes: 0 listed; 2 bad input (no such dataset, a registry that does not
    exist, is a file or holds nothing, an unsupported URL scheme); 1 failed (the
    registry could not be reached or read, or a version's manifest could not:
    the others are listed, and it is named with why).
    """
    from edgecache.cache.errors import EdgeCacheError, ManifestError
    from edgecache.cache.manifest import summarize
    from edgecache.cache.names import parse_spec
    from edgecache.cache.registry import Registry

    damaged: list[tuple[int, str]] = []  # (version, why its manifest cannot be read)
    with reporting():
        url = _registry_url(registry, Options(config))
        # tok@1 used to be refused as an invalid dataset name: it names one version.
        spec = parse_spec(dataset)
        one = "@" in dataset
        dataset = spec.dataset

        async def listing(reg: Registry) -> tuple[str, list[tuple[pb.DatasetVersion, pb.Manifest]]]:
            if one:
                number = spec.version or await reg.latest(dataset)
                try:
                    manifest = await reg.manifest(dataset, number)
                except ManifestError as exc:  # the registry's content: 1, as for a listing
                    damaged.append((number, str(exc)))
                    return reg.url, []
                return reg.url, [(summarize(manifest), manifest)]
            # One damaged manifest ended the listing with nothing shown, though publish's
            # own warning about it sends the user here to look.
            manifests = []
            for number in await reg.published(dataset):
                try:
                    manifests.append(await reg.manifest(dataset, number))
                except EdgeCacheError as exc:
                    damaged.append((number, str(exc)))
            return reg.url, [(summarize(m), m) for m in manifests]

        where, found = Registry.run(url, listing)  # where: as its errors name it
    for number, why in damaged:
        error(f"{dataset}@{number}: its manifest cannot be read: {why}")
    if as_json:
        listed: list[dict[str, Any]] = [
            {
                "version": v.version,
                "digest": v.digest,
                "shards": v.shard_count,
                "rows": v.row_count,
                "source_bytes": v.source_bytes,
                "created_at": json_time(v.created_at.ToDatetime(tzinfo=UTC)),
                "schema": schema_json(m.arrow_schema),
                **preparation_json(m),
            }
            for v, m in found
        ]
        listed += [{"version": n, "error": why} for n, why in damaged]
        print(json.dumps(sorted(listed, key=lambda entry: entry["version"])))
    elif found or not one:
        table(
            f"{dataset}@{found[0][0].version} in {where}" if one else f"{dataset} in {where}",
            [
                Column("version", ident=True, right=True),
                Column("digest", ident=True),
                Column("shards", right=True),
                Column("rows", right=True),
                Column("source", right=True),
                Column("created", ident=True),
                Column("prepared", wrap=True),
                Column("schema"),
            ],
            [
                [
                    str(v.version),
                    v.digest,
                    str(v.shard_count),
                    f"{v.row_count:,}",
                    format_bytes(v.source_bytes),
                    v.created_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"),
                    "\n".join(escape(each) for each in preparation_lines(m)),
                    "\n".join(escape(each) for each in schema_lines(m.arrow_schema)),
                ]
                for v, m in found
            ],
        )
    if damaged:  # the others are listed; the damaged ones were said above
        raise exit_with(ExitCode.FAILED)
