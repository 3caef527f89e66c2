"""Edge node settings: a YAML file, ``EDGECACHE_*`` environment variables, then flags.

Later sources win (flags over environment over file), so a container image can
bake a file, Kubernetes can set the environment, and an operator can still
override one setting on the command line. Every setting is validated up
front; an error names its source and field and says what is expected.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import posixpath
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from edgecache.cache.addresses import split_hostport
from edgecache.cache.errors import ConfigError
from edgecache.cache.tokens import token_problem
from edgecache.cache.units import parse_rate, parse_size
from edgecache.cache.yaml_strict import StrictLoader, yaml_problem

__all__ = [
    "FLAG_SETTINGS",
    "NodeConfig",
    "load_node_config",
    "read_pem",
    "setting_name",
    "split_hostport",
    "cgroup_cpu_limit",
    "usable_cores",
]

log = logging.getLogger(__name__)

ENV_PREFIX = "EDGECACHE_"

# The settings ``edgecache serve`` has a flag for (``--cache-dir`` for ``cache_dir``);
# every other NodeConfig field is set only as EDGECACHE_<NAME> or in the YAML file.
FLAG_SETTINGS = frozenset(
    {
        "region",
        "cache_dir",
        "listen",
        "registry",
        "capacity",
        "metrics_listen",
        "probe_listen",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "token_file",
        "read_token_file",
        "staging_rate",
        "node_id",
        "log_level",
    }
)


def setting_name(name: str) -> str:
    """How a user sets ``name``: ``--cache-dir``, or ``max_streams / $EDGECACHE_MAX_STREAMS``.

    Only a setting with a flag is named as one; the others are a YAML key and a variable.
    """
    if name in FLAG_SETTINGS:
        return "--" + name.replace("_", "-")
    return f"{name} / ${ENV_PREFIX}{name.upper()}"


def read_pem(path: Path | str, setting: str) -> bytes:
    """The bytes of a PEM file a setting names, or a ConfigError naming the setting.

    Read when the node starts, so a path that is wrong stops it there rather
    than failing its first TLS handshake or peer copy.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{setting} {path}: cannot read it ({exc.strerror}); point {setting} at a readable "
            "PEM file"
        ) from exc
    if b"-----BEGIN " not in data:
        # A DER file (binary), or something else: gRPC and ssl read PEM only, and fail on
        # anything else with a message that names neither the file nor the setting.
        kind = "binary (DER?)" if any(b > 0x7F for b in data[:64]) else "text"
        raise ConfigError(
            f"{setting} {path} must be a PEM file (-----BEGIN ...----- lines), but it is "
            f"{'empty' if not data else kind} without them; convert a DER certificate with "
            "openssl x509 -inform DER -in FILE -out FILE.pem (a DER key: openssl pkey "
            "-inform DER -in FILE -out FILE.pem)"
        )
    return data


# The settings a node cannot start without, and what each holds (for the message when
# one is given empty: "EDGECACHE_CACHE_DIR=" put the cache in the current directory).
_REQUIRED = {
    "region": "the region this node serves, e.g. eu-west",
    "cache_dir": "the directory of the LMDB cache (a persistent volume)",
    "registry": "the registry URL, e.g. s3://bucket/_edgecache or file:///srv/registry",
}

_WILDCARDS = frozenset({"0.0.0.0", "::", ""})  # noqa: S104 - hosts that mean every address


