"""Talking to edge nodes over gRPC: channels, starting local nodes, verified shard reads.

Every chunk is verified end to end here, on the reader's side: the frame's
xxh3 must match its bytes and the checksum the node sent beside it, so bytes
damaged anywhere between the cache and this process are never decoded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from edgecache.cache.codec import decode_chunk
from edgecache.cache.errors import ChunkCorrupt
from edgecache.cache.frame import read_header
from edgecache.clients.channels import open_channel
from edgecache.v1 import edge_pb2, edge_pb2_grpc

__all__ = ["LocalNode", "connect", "read_shard", "start_local_node"]


def connect(address: str) -> edge_pb2_grpc.EdgeCacheStub:
    """A stub for the node at ``address`` (``host:port``, or ``grpcs://`` for TLS).

    The channel comes from :func:`~edgecache.clients.channels.open_channel`, so
    it has the same keepalive, message limits and retries as every client's.
    """
    return edge_pb2_grpc.EdgeCacheStub(open_channel(address))


def read_shard(
    stub: edge_pb2_grpc.EdgeCacheStub,
    dataset: str,
    version: int,
    shard: int,
    *,
    schema: pa.Schema | None = None,
    digest: str = "",
    start_chunk: int = 0,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Stream one shard's record batches, verifying every chunk."""
    request = edge_pb2.ReadShardRequest(
        dataset=dataset, version=version, shard=shard, start_chunk=start_chunk, digest=digest
    )
    for chunk in stub.ReadShard(request, metadata=metadata):
        if read_header(chunk.frame).checksum != chunk.checksum:
            raise ChunkCorrupt(
                f"{dataset}@{version} shard {shard} chunk {chunk.index}: the frame's checksum "
                "differs from the one the node sent; read it again from another node"
            )
        yield decode_chunk(chunk.frame, schema)


@dataclass
class LocalNode:
    """An ``edgecache serve`` subprocess on this machine."""

    region: str
    address: str
    process: subprocess.Popen[str]
    metrics_address: str = ""

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (graceful drain), then wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            if self.process.stdout is not None:  # the "serving on" pipe, read once at start
                self.process.stdout.close()


def _unless_given(args: Sequence[str], *defaults: tuple[str, str]) -> list[str]:
    """Each ``(flag, value)`` default whose flag ``args`` does not give (a flag is given once)."""
    given = {a.partition("=")[0] for a in args if a.startswith("--")}
    return [part for flag, value in defaults if flag not in given for part in (flag, value)]


def start_local_node(
    region: str,
    cache_dir: Path,
    registry: str,
    *,
    capacity: str = "4GiB",
    log_file: Path | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> LocalNode:
    """Start a node on a free loopback port and wait until it serves.

    ``extra_args`` are more ``edgecache serve`` flags; with ``--metrics-listen``
    the node's metrics address is read too. The node runs in a session of its
    own: a terminal's Ctrl-C goes to the caller alone, which stops its nodes
    (``LocalNode.stop``) as it ends; in the caller's process group the nodes
    died of it first, and the demo then failed with "region unreachable".
    """
    log = open(log_file, "a") if log_file else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgecache.clients.cli",
            "serve",
            "--region",
            region,
            "--cache-dir",
            str(cache_dir),
            "--registry",
            registry,
            *_unless_given(extra_args, ("--listen", "127.0.0.1:0"), ("--capacity", capacity)),
            *extra_args,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "EDGECACHE_SYNC": "false", **(env or {})},
        start_new_session=True,
    )
    if not isinstance(log, int):
        log.close()  # the child has its own copy of the descriptor
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
        if not line.startswith("serving on "):
            hint = f"; see {log_file}" if log_file else ""
            raise RuntimeError(f"edge node for {region} did not start{hint}")
        node = LocalNode(region=region, address=line.split()[-1], process=process)
        if "--metrics-listen" in extra_args:
            node.metrics_address = process.stdout.readline().split()[-1]
    except BaseException:
        # Not handed back, so no caller can stop it: a Ctrl-C or SIGTERM (SystemExit) that
        # lands while it starts left a node of its own session running, and its cache dir
        # written again after the caller removed it.
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
        raise
    return node
