"""Running an edge node: the gRPC server, health, reflection, TLS, metrics and lifecycle.

``edgecache serve`` calls :func:`serve_forever`. Tests, benchmarks and the
demo start nodes in-process with :class:`NodeServer` (on the caller's loop)
or :func:`running_node` (on a loop in a background thread).

Lifecycle: on SIGTERM/SIGINT staging stops starting new shards (a Stage
ends UNAVAILABLE once the shards it had started are committed, naming those
staged), health flips to NOT_SERVING (so load balancers and probes stop
sending work), the server stops accepting calls, in-flight streams and shard
fetches get ``grace_seconds`` to finish, and the store closes. Shards are
committed whole or not at all, so a restarted node serves everything it had
committed and nothing partial.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import ipaddress
import logging
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from edgecache.cache.errors import ConfigError
from edgecache.cache.preprocess.text import tokenise_on_callers_threads
from edgecache.cache.registry_match import shown_url
from edgecache.cache.storage import s3
from edgecache.edge.allocator import keep_message_buffers
from edgecache.edge.call_limits import (
    MANIFEST_METHODS,
    CallLimit,
    OpenStreamLimit,
    open_stream_limit,
)
from edgecache.edge.config import (
    NodeConfig,
    bound_addresses,
    read_pem,
    setting_name,
    split_hostport,
)
from edgecache.edge.node import EdgeNode
from edgecache.edge.service import SERVICE_NAME, EdgeCacheService, TokenAuthInterceptor

__all__ = [
    "CHANNEL_OPTIONS",
    "NodeServer",
    "dial_address",
    "exposure",
    "host_port",
    "running_node",
    "serve_forever",
]

log = logging.getLogger(__name__)

# Chunks are several MiB: lift gRPC's 4 MiB default on both sides.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]
# gRPC sets SO_REUSEPORT by default, which lets a second node bind a port another one
# already serves (the kernel then splits connections between them): refuse instead.
# A stopped node's port is still reusable at once: SO_REUSEADDR is a separate option.
_NO_PORT_SHARING = ("grpc.so_reuseport", 0)
_SERVER_OPTIONS = [
    _NO_PORT_SHARING,
    ("grpc.max_send_message_length", -1),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Readers ping every 2 s to notice a blackholed node within seconds; accept that
    # instead of answering GOAWAY "too_many_pings".
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def exposure(config: NodeConfig, port: int | None = None) -> list[str]:
    """What is open to the network about a node bound beyond loopback (see docs/security.md).

    ``port``: the port bound, named in place of ``--listen``'s 0 (port picked at bind).
    """
    host, asked = split_hostport(config.listen)
    listen = config.listen if port is None or asked else host_port(host, port)
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return []
    except ValueError:
        pass  # a host name: assume it is reachable
    problems = []
    admin, read = config.token_file is not None, config.read_token_file is not None
    if not admin and not read:
        problems.append(
            f"{listen} has no token: anyone who reaches this port can Stage, Evict, "
            "Pin and Diagnose (fill or empty the cache), read every cached dataset and make "
            "the node fetch any published shard from origin; set --token-file and "
            "--read-token-file"
        )
    elif not read:
        # Admin calls need the admin token; everything else is open (see TokenAuthInterceptor).
        problems.append(
            f"reads on {listen} need no token: anyone who reaches this port can read "
            "every cached dataset, list what is cached (Status), make the node fetch any "
            "published shard from origin (egress, pushing unpinned versions out) and send "
            "it Sink tests; set --read-token-file"
        )
    # A read token without an admin token: admin calls are refused altogether, reads need it.
    if config.tls_cert is None:
        problems.append(
            f"{listen} is plaintext: data{' and tokens' if admin or read else ''} cross "
            "the network readable and alterable; set --tls-cert/--tls-key (and "
            "--tls-client-ca for mutual TLS)"
        )
    return problems


def _bind(
    server: aio.Server,
    address: str,
    flag: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Bind ``address``; the port bound, or a :class:`ConfigError` that says why not.

    gRPC raises only "Failed to bind" (the reason goes to its own log), so
    the reason is found again with a plain socket: an operator needs to know
    whether to pick another port or another address. A name that resolves to
    several addresses (``localhost``: 127.0.0.1 and ::1) is bound by gRPC if any
    of them binds: a second node on ``localhost:7070`` started beside one on
    127.0.0.1:7070, on ::1 alone, and clients reached either. Each is tried first.
    """
    host, port = split_hostport(address)
    if port and len(found := bound_addresses(host)) > 1:
        if (taken := _in_use(found, port)) is not None:
            raise ConfigError(f"{flag}: {_bind_failure(address, flag, taken)}")
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"{flag}: {_bind_failure(address, flag)}") from exc


