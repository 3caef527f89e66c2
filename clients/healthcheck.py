"""The container's health check: ask this host's node on its probe port, importing little.

``python3 -m edgecache.clients.healthcheck [HOST:PORT] [--config FILE] [--timeout S]``
exits 0 when the node answers the standard gRPC health check with SERVING, 1
when it does not (or does not answer), 2 for a bad address or a ``--timeout``
that is not more than 0. Docker runs it every 10 s for the life of every
node: through the whole ``edgecache`` CLI
(typer, rich, every command module) each run took 0.5 CPU-s and 130 MB, about
5 % of a core held by health checks alone; this imports grpc and the health
stubs only (~0.1 s, 40 MB). ``edgecache healthcheck`` runs the same check.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["check", "check_timeout", "main", "probe_address", "serve_flags", "target"]

DEFAULT_PROBE = "127.0.0.1:7071"


def serve_flags(argv: Sequence[str] | None = None) -> dict[str, str]:
    """``--probe-listen`` and ``--config`` as given to PID 1, where PID 1 is ``edgecache serve``.

    In the image the node is PID 1 (its ENTRYPOINT), and settings given as
    flags (``docker run IMAGE --probe-listen …``) win over the variables there:
    the check read only the variable and the file, asked the old port, and
    called a serving node unhealthy. ``argv``: PID 1's (read from /proc when None).
    """
    if argv is None:
        try:
            raw = Path("/proc/1/cmdline").read_bytes()
        except OSError:
            return {}
        argv = raw.decode(errors="replace").split("\0")
    if "serve" not in argv:
        return {}
    at = argv.index("serve")
    if not any(os.path.basename(a).startswith("edgecache") for a in argv[:at]):
        return {}
    found: dict[str, str] = {}
    rest = list(argv[at + 1 :])
    for i, arg in enumerate(rest):
        for flag in ("--probe-listen", "--config"):
            if arg == flag and i + 1 < len(rest):
                found[flag] = rest[i + 1]
            elif arg.startswith(flag + "="):
                found[flag] = arg.partition("=")[2]
    return found


def probe_address(
    config: Path | None = None,
    environ: Mapping[str, str] | None = None,
    pid1: Sequence[str] | None = None,
) -> str:
    """Where this host's node answers health checks: its configured probe address.

    As the node itself takes it: ``--probe-listen`` given to PID 1 where that
    is ``edgecache serve`` (:func:`serve_flags`; ``pid1``: its arguments, read
    from /proc when None), else ``$EDGECACHE_PROBE_LISTEN``, else
    ``probe_listen`` in the node's settings file (``config``, else PID 1's
    ``--config``), else the default 127.0.0.1:7071; a wildcard host (0.0.0.0,
    ::) is asked on loopback, where the probe also listens.
    """
    env = os.environ if environ is None else environ
    flags = serve_flags(pid1)
    listen = flags.get("--probe-listen") or env.get("EDGECACHE_PROBE_LISTEN")
    if config is None and flags.get("--config"):
        config = Path(flags["--config"])
    if not listen and config is not None:
        import yaml

        from edgecache.cache.yaml_strict import yaml_problem

        try:
            settings = yaml.safe_load(config.read_text()) or {}
        except OSError as exc:
            raise ValueError(f"cannot read the node settings {config}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:  # said as serve says it: file, line, what to check
            raise ValueError(yaml_problem(config, exc)) from exc
        except (RecursionError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # PyYAML's safe constructors leak builtin errors on bad scalars (!!int 0x).
            raise ValueError(
                f"{config}: not valid YAML (a value cannot be read: {type(exc).__name__}: {exc})"
            ) from exc
        if not isinstance(settings, dict):  # a list or a bare string: not the node's file
            raise ValueError(f"{config} must hold a mapping of settings (as edgecache serve reads)")
        listen = settings.get("probe_listen") or settings.get("probe-listen")
    listen = str(listen or DEFAULT_PROBE)
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"the probe address {listen!r} is not HOST:PORT")
    if host in ("", "0.0.0.0", "[::]", "::"):  # noqa: S104 - a wildcard is asked on loopback
        host = "127.0.0.1"
    return f"{host}:{port}"


def target(address: str | None, config: Path | None = None) -> str:
    """The address to ask: ``address`` as given, else this host's probe; ValueError if bad.

    Checked before any channel is made: grpc takes ``nonsense`` or
    ``host:99999`` as an address and reports UNAVAILABLE, which reads as a
    node that is down (exit 1) rather than a typo (exit 2).
    """
    from edgecache.cache.addresses import address_problem

    found = address or probe_address(config)
    if "://" in found:
        return found
    if (problem := address_problem(found)) is not None:
        raise ValueError(f"the address {found!r} is not HOST:PORT: {problem}")
    return found


def check_timeout(timeout: float) -> float:
    """``--timeout`` as given, when it is seconds > 0; ValueError naming the option if not.

    gRPC takes a deadline of 0 or less as already past and reports
    DEADLINE_EXCEEDED, which read as a node that does not answer (exit 1: a
    Docker HEALTHCHECK then marks a healthy node unhealthy) rather than a typo
    in the check itself (exit 2).
    """
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"--timeout {timeout:g}: give the seconds to wait for the node's answer, "
            "more than 0 (e.g. --timeout 3, the default)"
        )
    return timeout


def check(address: str, timeout: float) -> tuple[bool, str]:
    """(serving, what to print) for the node at ``address``.

    A plain ``HOST:PORT`` (the probe port is plaintext) is asked on an insecure
    channel; another address (``grpcs://…``) through the clients' channel setup.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if "://" in address:
        from edgecache.clients.channels import open_channel

        channel = open_channel(address)
    else:
        channel = grpc.insecure_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout
        )
    except grpc.RpcError as exc:
        from edgecache.clients.channels import describe

        return False, f"{address}: {describe(exc)}"
    finally:
        channel.close()
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {name}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; the exit code (0 serving, 1 not, 2 bad input)."""
    parser = argparse.ArgumentParser(
        prog="python3 -m edgecache.clients.healthcheck",
        description="Exit 0 when this host's node answers the gRPC health check with SERVING.",
    )
    parser.add_argument(
        "address",
        nargs="?",
        help=f"HOST:PORT of the node's probe [PID 1's --probe-listen where it is edgecache "
        f"serve, $EDGECACHE_PROBE_LISTEN, the --config file's (or PID 1's --config) "
        f"probe_listen, {DEFAULT_PROBE}]",
    )
    parser.add_argument("--config", type=Path, help="the node's settings file")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait, > 0 [3]")
    args = parser.parse_args(argv)
    try:
        timeout = check_timeout(args.timeout)
        address = target(args.address, args.config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    serving, said = check(address, timeout)
    print(said, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
