"""Commands on edge nodes: ``serve`` one, and ``status``, ``evict``, ``doctor``, ``healthcheck``."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from edgecache.clients.cli.app import app
from edgecache.clients.cli.context import (
    ConfigOption,
    ExitCode,
    JsonOption,
    LogLevel,
    Options,
    TokenOption,
    configure_logging,
    exit_with,
    reporting,
)
from edgecache.clients.cli.render import (
    Column,
    console,
    err_console,
    format_bytes,
    json_ms,
    json_time,
    line,
    table,
)
from edgecache.v1 import edge_pb2

# The settings without a flag, for serve's --help; tests check it against NodeConfig
# (edge/config.py), which holds their defaults and bounds. Lines fit 80 columns, and no
# "[" may open Rich markup.
_SERVE_EPILOG = """\
Every setting can also be set as an EDGECACHE_<NAME> environment variable
(EDGECACHE_STAGING_RATE=200MB/s) or as a key of the --config YAML file
(staging_rate: 200MB/s). Flags win over the environment, and it over the
file. These settings have no flag (default in parentheses):

  staging_concurrency  shards a Stage fetches at once, 1-64 (4)
  fetch_concurrency    read-through origin fetches at once, 1-64; more
                       misses wait (4)
  fetch_memory         memory shard fetches may hold at once, at least
                       64MiB; more wait (half the memory this process
                       may use)
  max_request_bytes    larger requests are refused unparsed, 1KiB-64MiB
                       (1MiB)
  max_streams          concurrent calls (health and Status aside, manifests
                       apart), 1-65536; beyond them RESOURCE_EXHAUSTED (256)
  preprocess_threads   threads that parse, transform and compress shards,
                       1-256 (the cores this process may run on)
  grace_seconds        SIGTERM drain time for streams, in seconds (10)
  sync                 fsync LMDB commits: true or false (true)
  peer_token_file      bearer token for reading from peer nodes (the read
                       token; never the admin token)
  peer_tls_ca          CA of grpcs:// peers' certificates (the system's
                       roots)
  origins              URL prefixes versions may be read from, comma-
                       separated; others are refused (every s3:// bucket,
                       and the registry's own scheme)
"""


@app.command(epilog=_SERVE_EPILOG)
def serve(
    region: Annotated[str | None, typer.Option(help="Region this node serves.")] = None,
    cache_dir: Annotated[str | None, typer.Option(help="LMDB cache directory.")] = None,
    listen: Annotated[str | None, typer.Option(help="gRPC HOST:PORT [127.0.0.1:7070].")] = None,
    registry: Annotated[str | None, typer.Option(help="Registry URL (s3://…, file://…).")] = None,
    capacity: Annotated[
        str | None,
        typer.Option(
            help="Cache capacity, e.g. 500GiB (default: the size the cache had, else 80% "
            "of the disk's free space)."
        ),
    ] = None,
    metrics_listen: Annotated[str | None, typer.Option(help="Prometheus HOST:PORT.")] = None,
    probe_listen: Annotated[
        str | None, typer.Option(help="Plaintext health-only HOST:PORT for probes.")
    ] = None,
    tls_cert: Annotated[str | None, typer.Option(help="Server certificate (PEM).")] = None,
    tls_key: Annotated[str | None, typer.Option(help="Server key (PEM).")] = None,
    tls_client_ca: Annotated[
        str | None, typer.Option(help="CA for client certificates (mutual TLS).")
    ] = None,
    token_file: Annotated[
        str | None,
        typer.Option(help="Admin bearer token: required for Stage, Evict, Pin, Diagnose."),
    ] = None,
    read_token_file: Annotated[
        str | None, typer.Option(help="Bearer token required for reads.")
    ] = None,
    staging_rate: Annotated[
        str | None,
        typer.Option(
            help="Cap on staging's origin rate, e.g. 200MB/s; at least 1B/s (default: no cap)."
        ),
    ] = None,
    node_id: Annotated[
        str | None, typer.Option(help="Node name in metrics and Status (default: hostname:port).")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="YAML file of settings, keys as the flags' names with _ (see below)."),
    ] = None,
    log_level: Annotated[
        LogLevel | None,
        typer.Option(
            case_sensitive=False,
            show_default=False,
            help="DEBUG, INFO, WARNING or ERROR (any case) [INFO].",
        ),
    ] = None,
) -> None:
    """Run an edge node: serve, fetch, preprocess and cache shards for one region.

    Runs until SIGTERM or SIGINT (then drains). Exit codes: 0 stopped cleanly;
    1 the node failed; 2 bad settings (an option, the --config file, an address
    in use).
    """
    import asyncio

    from edgecache.edge.config import load_node_config
    from edgecache.edge.server import serve_forever

    # The flag's level (or INFO) until the settings are read: their own warnings (an
    # EDGECACHE_* variable no setting has) are logged in the same form.
    configure_logging(log_level or LogLevel.INFO)
    # Paths come as text (typer made an empty --cache-dir "" into Path('.'): the cache in
    # the working directory); load_node_config refuses empty ones and makes them Paths.
    flags = {
        "region": region,
        "cache_dir": cache_dir,
        "listen": listen,
        "registry": registry,
        "capacity": capacity,
        "metrics_listen": metrics_listen,
        "probe_listen": probe_listen,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "tls_client_ca": tls_client_ca,
        "token_file": token_file,
        "read_token_file": read_token_file,
        "staging_rate": staging_rate,
        "node_id": node_id,
        "log_level": log_level.value if log_level is not None else None,
    }
    with reporting():
        settings = load_node_config(config, flags)
        configure_logging(LogLevel(settings.log_level))
        asyncio.run(serve_forever(settings))


@app.command()
def status(
    config: ConfigOption = None, token_file: TokenOption = None, as_json: JsonOption = False
) -> None:
    """Regions × nodes: health, RTT from here, capacity, used, versions, hit ratio.

    A node that reads another registry than the topology's is flagged (warm
    refuses to stage on it), and so is one whose state makes staging there
    fail (its cache over its capacity, a node id another node of its region
    reports, a copy of other content under a version's name than the
    registry's, which it refuses to serve), without changing the exit code.
    Exit codes: 0
    every node answered; 1 a node is down (listed); 2 bad input (the topology
    file, or a token a node refused or needs: --token-file; a node this
    command cannot reach in TLS as it is set up: a CA it does not trust, an
    out-of-date certificate, grpcs:// to a node without TLS; the error says
    what to set).
    """
    from edgecache.cache.registry_match import RegistryMatch, check_registry
    from edgecache.clients import ops
    from edgecache.clients.ops import gather_status

    options = Options(config, token_file)
    with reporting():
        topology = options.topology
        reports = gather_status(topology, token=options.token)
    # Each answering node's registry against the topology's: a node set up with another
    # one answers health and status like the others, and fails every stage NOT_FOUND.
    registries = {
        r.address: check_registry(r.address, topology.registry, r.status.registry)
        for r in reports
        if r.status is not None
    }
    # What makes staging or reads there fail (exit 0 still), the registry's digests
    # included: a copy of other content under a version's name is refused to readers.
    digests = ops.registry_digests(topology.registry, reports)
    problems = ops.state_problems(reports, digests, topology.registry)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "region": r.region,
                        "node": r.address,
                        "node_id": r.status.node_id if r.status else None,
                        "problems": problems.get(r.address, []),
                        "healthy": r.healthy,
                        # Refused this command as it is set up (a token; TLS: tls_refused),
                        # which no retry mends: exit 2.
                        "refused": r.refused,
                        "tls_refused": r.tls_refused,
                        "rtt_ms": None if r.status is None else json_ms(r.rtt_ms),
                        "error": r.error or None,  # null when up, as evict's
                        "capacity_bytes": r.status.capacity_bytes if r.status else None,
                        "used_bytes": r.status.used_bytes if r.status else None,
                        "disk_full": r.status.disk_full if r.status else None,
                        "disk_free_bytes": r.status.disk_free_bytes if r.status else None,
                        "hits": r.status.hits if r.status else None,
                        "misses": r.status.misses if r.status else None,
                        "bytes_served": r.status.bytes_served if r.status else None,
                        # The registry the node reads (null: it did not say, or is down),
                        # and how it compares with the topology's: same, differs,
                        # path_differs (a file:// path: maybe one folder mounted apart),
                        # unknown (a node older than the field).
                        "registry": r.status.registry or None if r.status else None,
                        "registry_match": registries[r.address].match.value if r.status else None,
                        "versions": [
                            {
                                "version": f"{v.dataset}@{v.version}",
                                "shards": v.shard_count,
                                "total_shards": v.total_shards or None,
                                "pinned_until": json_time(v.pinned_until.ToDatetime(tzinfo=UTC))
                                if v.HasField("pinned_until")
                                else None,
                                # False for a pin that has run out: it protects nothing.
                                "pinned": v.HasField("pinned_until")
                                and v.pinned_until.ToDatetime(tzinfo=UTC) > datetime.now(UTC),
                            }
                            for v in (r.status.versions if r.status else [])
                        ],
                    }
                    for r in reports
                ]
            )
        )
    else:
        rows = []
        for r in reports:
            if r.status is None:
                health = (
                    "[yellow]TLS refused[/yellow]"
                    if r.tls_refused
                    else "[yellow]refused the token[/yellow]"
                    if r.refused
                    else "[red]down[/red]"
                )
                rows.append([r.region, r.address, health, "", "", "", "", ""])
                continue
            s = r.status
            lookups = s.hits + s.misses
            match = registries[r.address].match
            rows.append(
                [
                    r.region,
                    r.address,
                    ("[green]serving[/green]" if r.healthy else "[yellow]draining[/yellow]")
                    + (
                        "\n[red]other registry[/red]"
                        if match is RegistryMatch.DIFFERS
                        else "\n[yellow]registry path differs[/yellow]"
                        if match is RegistryMatch.PATH_DIFFERS
                        else ""
                    ),
                    f"{r.rtt_ms:.2f} ms",
                    f"{format_bytes(s.used_bytes)} / {format_bytes(s.capacity_bytes)}"
                    + (
                        f"\n[red]disk full ({format_bytes(s.disk_free_bytes)} free)[/red]"
                        if s.disk_full
                        else ""
                    ),
                    "\n".join(_resident(v) for v in s.versions) or "—",
                    f"{s.hits / lookups:.0%}" if lookups else "—",
                    format_bytes(s.bytes_served),
                ]
            )
        table(
            "edge nodes",
            [
                Column("region", ident=True),
                Column("node", ident=True),
                Column("health"),
                Column("RTT", right=True),
                Column("used / capacity", right=True),
                Column("versions (shards, pin)", ident=True),
                Column("hit ratio", right=True),
                Column("served", right=True),
            ],
            rows,
        )
        for r in reports:
            if r.refused:
                line(
                    # The error ends with the advice (which token, passed how): said once.
                    f"[yellow]{r.region} {r.address} {r.refusal}:[/yellow] {r.error}",
                    to_stderr=True,
                )
                continue
            if r.status is None:
                # An answer with a status (a damaged cache's DATA_LOSS) says what to do.
                unreached = r.error.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
                advice = "; check that it runs and that this host reaches it (edgecache doctor)"
                line(
                    f"[red]{r.region} {r.address} is down:[/red] {r.error}"
                    + (advice if unreached else ""),
                    to_stderr=True,
                )
                continue
            check = registries[r.address]
            if check.match is RegistryMatch.DIFFERS:
                # Not a failure of status (the node is up): warm refuses to stage on it,
                # and doctor fails it.
                line(
                    f"[red]{r.region}: another registry:[/red] {escape(check.message())}",
                    to_stderr=True,
                )
            elif check.match is RegistryMatch.PATH_DIFFERS:
                line(
                    f"[yellow]{r.region}: the registry's path differs:[/yellow] "
                    f"{escape(check.message())}",
                    to_stderr=True,
                )
            for problem in problems.get(r.address, []):
                line(f"[red]{r.region} {r.address}:[/red] {escape(problem)}", to_stderr=True)
            if r.status.disk_full:
                line(
                    f"[red]{r.region} {r.address}: its cache's disk is full[/red] "
                    f"({format_bytes(r.status.disk_free_bytes)} free): staging fails until "
                    "there is room; free space on its volume or evict a version (edgecache "
                    "evict NAME@N)",
                    to_stderr=True,
                )
    if digests is None:  # not a failure of status: its nodes' table stands
        unchecked = ops.copies_not_checked(topology.registry, "the nodes'")
        line(
            f"[yellow]note:[/yellow] {escape(unchecked)} (edgecache versions NAME says why)",
            to_stderr=True,
        )
    if any(r.status is None and not r.refused for r in reports):
        raise exit_with(ExitCode.FAILED)
    if any(r.refused for r in reports):
        raise exit_with(ExitCode.BAD_INPUT)  # a token or TLS to set, not a node to wait for


def _ms_rounded(figures: dict[str, object]) -> dict[str, object]:
    """A doctor check for ``--json``: its milliseconds (``rtt_ms``, ``jitter_ms``) as status's."""
    return {
        key: json_ms(value) if key.endswith("_ms") and isinstance(value, float) else value
        for key, value in figures.items()
    }


def _resident(v: edge_pb2.ResidentVersion) -> str:
    """``name@N (held/total shards, pinned until …)``."""
    held = f"{v.shard_count}/{v.total_shards}" if v.total_shards else str(v.shard_count)
    pin = ""
    if v.HasField("pinned_until"):
        until = v.pinned_until.ToDatetime(tzinfo=UTC)
        # A pin that has run out protects nothing (the LRU may evict the version): say so.
        state = "pinned until" if until > datetime.now(UTC) else "pin expired"
        pin = f", {state} {until:%Y-%m-%d %H:%M}"
    return f"{v.dataset}@{v.version} ({held}{pin})"


@app.command()
def evict(
    spec: Annotated[str, typer.Argument(help="NAME@N", metavar="NAME@N")],
    region: Annotated[str | None, typer.Option(help="Only this region.")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Evict even a version pinned for a scheduled job.")
    ] = False,
    config: ConfigOption = None,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Drop a version from the nodes of a region (or all regions).

    Refuses a version pinned for a scheduled job (it names the job) unless
    --force. Exit codes: 0 evicted (or nothing held); 2 bad input (an unknown
    version or region, a pinned version — also one pinned while this ran —, a
    token the nodes refuse); 1 a node failed.
    """
    from edgecache.clients import ops

    options = Options(config, token_file)
    with reporting():
        results = ops.evict(
            options.topology,
            spec,
            region=region,
            token=options.token,
            force=force,
            flags=options.flags(),
            config_flag=options.flags(token=False),
        )
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "region": r.region,
                        "node": r.node,
                        "bytes_freed": r.bytes_freed,
                        "error": r.error or None,
                        "refused": r.refused,
                        "pinned": r.pinned,
                    }
                    for r in results
                ]
            )
        )
    elif results and not any(r.bytes_freed or r.error for r in results):
        where = ", ".join(sorted({r.region for r in results}))
        line(f"nothing to evict: no node of {where} holds {spec}")
    else:
        for result in results:
            if result.error:
                err_console.print(f"[red]{result.region} {result.node}: {result.error}[/red]")
            else:
                # "freed 0 B" read as an eviction that went wrong; the node held nothing.
                freed = (
                    f"freed {format_bytes(result.bytes_freed)}"
                    if result.bytes_freed
                    else f"freed nothing (no shard of {spec} there)"
                )
                console.print(f"{result.region} {result.node}: {freed}")
    failed = [result for result in results if result.error]
    if failed:  # credentials refused, or a pin placed since: bad input, as a pin found first
        refused = all(result.refused or result.pinned for result in failed)
        raise exit_with(ExitCode.BAD_INPUT if refused else ExitCode.FAILED)


@app.command()
def doctor(
    config: ConfigOption = None,
    region: Annotated[str | None, typer.Option(help="The region this host is in.")] = None,
    pings: Annotated[int, typer.Option(min=2, max=200, help="Health pings per node.")] = 20,
    seconds: Annotated[
        float, typer.Option(min=0.1, max=600, help="Throughput tests per node, seconds.")
    ] = 2.0,
    streams: Annotated[
        int, typer.Option(min=1, max=32, help="Parallel streams of the upload test.")
    ] = 4,
    node_paths: Annotated[
        bool,
        typer.Option(
            "--node-paths",
            help="Also have each region's node measure its path to origin (shard data), to "
            "the registry (manifests) and to its peer regions (needs the admin token).",
        ),
    ] = False,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check the network paths to every node (and, with --node-paths, from them) and TCP settings.

    Loss is TCP's: segments retransmitted during a multi-stream upload (no
    figure below 2,000 segments). A node that reads another registry than the
    topology's is a problem (a file:// path that differs, a warning). Exit
    codes: 0 a clean bill of health; 1 a problem (listed with what would fix
    it); 2 bad input (a node refusing this command's token, none down:
    --token-file, the admin token for --node-paths; or its TLS as this command
    is set up: the problem says what to set).
    """
    from edgecache.clients.channels import credentials_refused_in
    from edgecache.clients.doctor import (
        TLS_REFUSED,
        UNREACHABLE,
        check_host,
        check_node_paths,
        check_paths,
    )

    options = Options(config, token_file)
    with reporting():
        topology, token = options.topology, options.token
        if region is not None and region not in topology.regions:
            known = ", ".join(sorted(topology.regions)) or "none"
            raise ValueError(f"--region {region!r} is not in the topology (its regions: {known})")
        paths = check_paths(
            topology,
            home_region=region,
            pings=pings,
            throughput_seconds=seconds,
            streams=streams,
            token=token,
        )
        host = check_host(paths, topology)
        from_nodes = (
            check_node_paths(topology, seconds=seconds, streams=streams, token=token)
            if node_paths
            else []
        )
    bad = any(p.problems for p in paths) or bool(host.problems)
    bad = bad or any(p.problems for p in from_nodes)
    said = [x for p in paths for x in p.problems] + [x for p in from_nodes for x in p.problems]
    # A node refusing this command's token (or the read one for Diagnose) is bad input,
    # as every other command says it, not a failure a retry may mend; a node down wins,
    # as in status (the host's tuning advice is neither).
    refused = any(credentials_refused_in(x) or x.startswith(TLS_REFUSED) for x in said)
    down = any(x.startswith(UNREACHABLE) for x in said)
    failed = ExitCode.BAD_INPUT if refused and not down else ExitCode.FAILED
    if as_json:
        print(
            json.dumps(
                {
                    "paths": [_ms_rounded(p.as_dict()) for p in paths],
                    "node_paths": [_ms_rounded(p.as_dict()) for p in from_nodes],
                    "host": host.as_dict(),
                    "ok": not bad,
                }
            )
        )
        raise exit_with(failed if bad else ExitCode.OK)

    def loss(value: float | None, sent: int) -> str:
        return "—" if value is None else f"{value:.3%} of {sent:,}"

    def mb_s(value: float | None) -> str:
        return "—" if value is None else f"{value:,.0f} MB/s"

    def verdict(problems: list[str], warnings: list[str] | None = None) -> str:
        said = "[red]" + escape("; ".join(problems)) + "[/red]" if problems else "[green]ok[/green]"
        return said + "".join(f"\n[yellow]{escape(w)}[/yellow]" for w in warnings or [])

    table(
        "network paths from this host",
        [
            Column("region", ident=True),
            Column("node", ident=True),
            Column("RTT", right=True),
            Column("jitter", right=True),
            Column("loss (TCP)", right=True),
            Column("read", right=True),
            Column("upload", right=True),
            Column("verdict", wrap=True),
        ],
        [
            [
                p.region,
                p.node,
                "—" if p.rtt_ms is None else f"{p.rtt_ms:.2f} ms",
                "—" if p.jitter_ms is None else f"{p.jitter_ms:.2f} ms",
                loss(p.loss, p.segments_sent),
                mb_s(p.throughput_mb_s),
                mb_s(p.upload_mb_s) + (f" ×{p.streams}" if p.upload_mb_s else ""),
                verdict(p.problems, p.warnings),
            ]
            for p in paths
        ],
    )
    if from_nodes:
        table(
            "network paths from the nodes",
            [
                Column("region", ident=True),
                Column("node", ident=True),
                Column("to", ident=True),
                Column("RTT", right=True),
                Column("rate", right=True),
                Column("loss (TCP)", right=True),
                Column("verdict", wrap=True),
            ],
            [
                [
                    p.region,
                    p.node,
                    p.label,
                    "—" if p.rtt_ms is None else f"{p.rtt_ms:.2f} ms",
                    mb_s(p.mb_s),
                    loss(p.loss, p.segments_sent),
                    verdict(p.problems) + (f" ({p.note})" if p.note else ""),
                ]
                for p in from_nodes
            ],
        )
    console.print(
        f"host: congestion control {host.congestion_control}, rmem_max {host.rmem_max:,}, "
        f"wmem_max {host.wmem_max:,}, largest bandwidth-delay product of a path "
        f"{host.bdp_bytes:,} B" + (f" (to {host.bdp_node})" if host.bdp_node else "")
    )
    for problem in host.problems:
        console.print(f"[red]✗[/red] {problem}")
    if host.fixes:
        console.print("to fix (as root; persist them in /etc/sysctl.d/):")
        for fix in host.fixes:
            console.print(f"  {fix}")
    if bad:
        raise exit_with(failed)


@app.command()
def healthcheck(
    address: Annotated[
        str | None,
        typer.Argument(
            metavar="HOST:PORT",
            help="HOST:PORT of a node's probe [PID 1's --probe-listen where it is edgecache "
            "serve, $EDGECACHE_PROBE_LISTEN, the --config file's (or PID 1's --config) "
            "probe_listen, 127.0.0.1:7071].",
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="The node's settings file (for its probe_listen).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait, more than 0.")] = 3.0,
) -> None:
    """Exit 0 when the node answers the standard gRPC health check with SERVING (for Docker).

    With no address it asks this host's node on its own configured probe port,
    as the node takes it, so an image's HEALTHCHECK follows a --probe-listen
    given to the container as well as EDGECACHE_PROBE_LISTEN. Exit codes: 0
    SERVING; 1 not serving or not answering; 2 bad input (the address, or a
    --timeout that is not more than 0: never blamed on the node).
    """
    from edgecache.clients.healthcheck import check, check_timeout, target

    with reporting():
        timeout = check_timeout(timeout)
        address = target(address, config)
    serving, said = check(address, timeout)
    (console if serving else err_console).print(said, soft_wrap=True, markup=False, highlight=False)
    raise exit_with(ExitCode.OK if serving else ExitCode.FAILED)
