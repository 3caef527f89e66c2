"""Publishing and reading versions as operators meet it, against real registries.

Publishers racing for one dataset (processes through the CLI, threads each with
a Registry of its own) on ``file://`` and on moto's S3 server over HTTP: each
gets a version of its own, no manifest is written over, and ``latest`` never
moves back. Then a registry whose ``name@N`` was rewritten after a node cached
it: the node notices, serves neither the old nor the new content as ``name@N``
and says what to do.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from edgeutil import node_settings, publish, read_shard_table, stub, write_parquet_shards
from s3server import make_bucket, upload_dir

from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.cache.storage import FsspecStore, ObjectStore, Stores
from edgecache.edge import versions as versions_module
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb


@pytest.fixture(params=["file", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(registry URL, a URL prefix sources go under), on a local disk or moto's S3."""
    if request.param == "file":
        return f"file://{tmp_path}/registry", f"file://{tmp_path}/sources"
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"reg-{uuid.uuid4().hex[:12]}"
    make_bucket(endpoint, bucket)
    request.node.stash_endpoint = (endpoint, bucket)
    return f"s3://{bucket}/_edgecache", f"s3://{bucket}/sources"


def sources(tmp_path: Path, where: tuple[str, str], count: int, request) -> list[str]:  # noqa: ANN001
    """``count`` source prefixes of different content (rows differ), uploaded where asked."""
    urls = []
    for i in range(count):
        local = tmp_path / "sources" / f"s{i}"  # each source's shard: 10 + i rows
        write_parquet_shards(local, 1, rows=10 + i)
        if where[1].startswith("s3://"):
            endpoint, bucket = request.node.stash_endpoint
            upload_dir(endpoint, bucket, f"sources/s{i}", local)
        urls.append(f"{where[1]}/s{i}")
    return urls


def read_latest(registry: str, dataset: str) -> bytes:
    url = f"{registry}/{dataset}/latest"

    async def go(reg: Registry) -> bytes:
        return await reg._store(url).get(url)

    return Registry.run(registry, go)


def test_publishers_in_separate_processes_each_get_their_own_version(
    tmp_path: Path, where: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    """Four `edgecache publish` at once: four versions, each holding what its publisher
    printed, none written over; `latest` names the newest."""
    registry = where[0]
    urls = sources(tmp_path, where, 4, request)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "edgecache.clients.cli", "publish", url]
            + ["--dataset", "raced", "--registry", registry, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for url in urls
    ]
    printed = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        printed.append(json.loads(out))
    assert sorted(p["version"] for p in printed) == ["raced@1", "raced@2", "raced@3", "raced@4"]
    assert len({p["digest"] for p in printed}) == 4  # four contents

    async def check(reg: Registry) -> None:
        assert await reg.versions("raced") == [1, 2, 3, 4]
        for each in printed:
            number = int(each["version"].split("@")[1])
            assert (await reg.manifest("raced", number)).digest == each["digest"]

    Registry.run(registry, check)
    assert read_latest(registry, "raced") == b"4\n"