def _in_use(addresses: set[str], port: int) -> OSError | None:
    """The error of the first of ``addresses`` where another socket holds ``port``, if one does."""
    tried = [
        (socket.AF_INET6 if ":" in h else socket.AF_INET, (h, port)) for h in sorted(addresses)
    ]
    return next((e for e in _bind_errors(tried) if e.errno == errno.EADDRINUSE), None)


def _bind_errors(addresses: Iterable[tuple[int, tuple[Any, ...]]]) -> list[OSError]:
    """What binding each ``(family, sockaddr)`` with a plain socket, as gRPC binds, raised."""
    errors = []
    for family, sockaddr in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                errors.append(exc)
    return errors


def _bind_failure(address: str, flag: str, error: OSError | None = None) -> str:
    """Why ``address`` cannot be bound (``error``, or found by binding it again), and what to do."""
    host, port = split_hostport(address)
    if error is None:
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            return (
                f"cannot bind {address}: {host!r} does not resolve ({exc.strerror}); "
                "give an IP address or a known host name"
            )
        error = next(iter(_bind_errors((a[0], a[4]) for a in found)), None)
    if error is None:
        return f"cannot bind {address}; run with GRPC_VERBOSITY=debug to see why"
    if error.errno == errno.EADDRINUSE:
        return f"{address} is in use: another process listens there; choose another {flag}"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"cannot bind {address}: no interface of this host has that address"
    if error.errno == errno.EACCES:
        return f"cannot bind {address}: the port needs privileges; choose one above 1023"
    return f"cannot bind {address} ({error.strerror or error}); choose another {flag}"


def _no_passphrase() -> bytes:
    raise ConfigError("--tls-key is encrypted")


