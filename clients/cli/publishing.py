"""Commands on the registry: ``publish`` a version, list ``versions``."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from edgecache.clients.cli.app import app
from edgecache.clients.cli.context import ConfigOption, JsonOption, Options, reporting
from edgecache.clients.cli.render import console, format_bytes

RegistryOption = Annotated[
    str | None, typer.Option(help="Registry URL (s3://…, file://…) [from --config].")
]


def _registry_url(registry: str | None, options: Options) -> str:
    return registry or options.topology.registry


@app.command()
def publish(
    source_url: Annotated[str, typer.Argument(help="Prefix of raw shards (s3://…, file://…).")],
    dataset: Annotated[str, typer.Option(help="Dataset name.")],
    fmt: Annotated[
        str | None, typer.Option("--format", help="parquet, jsonl, csv or arrow [from names].")
    ] = None,
    transform: Annotated[str, typer.Option(help="Transform name.")] = "identity",
    param: Annotated[
        list[str] | None, typer.Option(help="Transform parameter KEY=VALUE (repeatable).")
    ] = None,
    compression: Annotated[str, typer.Option(help="zstd or none.")] = "zstd",
    level: Annotated[int, typer.Option(help="zstd level.")] = 1,
    registry: RegistryOption = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Snapshot a prefix as the next immutable version of a dataset."""
    from edgecache.cache.manifest import preprocess_spec
    from edgecache.cache.preprocess import format_from_name
    from edgecache.cache.registry import Registry
    from edgecache.v1 import manifest_pb2 as pb

    with reporting():
        params = dict(p.split("=", 1) for p in (param or []) if "=" in p)
        if len(params) != len(param or []):
            raise ValueError("--param takes KEY=VALUE")
        spec = preprocess_spec(
            transform=transform,
            params=params,
            compression=pb.COMPRESSION_NONE if compression == "none" else pb.COMPRESSION_ZSTD,
            compression_level=level,
        )
        source_format = format_from_name(fmt) if fmt else None
        manifest = Registry.run(
            _registry_url(registry, Options(config)),
            lambda reg: reg.publish(source_url, dataset, fmt=source_format, spec=spec),
        )
    if as_json:
        print(
            json.dumps(
                {
                    "version": f"{manifest.dataset}@{manifest.version}",
                    "digest": manifest.digest,
                    "shards": len(manifest.shards),
                }
            )
        )
    else:
        console.print(
            f"{manifest.dataset}@{manifest.version}  {manifest.digest}  "
            f"({len(manifest.shards)} shards)"
        )


@app.command()
def versions(
    dataset: Annotated[str, typer.Argument(help="Dataset name.")],
    registry: RegistryOption = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """List a dataset's published versions."""
    from edgecache.cache.manifest import summarize
    from edgecache.cache.registry import Registry
    from edgecache.v1 import manifest_pb2 as pb

    with reporting():
        url = _registry_url(registry, Options(config))

        async def listing(reg: Registry) -> list[pb.DatasetVersion]:
            return [summarize(await reg.manifest(dataset, n)) for n in await reg.versions(dataset)]

        rows = Registry.run(url, listing)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "version": v.version,
                        "digest": v.digest,
                        "shards": v.shard_count,
                        "rows": v.row_count,
                        "source_bytes": v.source_bytes,
                        "created_at": v.created_at.ToJsonString(),
                    }
                    for v in rows
                ]
            )
        )
        return
    table = Table(title=f"{dataset} in {url}")
    for column in ("version", "digest", "shards", "rows", "source", "created"):
        table.add_column(
            column, justify="right" if column in ("version", "shards", "rows", "source") else "left"
        )
    for v in rows:
        table.add_row(
            str(v.version),
            v.digest[:19] + "…",
            str(v.shard_count),
            f"{v.row_count:,}",
            format_bytes(v.source_bytes),
            v.created_at.ToJsonString(),
        )
    console.print(table if rows else f"{dataset} has no versions in {url}")