class _Paused(ObjectStore):
    """A real store whose writes to a ``latest`` pointer wait for ``go`` (a test hook)."""

    def __init__(self, inner: ObjectStore, at: threading.Event, go: threading.Event) -> None:
        self.inner, self.at, self.go = inner, at, go
        self.stats = inner.stats

    async def _wait(self, url: str) -> None:
        if url.endswith("/latest"):
            self.at.set()
            await asyncio.to_thread(self.go.wait, 60)

    async def head(self, url: str):  # noqa: ANN201
        return await self.inner.head(url)

    async def list(self, prefix_url: str):  # noqa: ANN201
        return await self.inner.list(prefix_url)

    async def get(self, url: str, **kw):  # noqa: ANN003, ANN201
        return await self.inner.get(url, **kw)

    async def get_range(self, url: str, start: int, end: int) -> bytes:
        return await self.inner.get_range(url, start, end)

    async def put(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        await self._wait(url)
        await self.inner.put(url, data, if_absent=if_absent)

    async def update(self, url: str, change: Callable[[bytes | None], bytes | None]) -> None:
        await self._wait(url)
        await self.inner.update(url, change)

    async def delete(self, url: str) -> None:
        await self.inner.delete(url)


class _PausedStores(Stores):
    def __init__(self, at: threading.Event, go: threading.Event) -> None:
        super().__init__()
        self.at, self.go = at, go

    def for_url(self, url: str) -> ObjectStore:
        return _Paused(super().for_url(url), self.at, self.go)


def test_latest_never_moves_back_when_publishers_finish_out_of_order(
    tmp_path: Path, where: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    """A claims @1 and is slow to move `latest`; B publishes @2 meanwhile. When A's
    pointer write lands, `latest` must still say 2."""
    registry = where[0]
    first, second = sources(tmp_path, where, 2, request)
    at, go = threading.Event(), threading.Event()
    result: dict[str, int] = {}

    def slow() -> None:
        async def run() -> None:
            stores = _PausedStores(at, go)
            try:
                published = await Registry(registry, stores).publish(
                    first, "ordered", spec=preprocess_spec()
                )
                result["slow"] = published.version
            finally:
                await stores.close()  # not the registry's own: it leaves them open

        asyncio.run(run())

    thread = threading.Thread(target=slow)
    thread.start()
    try:
        assert at.wait(60), "the slow publisher never reached its latest pointer"
        fast = Registry.run(
            registry, lambda reg: reg.publish(second, "ordered", spec=preprocess_spec())
        )
    finally:
        go.set()
        thread.join(60)
    assert (result["slow"], fast.version) == (1, 2)
    assert read_latest(registry, "ordered") == b"2\n"
    assert Registry.run(registry, lambda reg: reg.latest("ordered")) == 2


def test_local_updates_take_turns(tmp_path: Path) -> None:
    """Eight threads each add one to a counter 25 times through update(): none is lost."""
    url = f"file://{tmp_path}/counter"

    def add() -> None:
        async def run() -> None:
            store = FsspecStore()
            for _ in range(25):
                await store.update(url, lambda old: str(int(old or b"0") + 1).encode())

        asyncio.run(run())

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (tmp_path / "counter").read_bytes() == b"200"


# ------------------------------------------------------- a version changed under a node


def rewrite_version(registry: str, dataset: str, source: str) -> str:
    """A registry reset: every object of ``dataset`` removed, ``source`` published as @1.

    Returns the new @1's digest.
    """

    async def reset(reg: Registry) -> str:
        prefix = f"{reg.url}/{dataset}/"
        store = reg._store(prefix)
        for obj in await store.list(prefix):
            await store.delete(obj.url)
        published = await reg.publish(source, dataset, spec=preprocess_spec(chunk_bytes=1 << 16))
        assert published.version == 1
        return published.digest

    return Registry.run(registry, reset)


def failure(call: Callable[[], object]) -> grpc.RpcError:
    try:
        result = call()
        if not isinstance(result, (bytes, str)) and hasattr(result, "__iter__"):
            list(result)  # type: ignore[call-overload]
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def test_a_node_refuses_a_version_the_registry_changed_until_it_is_evicted(
    tmp_path: Path,
    where: tuple[str, str],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tokens@1 is staged on node X; the registry is reset and tokens@1 published again
    with other rows. A reader resolving through a fresh node Y gets the new digest.
    X must not serve its old shards as tokens@1 to anyone once it noticed, must say
    what happened and what to do, and serve the registry's tokens@1 once evicted."""
    monkeypatch.setattr(versions_module, "MANIFEST_RECHECK_SECONDS", 0.0)
    registry = where[0]
    old_source, new_source = sources(tmp_path, where, 2, request)
    old = publish(registry, old_source, "tokens")
    with running_node(node_settings(tmp_path / "x", registry)) as x:
        cx = stub(x.address)
        assert list(cx.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))[-1].finished
        assert read_shard_table(cx, "tokens", 1, 0).num_rows == 10
        new_digest = rewrite_version(registry, "tokens", new_source)
        assert new_digest != old.digest
        with running_node(node_settings(tmp_path / "y", registry)) as y:
            resolved = stub(y.address).ResolveVersion(
                edge_pb2.ResolveVersionRequest(dataset="tokens", version="latest")
            )
            assert (resolved.version, resolved.digest) == (1, new_digest)

        # The reader holding the new digest asks X: never the old shards under it.
        def read_new() -> object:
            return cx.ReadShard(
                edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0, digest=new_digest)
            )

        deadline = time.monotonic() + 20
        while True:
            err = failure(read_new)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
            if "changed in the registry" in (err.details() or "") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        said = err.details() or ""
        for part in (
            "tokens@1 was changed in the registry",
            old.digest,
            new_digest,
            "edgecache publish",
            "edgecache evict tokens@1",
        ):
            assert part in said, said
        # Nor the old content to anyone else, nor the old digest to a job starting now.
        for call in (
            lambda: cx.ReadShard(edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0)),
            lambda: cx.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="tokens")),
            lambda: cx.GetManifest(edge_pb2.GetManifestRequest(dataset="tokens", version=1)),
        ):
            err = failure(call)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "changed in the registry" in (err.details() or ""), err.details()

        cx.Evict(edge_pb2.EvictRequest(dataset="tokens", version=1))
        resolved = cx.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="tokens"))
        assert (resolved.version, resolved.digest) == (1, new_digest)
        table = read_shard_table(cx, "tokens", 1, 0)
        assert table.num_rows == 11  # the new source's rows, fetched again
    # A restarted X keeps the registry's manifest, not the old one.
    with running_node(node_settings(tmp_path / "x", registry)) as x:
        resolved = stub(x.address).ResolveVersion(
            edge_pb2.ResolveVersionRequest(dataset="tokens", version="1")
        )
        assert resolved.digest == new_digest