def _check_certificates(
    cert_path: Path, key_path: Path, cert: bytes, client_ca: tuple[Path, bytes] | None
) -> None:
    """Refuse TLS files gRPC would reject, each named by its flag, before any port is bound.

    gRPC logs the reason to stderr and raises only "Failed to bind", which
    sends an operator after the port; a certificate that has expired is
    accepted and then refused by every client. Python's ``ssl`` parses the
    same PEM files with OpenSSL, so what passes here passes in gRPC.
    """
    cert_flag, key_flag = f"--tls-cert {cert_path}", f"--tls-key {key_path}"
    pems = [(cert_flag, cert)]
    if client_ca is not None:
        pems.append((f"--tls-client-ca {client_ca[0]}", client_ca[1]))
    for flag, pem in pems:
        try:
            # Only ASCII can be PEM: other bytes (UTF-8 text beside the PEM blocks, a
            # binary file) are dropped, since ssl refuses a str holding them (TypeError).
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
                cadata=pem.decode("ascii", "ignore")
            )
        except (ssl.SSLError, ValueError, TypeError) as exc:
            raise ConfigError(
                f"{flag} holds no PEM certificate (-----BEGIN CERTIFICATE-----): give the "
                "certificate file, not a key or a DER file"
            ) from exc
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            cert_path, key_path, password=_no_passphrase
        )
    except ConfigError:
        raise ConfigError(
            f"{key_flag} is encrypted, and gRPC reads only unencrypted keys: decrypt it "
            "(openssl pkey -in KEY -out KEY.plain) and keep it in a Secret"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(
                f"{key_flag} does not match the certificate in {cert_flag}: give the key "
                "that certificate was issued for"
            ) from exc
        raise ConfigError(
            f"{key_flag} holds no PEM private key (-----BEGIN PRIVATE KEY-----): give the "
            "certificate's key file"
        ) from exc
    _check_dates(cert_flag, cert_path)


def _check_dates(flag: str, path: Path) -> None:
    """An expired certificate stops the node; one not valid yet is warned about (clock skew)."""
    decode = getattr(ssl._ssl, "_test_decode_cert", None)  # type: ignore[attr-defined]
    if decode is None:  # private to CPython's ssl: without it, clients will say
        return
    try:
        fields = decode(str(path))
        not_before = ssl.cert_time_to_seconds(fields["notBefore"])
        not_after = ssl.cert_time_to_seconds(fields["notAfter"])
    except (ssl.SSLError, KeyError, ValueError):
        return
    now = time.time()
    if now > not_after:
        raise ConfigError(
            f"{flag} expired on {fields['notAfter']}: every client refuses it; renew the "
            "certificate and restart the node"
        )
    if now < not_before:
        log.warning(
            "%s is not valid until %s: clients refuse it until then; check this host's clock "
            "and the issuer's",
            flag,
            fields["notBefore"],
        )


def _credentials(config: NodeConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key (and --tls-client-ca), checked first."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    cert = read_pem(config.tls_cert, "--tls-cert")
    key = read_pem(config.tls_key, "--tls-key")
    client_ca = None
    if config.tls_client_ca is not None:
        client_ca = (config.tls_client_ca, read_pem(config.tls_client_ca, "--tls-client-ca"))
    _check_certificates(Path(config.tls_cert), Path(config.tls_key), cert, client_ca)
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=client_ca[1] if client_ca else None,
        require_client_auth=client_ca is not None,
    )


class NodeServer:
    """An edge node bound to its ports, on the running event loop."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node: EdgeNode | None = None
        self.port = 0
        self.probe_port = 0
        self.metrics_port = 0
        self._server: aio.Server | None = None
        self._probe: aio.Server | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._metrics_http: object | None = None

    @property
    def address(self) -> str:
        """``host:port`` clients dial (``[::1]:7070`` for IPv6: see :func:`dial_address`)."""
        host, _ = split_hostport(self.config.listen)
        return dial_address(host, self.port)

    @property
    def serving_on(self) -> str:
        """Where it listens, as said at start (its stdout line and its log).

        The address to dial comes last (scripts take the line's last word); a
        wildcard host is said as bound first, so the line does not read as
        loopback-only.
        """
        host, _ = split_hostport(self.config.listen)
        wildcard = host in ("0.0.0.0", "::", "")  # noqa: S104
        bound = f"{host_port(host, self.port)}, dial " if wildcard else ""
        return f"{bound}{self.address}"

    async def start(self) -> None:
        """Open the cache, bind the ports and start serving."""
        config = self.config
        admin_token, read_token = (
            config.read_token("token_file"),
            config.read_token("read_token_file"),
        )
        if admin_token is not None and admin_token == read_token:
            # The admin token is accepted first: every reader could then warm and evict.
            raise ConfigError(
                f"{setting_name('token_file')} ({config.token_file}) and "
                f"{setting_name('read_token_file')} ({config.read_token_file}) hold the same "
                "token, so every reader would be an "
                "admin (Stage, Pin, Evict); give readers a token of their own (e.g. openssl "
                "rand -hex 32 > read.token)"
            )
        credentials = _credentials(config)  # before the cache opens: a bad file fails fast
        try:
            s3.check_environment()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.node = node = EdgeNode(config)
        node.on_cache_damaged = self._not_serving
        server: aio.Server | None = None
        try:
            # The side ports first, --listen last: gRPC aio cannot release a server bound
            # but never started (stop() keeps its port until the process exits), so a
            # failure must come before the main server binds. In-process nodes (tests,
            # the demo) outlive a failed start and may try again on the same ports.
            if config.probe_listen:
                # Kubernetes gRPC probes speak neither TLS nor tokens: health only, plaintext.
                # grpc's servicer starts out SERVING for "": not until --listen serves.
                for name in ("", SERVICE_NAME):
                    await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
                self._probe = aio.server(options=[_NO_PORT_SHARING])
                health_pb2_grpc.add_HealthServicer_to_server(self._health, self._probe)
                self.probe_port = _bind(self._probe, config.probe_listen, "--probe-listen")
                await self._probe.start()
            if config.metrics_listen:
                host, port = split_hostport(config.metrics_listen)
                try:
                    self.metrics_port = node.metrics.serve(host, port)
                except OSError as exc:
                    raise ConfigError(
                        "--metrics-listen: "
                        + _bind_failure(config.metrics_listen, "--metrics-listen", exc)
                    ) from exc
            # Tokens first: a call refused for its token never takes a slot, and says so
            # whatever the load. Then max_streams, and the small share of it token-free
            # Watch and reflection streams may hold (edge/call_limits.py says why not
            # gRPC's maximum_concurrent_rpcs).
            interceptors: list[aio.ServerInterceptor] = []
            if admin_token or read_token:
                interceptors.append(TokenAuthInterceptor(admin_token, read_token))
            interceptors += [
                CallLimit(config.max_streams, node.metrics.refused_calls["max_streams"].inc),
                CallLimit(
                    config.max_streams,
                    node.metrics.refused_calls["manifest_calls"].inc,
                    methods=MANIFEST_METHODS,
                ),
                OpenStreamLimit(
                    open_stream_limit(config.max_streams),
                    node.metrics.refused_calls["open_streams"].inc,
                ),
            ]
            server = aio.server(
                interceptors=interceptors,
                # Requests are small (names and numbers): refuse anything bigger than
                # max_request_bytes up front instead of parsing it.
                options=[
                    *_SERVER_OPTIONS,
                    ("grpc.max_receive_message_length", config.max_request_bytes),
                ],
            )
            server.add_generic_rpc_handlers((EdgeCacheService(node).generic_handler(),))
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
            self.port = _bind(server, config.listen, "--listen", credentials)
            await server.start()
            self._server = server
        except BaseException:
            if server is not None:
                await server.stop(0)  # frees the port if start() got far enough
            if self._probe is not None:
                await self._probe.stop(0)
                self._probe = None
            self.port = self.probe_port = self.metrics_port = 0
            node.metrics.shutdown()
            await node.close()
            raise
        if not node.damaged:  # damage met before this point (a read at start) stands
            for name in ("", SERVICE_NAME):
                await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "edge node %s of region %s serving on %s (cache %s, registry %s)",
            node.node_id,
            config.region,
            self.serving_on,  # as bound: the log of a node open to all read "127.0.0.1"
            config.cache_dir,
            shown_url(config.registry),  # without credentials a URL may carry
        )
        for problem in exposure(config, self.port):
            log.warning("%s", problem)
        missing = missing_registry(config.registry)
        if missing:
            log.warning("%s", missing)

    async def _not_serving(self) -> None:
        """Health NOT_SERVING on both ports, for good: the node found its cache damaged."""
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: NOT_SERVING, no new calls, in-flight ones get ``grace`` seconds."""
        grace = self.config.grace_seconds if grace is None else grace
        deadline = time.monotonic() + grace
        if self.node is not None:
            # Before anything awaits: no staging fetch starts once the drain has begun,
            # so the grace period is the running ones' to commit in, and each Stage
            # ends (UNAVAILABLE, naming what it staged) once its running shards are done.
            self.node.drain()
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            # Calls still running when the grace period ends are cancelled, and grpc logs
            # each at ERROR with a CancelledError traceback ("Exception not handled by
            # _handle_exceptions"): every SIGTERM during a long Stage looked like a crash.
            # What was dropped is said once, below.
            logging.getLogger("grpc._cython.cygrpc").addFilter(_cancelled_at_stop)
            await self._server.stop(grace)
        if self._probe is not None:
            await self._probe.stop(0)
        # Drop the stopped servers: gRPC aio keeps its poller thread (always inside gRPC
        # core) until the last aio object is freed, and while it runs gRPC skips its fork
        # handlers, so a process that stopped an in-process node (tests, a program embedding
        # one) and then forks DataLoader workers would hand them a broken gRPC.
        self._server = self._probe = None
        if self.node is not None:
            # Shard fetches under way (stages, read-through misses) get what is left of the
            # grace period to commit whole; those still running then are dropped.
            dropped = await self.node.finish_fetches(deadline - time.monotonic())
            if dropped:
                log.warning(
                    "%d shard fetches were still running after the %g s grace period and "
                    "were dropped (nothing partial is kept); a longer grace_seconds lets "
                    "them commit",
                    dropped,
                    grace,
                )
            await self.node.close()
        if self.node is not None and self.metrics_port:
            self.node.metrics.shutdown()
        log.info("edge node stopped")


def _cancelled_at_stop(record: logging.LogRecord) -> bool:
    """False for grpc's record of a call cancelled as the server stops (see NodeServer.stop)."""
    info = record.exc_info
    return not (info and isinstance(info[1], asyncio.CancelledError))


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC parses it: an IPv6 host in brackets (``[::1]:7070``).

    ``::1:7070`` is no address gRPC can dial ("Misformatted domain name"), and
    scripts dial the last word of the ``serving on`` line.
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def dial_address(host: str, port: int) -> str:
    """Where a client on this host reaches a server bound to ``host``: a wildcard is loopback.

    ``0.0.0.0`` (or no host) is dialled as ``127.0.0.1`` and ``::`` as ``[::1]``:
    neither is an address to connect to.
    """
    if host in ("0.0.0.0", ""):  # noqa: S104 - a bound wildcard, named to be replaced
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host_port(host, port)


def missing_registry(registry: str) -> str | None:
    """A warning when a registry on this filesystem does not exist, else None.

    Not refused: a registry is made by its first publish, and a node may start
    before that (a fresh deployment). But a mistyped path looks exactly like
    that, and the node then answers every read with NOT_FOUND; saying so at
    start points at the cause.
    """
    path = registry[len("file://") :] if registry.startswith("file://") else None
    if path is None and "://" not in registry:
        path = registry
    if path is None or os.path.isdir(path):
        return None
    return (
        f"the registry {registry} does not exist: every version is unknown (NOT_FOUND) "
        "until one is published there; if that is not the path you meant, restart with "
        "the right --registry"
    )


async def serve_forever(config: NodeConfig) -> None:
    """Run a node until SIGTERM or SIGINT, then drain gracefully."""
    # A node process serves only its own metrics: each counter's `_created` series (its
    # start time, which process_start_time_seconds gives once) would double the counters.
    prometheus_client.disable_created_metrics()
    keep_message_buffers()
    tokenise_on_callers_threads()
    server = NodeServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"serving on {server.serving_on}", flush=True)
    if server.metrics_port:
        host, _ = split_hostport(config.metrics_listen or "")
        print(f"metrics on {host_port(host, server.metrics_port)}", flush=True)
    if server.probe_port:  # chosen at bind with port 0: said, or found only with ss
        host, _ = split_hostport(config.probe_listen or "")
        print(f"health probe on {host_port(host, server.probe_port)}", flush=True)
    await stop.wait()
    log.info("signal received: draining for up to %g s", config.grace_seconds)  # 0.5 is 0.5
    await server.stop()


@contextlib.contextmanager
def running_node(config: NodeConfig, *, grace: float | None = 1.0) -> Iterator[NodeServer]:
    """A node on its own event loop in a background thread; stops when the block ends.

    The stop is a drain of ``grace`` seconds: open streams and shard fetches under
    way get that long to finish. One second by default, since a block that ends is a
    program (a test, a script) done with its node, not a rolling restart whose
    readers fail over; ``None`` drains for the config's ``grace_seconds``, as SIGTERM
    does for ``edgecache serve``.
    """
    loop = asyncio.new_event_loop()
    server = NodeServer(config)
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.start())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)
            ready.set()
            return
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name=f"edge-node-{config.region}", daemon=True)
    thread.start()
    ready.wait()
    if failure:
        thread.join()
        loop.close()
        raise failure[0]
    try:
        yield server
    finally:
        drain = config.grace_seconds if grace is None else grace
        asyncio.run_coroutine_threadsafe(server.stop(drain), loop).result(timeout=drain + 60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
        # The stopped server's calls sit in reference cycles; freed only by a collection,
        # they keep gRPC aio's poller thread alive, and with it gRPC's fork handlers off
        # (see NodeServer.stop). Collect now, so the caller can fork safely.
        gc.collect()