def bound_addresses(host: str) -> set[str]:
    """The IP addresses gRPC binds for ``host``; empty if it does not resolve (binding says so).

    gRPC binds ``localhost`` as both loopbacks, 127.0.0.1 and ::1, whatever the
    host's resolver says; another name, as every address it resolves to.
    """
    if host == "localhost":
        return {"127.0.0.1", "::1"}
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return set()
    return {str(sockaddr[0]) for *_, sockaddr in found}


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> int | None:
    """Whole CPUs this process's cgroup quota allows (rounded up), or None where it has none.

    cgroup v2: ``cpu.max`` ("max 100000" or "200000 100000": quota, period);
    cgroup v1: ``cpu/cpu.cfs_quota_us`` (-1: no quota) over ``cpu.cfs_period_us``
    (the controller is mounted as ``cpu`` or ``cpu,cpuacct``).
    """
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    for folder in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        try:
            quota_us = int((root / folder / "cpu.cfs_quota_us").read_text())
            period_us = int((root / folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else max(1, -(-quota_us // period_us))
    return None


def usable_cores(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may run on: its affinity mask (taskset), capped by a cgroup quota.

    ``os.cpu_count()`` counts the host's cores, which a container or a pinned
    process cannot all use; the quota is read from cgroup v2 or v1.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root)
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


class NodeConfig(BaseModel):
    """Every setting of ``edgecache serve``; field names are the flag names with ``_``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    region: str = Field(description="Region this node serves, e.g. eu-west")
    cache_dir: Path = Field(description="Directory of the LMDB cache (a persistent volume)")
    registry: str = Field(description="Registry URL, e.g. s3://bucket/_edgecache")
    listen: str = Field("127.0.0.1:7070", description="gRPC HOST:PORT (port 0 picks one)")
    capacity: int | None = Field(None, description="Cache capacity, e.g. 500GiB")
    metrics_listen: str | None = Field(None, description="Prometheus HOST:PORT")
    probe_listen: str | None = Field(
        None, description="Plaintext health-only HOST:PORT for Kubernetes gRPC probes"
    )
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = Field(None, description="Require client certificates (mTLS)")
    token_file: Path | None = Field(
        None, description="Admin bearer token: required for Stage, Evict, Pin, Diagnose"
    )
    read_token_file: Path | None = Field(None, description="Bearer token required for reads")
    peer_token_file: Path | None = Field(
        None,
        description="Bearer token for reading from peer nodes when staging from them "
        "[the read token; never the admin token]",
    )
    peer_tls_ca: Path | None = Field(
        None, description="CA of peers' certificates, for grpcs:// peers [the system's roots]"
    )
    staging_rate: int | None = Field(None, description="Cap on staging's origin bytes/s")
    staging_concurrency: int = Field(4, ge=1, le=64)
    fetch_concurrency: int = Field(
        4, ge=1, le=64, description="Read-through origin fetches at once; more misses wait"
    )
    fetch_memory: int | None = Field(
        None,
        description="Memory the node's shard fetches may hold at once, e.g. 8GiB [half the "
        "memory this process may use]",
    )
    max_request_bytes: int = Field(
        1 << 20,
        description="Larger requests are refused unparsed, 1KiB-64MiB (gRPC's own "
        "RESOURCE_EXHAUSTED 'Received message larger than max')",
    )
    max_streams: int = Field(
        256,
        ge=1,
        le=65536,
        description="Concurrent calls (health and Status aside, manifests apart); beyond "
        "them RESOURCE_EXHAUSTED",
    )
    preprocess_threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Threads that parse, transform and compress shards [the cores this "
        "process may run on]",
    )
    grace_seconds: float = Field(10.0, description="SIGTERM drain time for streams")
    node_id: str | None = Field(
        None, description="Name in logs and metrics [hostname:port, unique per node on a host]"
    )
    sync: bool = Field(True, description="fsync LMDB commits (survives power loss)")
    origins: str | None = Field(
        None,
        description="Comma-separated URL prefixes versions may be read from "
        "[every s3:// bucket, and the registry's own scheme]",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="The node's own log lines: DEBUG, INFO, WARNING or ERROR, any case"
    )

    @model_validator(mode="before")
    @classmethod
    def _empty_is_unset(cls, data: Any) -> Any:
        """An empty value (``EDGECACHE_TLS_CERT=``, ``capacity:`` in YAML) is not set.

        One rule for every setting: an empty optional one takes its default, and
        an empty required one is refused naming it (:meth:`_required`). Without
        it, an empty path became ``Path('.')`` (the cache in the current
        directory, a token file that is a directory, a certificate "without its
        key"), an empty size meant unset and an empty address was an error.
        """
        if not isinstance(data, dict):
            return data
        return {
            name: value
            for name, value in data.items()
            if name in _REQUIRED or not (value is None or value == "")
        }

    @field_validator("region", "cache_dir", "registry", mode="before")
    @classmethod
    def _required(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse a required setting given empty (or blank), naming what it should hold."""
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError(
                f"{'is empty' if value in (None, '') else 'holds only spaces'}, and the node "
                f"needs it: give {_REQUIRED[str(info.field_name)]}"
            )
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        """``EDGECACHE_LOG_LEVEL=debug`` as ``--log-level debug`` takes it."""
        return value.upper() if isinstance(value, str) else value

    @field_validator("node_id")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        """A node id of spaces only names nothing (it is a label of every metric)."""
        if value is not None and not value.strip():
            raise ValueError(
                "holds only spaces: give a name unique per node on a host, or leave it unset "
                "for hostname:port"
            )
        return value

    @field_validator("max_request_bytes", mode="before")
    @classmethod
    def _request_bytes(cls, value: Any) -> Any:
        """A size as ``capacity`` takes it (``2MiB``, ``1KiB``, a number), 1KiB to 64MiB."""
        size = parse_size(value)
        if not 1 << 10 <= size <= 64 << 20:
            raise ValueError(
                f"{_shown(value)} is outside 1KiB-64MiB (requests are names and numbers; "
                "the default, 1MiB, fits any)"
            )
        return size

    @field_validator(
        "staging_concurrency",
        "fetch_concurrency",
        "max_streams",
        "preprocess_threads",
        mode="before",
    )
    @classmethod
    def _count(cls, value: Any) -> Any:
        """A count, not a yes/no: YAML's ``true`` (or ``yes``) was taken as 1 without a word."""
        if isinstance(value, bool):
            raise ValueError(f"{_shown(value)} is not a count: give a whole number, e.g. 4")
        return value

    @field_validator("grace_seconds", mode="before")
    @classmethod
    def _grace(cls, value: Any) -> Any:
        """A finite number of seconds, at least 0: ``.inf`` would drain forever."""
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"{_shown(value)} is not a drain time: give a finite number of seconds, at "
                "least 0 (fractions count), e.g. 10"
            )
        return seconds

    # The size and rate validators see only values given: an empty one (None, "") never
    # reaches them (_empty_is_unset drops it, so the setting takes its default).
    @field_validator("capacity", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        size = parse_size(value)  # a ValueError (not a TypeError) for a list, true, …
        if size < 1:
            raise ValueError(
                f"the cache's capacity must be at least 1 byte, got {_shown(value)}; leave it "
                "unset to size the cache from its disk (the size it had, else 80% of the "
                "free space)"
            )
        if size < 1 << 20 and isinstance(value, str) and value.strip().isdigit():
            # A number alone is bytes (as scripts pass it): `--capacity 500` made a cache of
            # 500 bytes, which refused every shard, and nothing said why at the start. Text
            # only (a flag, a variable): code passing an int means bytes.
            log.warning(
                "capacity %s is %s bytes (a number without a unit is bytes), too small for "
                "most shards; did you mean %sMiB or %sGiB?",
                value,
                value,
                value,
                value,
            )
        return size

    @field_validator("fetch_memory", mode="before")
    @classmethod
    def _fetch_memory(cls, value: Any) -> Any:
        size = parse_size(value)
        if size < 64 << 20:
            raise ValueError(
                f"{_shown(value)} is too little for a shard fetch (at least 64MiB); leave it "
                "unset for half the memory this process may use"
            )
        return size

    @field_validator("staging_rate", mode="before")
    @classmethod
    def _rate(cls, value: Any) -> Any:
        rate = parse_rate(value)  # a ValueError (not a TypeError) for a list, true, …
        if rate < 1:  # 0, 7bit/s, 0.5B/s: no token bucket can run below 1 byte/s
            raise ValueError(
                f"{_shown(value)} is below 1 byte/s, too low to be a limit (give at least "
                "1B/s); to stage without a limit, leave the staging rate unset: no "
                f"--staging-rate, no {ENV_PREFIX}STAGING_RATE, no staging_rate in the YAML file"
            )
        return rate

    @field_validator("origins")
    @classmethod
    def _origins(cls, value: str | None) -> str | None:
        if value is None:
            return None
        entries = [entry.strip() for entry in value.split(",") if entry.strip()]
        if not entries:
            raise ValueError(
                "no origin given; name URL prefixes (s3://bucket/datasets/,file:///data/), "
                "or leave it unset for the default"
            )
        if bad := [entry for entry in entries if "://" not in entry]:
            raise ValueError(
                f"{', '.join(bad)}: an origin is a URL prefix with its scheme "
                "(s3://bucket/prefix/, file:///data/, https://host/path/)"
            )
        return ",".join(entries)

    @field_validator("listen", "metrics_listen", "probe_listen")
    @classmethod
    def _hostport(cls, value: str | None) -> str | None:
        if value is not None:
            split_hostport(value)
        return value

    @model_validator(mode="after")
    def _tls_complete(self) -> NodeConfig:
        """Refuse TLS settings that would otherwise be dropped, leaving the node plaintext.

        A certificate without its key (or the reverse) cannot serve TLS, and a
        client CA without a certificate cannot require client certificates:
        starting anyway would open the port in clear to everyone.
        """
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("--tls-cert", "--tls-key")
            if self.tls_cert is None:
                given, missing = missing, given
            raise ValueError(
                f"tls_cert and tls_key go together: {given} is set without {missing}; "
                "set both (the certificate and its key) or neither"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "--tls-client-ca requires client certificates over TLS, but the node has no "
                "certificate: set --tls-cert and --tls-key too"
            )
        return self

    @model_validator(mode="after")
    def _distinct_ports(self) -> NodeConfig:
        """Refuse two of ``listen``, ``metrics_listen`` and ``probe_listen`` on one port.

        The second bind fails, and was reported as "in use: another process listens
        there", sending the operator after a process that does not exist. A wildcard
        host (``0.0.0.0``, ``::``) takes the port on every address; port 0 is
        picked apart at bind.
        """
        seen: dict[tuple[str, int], str] = {}
        for name in ("listen", "metrics_listen", "probe_listen"):
            value = getattr(self, name)
            if value is None:
                continue
            host, port = split_hostport(value)
            if not port:
                continue
            for (other_host, other_port), other in seen.items():
                if port == other_port and (
                    host == other_host
                    or {host, other_host} & _WILDCARDS
                    or bound_addresses(host) & bound_addresses(other_host)
                ):
                    raise ValueError(
                        f"{setting_name(other)} {getattr(self, other)} and "
                        f"{setting_name(name)} {value} are the same port: each needs a port "
                        "of its own (or port 0, picked at bind)"
                    )
            seen[(host, port)] = name
        return self

    def origin_prefixes(self) -> tuple[str, ...]:
        """The URL prefixes this node reads versions from: ``origins``, else the default.

        A version's source URL (and a transform's file) comes from the registry;
        anyone who can write a manifest there could otherwise point it at
        ``file:///var/run/secrets/…`` or an internal ``http://`` service and read
        the bytes back as rows. The default takes every ``s3://`` bucket (where
        training data lives) and the registry's own scheme (a ``file://`` registry
        is a local setup, whose writers have the files anyway).
        """
        if self.origins:
            return tuple(self.origins.split(","))
        scheme = self.registry.split("://", 1)[0].lower() if "://" in self.registry else "file"
        return tuple(dict.fromkeys(("s3://", f"{scheme}://")))

    def cpu_threads(self) -> int:
        """``preprocess_threads``, else the cores this process may run on (taskset, cgroups)."""
        return self.preprocess_threads or usable_cores()

    def default_node_id(self) -> str:
        """``hostname:port``, or ``hostname:<cache dir's absolute path>`` with port 0.

        Two nodes on one host must not share a name in logs and metrics: their
        ports differ, or (a port picked at bind) their cache directories, whose
        last parts alone need not (``/a/cache`` and ``/b/cache``).
        """
        _, port = split_hostport(self.listen)
        return f"{socket.gethostname()}:{port or self.cache_dir.absolute()}"

    def read_token(self, which: str) -> str | None:
        """The token from ``token_file``, ``read_token_file`` or ``peer_token_file``, stripped.

        Never logged. Read and checked when the node starts, so a file no client
        could present stops the node there (exit 2), naming its setting.
        """
        path = getattr(self, which)
        if path is None:
            return None
        flag = setting_name(which)
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {flag} {path}: {exc.strerror}") from exc
        token = data.strip()
        if not token:
            raise ConfigError(f"{flag} {path} is empty; put the token in it")
        if (why := token_problem(token)) is not None:
            raise ConfigError(f"{flag} {path} {why}")
        return token.decode("ascii")


def origin_allowed(url: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``url`` lies under one of ``prefixes`` (whole path segments; ``..`` resolved)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return False
    if scheme.lower() == "file":
        rest = posixpath.normpath(rest) + ("/" if rest.endswith("/") else "")
    url = f"{scheme.lower()}://{rest}"
    for prefix in prefixes:
        p_scheme, _, p_rest = prefix.partition("://")
        prefix = f"{p_scheme.lower()}://{p_rest}"
        if url == prefix or url.startswith(prefix if prefix.endswith("/") else prefix + "/"):
            return True
    return False


def _shown(value: Any) -> str:
    """A setting's value as the user wrote it: ``7bit/s``, ``0``, ``true``."""
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else repr(value)


# EDGECACHE_* variables other parts of edgecache read (clients, the controller, the CLI's
# shared options): a node's environment may carry them without meaning a node setting.
OTHER_TOOLS_ENV = frozenset(
    {
        "EDGECACHE_CONFIG",  # a client's topology file
        "EDGECACHE_TLS_CA",  # a client's CA (a node's, for its peers: EDGECACHE_PEER_TLS_CA)
        "EDGECACHE_TOKEN_FILE",  # the CLI's bearer token file
        "EDGECACHE_CLIENT_METRICS_PORT",  # EdgeDataset's metrics
        "EDGECACHE_SHARED_BATCHES",  # EdgeDataset's DataLoader workers
        "EDGECACHE_SCHEDULE",  # edgecache controller
        "EDGECACHE_CONTROLLER_METRICS_LISTEN",  # edgecache controller
    }
)


# What Kubernetes sets in a pod for a Service named ``edgecache`` (its "service links").
_SERVICE_LINK = re.compile(
    r"EDGECACHE_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)\w*)?)"
)


def _service_link(key: str, environ: Mapping[str, str]) -> bool:
    """Whether ``key`` is a variable Kubernetes set for the ``edgecache`` Service, not a setting.

    In a pod (``KUBERNETES_SERVICE_HOST`` set) whose spec keeps service links on,
    every start warned of eight of them, each with a wrong "did you mean".
    """
    return "KUBERNETES_SERVICE_HOST" in environ and _SERVICE_LINK.fullmatch(key) is not None


def _say_unknown_variable(key: str) -> None:
    """Warn of an EDGECACHE_* variable no setting has: a misspelt one was silently ignored.

    ``EDGECACHE_TLS_CERTIFICATE`` left a node serving plaintext with nothing said.
    A warning, not a refusal: a container's environment may hold variables meant for
    other tools of a newer edgecache.
    """
    names = [ENV_PREFIX + name.upper() for name in NodeConfig.model_fields]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    hint = f"did you mean {close[0]}?" if close else "see edgecache serve --help for the settings"
    log.warning("%s is not a setting of edgecache serve and is ignored; %s", key, hint)


def load_node_config(
    config_file: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> NodeConfig:
    """Merge file, environment and flags (``None`` flags are unset) into a NodeConfig."""
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    if config_file is not None:
        try:
            loader = StrictLoader(Path(config_file).read_text())
            try:
                loaded = loader.get_single_data() or {}
            finally:
                loader.dispose()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(yaml_problem(config_file, exc)) from exc
        except RecursionError as exc:
            raise ConfigError(f"{config_file}: not valid YAML (nested too deeply)") from exc
        except (ValueError, KeyError, IndexError, AttributeError) as exc:
            # PyYAML's safe constructors leak builtin errors on bad scalars (!!int 0x).
            raise ConfigError(
                f"{config_file}: not valid YAML (a value cannot be read: "
                f"{type(exc).__name__}: {exc})"
            ) from exc
        if loader.duplicates:
            # YAML keeps the last copy without a word: a second capacity: overrode the first.
            raise ConfigError(
                "; ".join(
                    f"{config_file}:{dup.second}: {dup.key!r} is set twice (first at line "
                    f"{dup.first}); YAML would keep only the last: remove one"
                    for dup in loader.duplicates
                )
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"{config_file} must hold a mapping of settings")
        for key, value in loaded.items():
            name = str(key).replace("-", "_")
            merged[name] = value
            source[name] = str(config_file)
    fields = NodeConfig.model_fields
    env = os.environ if environ is None else environ
    for key, value in env.items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name in fields:
                if value == "" and name in merged:
                    continue  # empty is "not set": the file's value stands, as for flags
                merged[name] = value
                source[name] = f"${key}"
            elif key not in OTHER_TOOLS_ENV and not _service_link(key, env):
                _say_unknown_variable(key)
    for key, value in (flags or {}).items():
        # None: not given; "" (an empty --tls-cert "") is "not set" as in the environment,
        # so it never wipes out a value the file or a variable gave.
        if value is not None and not (value == "" and key in merged):
            merged[key] = value
            source[key] = "--" + key.replace("_", "-")
    try:
        return NodeConfig(**merged)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            if not error["loc"]:  # a rule across settings: its message names the flags
                problems.append(str(error["msg"]).removeprefix("Value error, "))
                continue
            name = str(error["loc"][0])
            origin = source.get(name, "not set anywhere")
            message = str(error["msg"]).removeprefix("Value error, ")
            if name not in NodeConfig.model_fields:  # a YAML key no setting has
                close = difflib.get_close_matches(name, NodeConfig.model_fields, n=1)
                hint = (
                    f"did you mean {close[0]}?"
                    if close
                    else "the settings are " + ", ".join(NodeConfig.model_fields)
                )
                problems.append(f"{name} ({origin}): there is no such setting; {hint}")
                continue
            named = setting_name(name)
            # "--capacity (--capacity)" said the flag twice; a file or variable is worth naming.
            problems.append(f"{named}{'' if origin == named else f' ({origin})'}: {message}")
        raise ConfigError(
            "invalid node settings:\n  "
            + "\n  ".join(problems)
            + f"\nSet them with flags, {ENV_PREFIX}<NAME> variables or a --config file."
        ) from exc