def test_a_reader_with_the_registrys_new_digest_is_told_at_once_not_blamed(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The first read holding the registry's new digest asks the registry there and then:
    no background check needed (it ran every 10 s, and until it had, the reader was told
    "the registry and the reader disagree", blaming the reader). A digest that neither
    the node nor the registry holds says to resolve the version again."""
    registry = f"file://{tmp_path}/registry"
    where = (registry, f"file://{tmp_path}/sources")
    old_source, new_source = sources(tmp_path, where, 2, request)
    publish(registry, old_source, "tokens")
    with running_node(node_settings(tmp_path / "x", registry)) as x:
        cx = stub(x.address)
        assert list(cx.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))[-1].finished
        new_digest = rewrite_version(registry, "tokens", new_source)
        err = failure(
            lambda: cx.ReadShard(
                edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0, digest=new_digest)
            )
        )
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tokens@1 was changed in the registry" in (err.details() or ""), err.details()
        cx.Evict(edge_pb2.EvictRequest(dataset="tokens", version=1))
        err = failure(
            lambda: cx.ReadShard(
                edge_pb2.ReadShardRequest(
                    dataset="tokens", version=1, shard=0, digest="sha256:" + "f" * 64
                )
            )
        )
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        said = err.details() or ""
        assert "resolve the version again" in said and new_digest in said, said
        assert "changed in the registry" not in said, said


def test_a_node_whose_copy_agrees_with_the_registry_asks_it_at_job_start_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing changed: ResolveVersion asks the registry (a job pins what it holds now),
    and the node keeps serving from its own copy when the registry is gone."""
    registry = f"file://{tmp_path}/registry"
    (source,) = sources(tmp_path, (registry, f"file://{tmp_path}/sources"), 1, None)
    published = publish(registry, source, "tokens")
    with running_node(node_settings(tmp_path / "x", registry)) as x:
        cx = stub(x.address)
        assert list(cx.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))[-1].finished
        (tmp_path / "registry").rename(tmp_path / "away")
        resolved = cx.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="tokens", version="1"))
        assert resolved.digest == published.digest
        assert read_shard_table(cx, "tokens", 1, 0).num_rows == 10


def test_a_versions_publish_time_is_when_it_was_written_not_when_it_was_built(
    tmp_path: Path,
) -> None:
    """`created_at` says which version a job that started at some time read
    (clients/ops/at_start.py). Stamped when the manifest was built, a job that
    started while the publisher was still reading shards was matched to a version
    it could not yet see."""
    registry = f"file://{tmp_path}/registry"
    (source,) = sources(tmp_path, ("", f"file://{tmp_path}/sources"), 1, None)
    first = Registry.run(
        registry, lambda reg: reg.publish(source, "stamped", spec=preprocess_spec())
    )
    built_long_ago = pb.Manifest()
    built_long_ago.CopyFrom(first)
    built_long_ago.created_at.FromDatetime(datetime(2020, 1, 1, tzinfo=UTC))
    before = datetime.now(UTC)
    written = Registry.run(registry, lambda reg: reg.commit(built_long_ago))
    stored = Registry.run(registry, lambda reg: reg.manifest("stamped", written.version))
    assert written.version == 2
    assert stored.created_at.ToDatetime(UTC) >= before - timedelta(seconds=1)
    assert stored.created_at == written.created_at and stored.digest == first.digest
