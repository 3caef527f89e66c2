"""Object storage against moto's S3 server and fsspec backends."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import re
import socket
import threading
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3server import make_bucket, put_object

from edgecache.cache.errors import ObjectExists, ObjectNotFound, OriginChanged
from edgecache.cache.storage import FsspecStore, ObjectInfo, S3Store
from edgecache.cache.storage.base import verify as _verify
from edgecache.cache.storage.s3 import MIN_PART_BYTES, PART_SECONDS, STREAMS, LinkRate


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_s3_ranged_parallel_get_head_list_put(s3_endpoint: str) -> None:
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    body = os.urandom(1_000_003)
    put_object(s3_endpoint, bucket, "data/big.bin", body)
    url = f"s3://{bucket}/data/big.bin"

    async def scenario() -> None:
        store = S3Store(part_bytes=64 << 10, multipart_threshold=64 << 10)  # 16 parallel parts
        try:
            info = await store.head(url)
            assert info.size == len(body) and info.etag == hashlib.md5(body).hexdigest()
            # SDKs upload with a CRC32 by default; it is what GETs are checked against.
            assert info.crc32 == base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
            assert await store.get(url, expect=info) == body
            assert await store.get_range(url, 10, 20) == body[10:20]
            assert [o.url for o in await store.list(f"s3://{bucket}/data/")] == [url]
            stale = ObjectInfo(url=url, size=info.size, etag="0" * 32)
            with pytest.raises(OriginChanged, match="changed after the version was published"):
                await store.get(url, expect=stale)
            await store.put(f"s3://{bucket}/data/new", b"x", if_absent=True)
            with pytest.raises(ObjectExists):
                await store.put(f"s3://{bucket}/data/new", b"y", if_absent=True)
            with pytest.raises(ObjectNotFound):
                await store.head(f"s3://{bucket}/data/missing")
            assert store.stats.requests > 16
        finally:
            await store.close()

    run(scenario())


def test_bytes_are_checked_against_origin_checksums() -> None:
    data = b"training data" * 100
    md5 = hashlib.md5(data).hexdigest()
    sha = base64.b64encode(hashlib.sha256(data).digest()).decode()
    flipped = b"Training data" + data[13:]
    assert _verify(data, ObjectInfo("s3://b/k", len(data), md5)) is None
    assert "MD5" in (_verify(flipped, ObjectInfo("s3://b/k", len(data), md5)) or "")
    assert "SHA-256" in (_verify(flipped, ObjectInfo("s3://b/k", len(data), "abc-2", sha)) or "")
    assert (
        _verify(flipped, ObjectInfo("s3://b/k", len(data), "abc-2", "xyz-3")) is None
    )  # composite
    assert "bytes" in (_verify(data[:-1], ObjectInfo("s3://b/k", len(data), md5)) or "")
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    assert _verify(data, ObjectInfo("s3://b/k", len(data), "abc-2", crc32=crc)) is None
    assert "CRC32" in (_verify(flipped, ObjectInfo("s3://b/k", len(data), md5, crc32=crc)) or "")
    # The CRC32 (cheapest) is the one checked when origin gives several.
    assert "CRC32" in (_verify(flipped, ObjectInfo("s3://b/k", len(data), md5, sha, crc)) or "")


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_fsspec_store(tmp_path: Path, scheme: str) -> None:
    root = f"file://{tmp_path}" if scheme == "file" else f"memory://edgecache-{uuid.uuid4().hex}"

    async def scenario() -> None:
        store = FsspecStore()
        await store.put(f"{root}/a/one", b"1", if_absent=True)
        with pytest.raises(ObjectExists):
            await store.put(f"{root}/a/one", b"2", if_absent=True)
        await store.put(f"{root}/a/two", b"22")
        listed = await store.list(f"{root}/a/")
        assert [o.url.rsplit("/", 1)[-1] for o in listed] == ["one", "two"]
        info = await store.head(f"{root}/a/two")
        assert info.size == 2 and info.etag
        assert await store.get(f"{root}/a/two", expect=info) == b"22"
        with pytest.raises(ObjectNotFound):
            await store.get(f"{root}/a/three")
        assert await store.list(f"{root}/nothing/") == []

    run(scenario())


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_create_only_writes_honour_the_umask(tmp_path: Path, umask: int) -> None:
    # A node running as another user (the image's uid 10001) must be able to read the
    # registry files publish wrote: create-only writes get 0666 minus the umask, exactly
    # like a plain write, never mkstemp's 0600.
    store = FsspecStore()
    old = os.umask(umask)
    try:
        run(store.put(f"file://{tmp_path}/versions/2.json", b"{}", if_absent=True))
        run(store.put(f"file://{tmp_path}/latest", b"2"))
    finally:
        os.umask(old)
    created = (tmp_path / "versions" / "2.json").stat().st_mode & 0o777
    plain = (tmp_path / "latest").stat().st_mode & 0o777
    assert created == plain == 0o666 & ~umask
    assert not [p for p in (tmp_path / "versions").iterdir() if p.name.startswith(".tmp-")]


# ---- part sizing from the measured stream rate ----------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _link(bytes_per_second: float) -> LinkRate:
    """A LinkRate that has seen one second of GETs at ``bytes_per_second``."""
    clock = _Clock()
    link = LinkRate(clock=clock)
    link.started()
    clock.now += 1.0
    link.finished(int(bytes_per_second))
    return link


def test_link_rate_counts_the_seconds_a_get_was_running_only() -> None:
    clock = _Clock()
    link = LinkRate(window=2.0, clock=clock)
    assert link.bytes_per_second == 0  # nothing measured yet
    link.started()
    link.started()  # two GETs share the link for a second
    clock.now += 1.0
    link.finished(4 << 20)
    link.finished(4 << 20)
    assert link.bytes_per_second == 8 << 20
    clock.now += 30.0  # staging preprocessed for a while: no GET ran, the link was idle
    assert link.bytes_per_second == 8 << 20
    link.started()
    clock.now += 0.5
    link.finished(0)  # a failed GET: its time counts, no bytes
    assert link.bytes_per_second == (8 << 20) / 1.5
    link.started()
    clock.now += 2.0
    link.finished(1 << 20)  # the window is 2 s of use: the first second has left it
    assert link.bytes_per_second == (1 << 20) / 2.0
    tiny = LinkRate(clock=clock)
    tiny.started()
    clock.now += 1.0
    tiny.finished(100 << 10)
    assert tiny.bytes_per_second == 0  # too little to say anything about rate


def test_parts_are_sized_from_what_the_link_delivers() -> None:
    store = S3Store()
    size = 24 << 20
    assert store.part_size(size, "b") == 2 << 20  # unmeasured: as for a long path, 12 parts
    store.rates["b"] = _link(12e6)  # a 100 Mbit/s path
    assert store.part_size(size, "b") == 2 << 20
    store.rates["b"] = _link(100e6)
    assert store.part_size(size, "b") == int(100e6 / STREAMS * PART_SECONDS)  # ~6 MB parts
    store.rates["b"] = _link(2e9)  # a local store: whole objects
    assert store.part_size(size, "b") >= size
    assert store.part_size(size, "other") == 2 << 20  # each bucket is measured on its own
    assert S3Store(adaptive_parts=False, part_bytes=1 << 20).part_size(1 << 30) == 1 << 20
    held = S3Store(adaptive_parts=False)
    held.rates["b"] = _link(2e9)
    assert held.part_size(size, "b") == 2 << 20


def test_a_fast_origin_gets_whole_objects_a_slow_one_parts(s3_endpoint: str) -> None:
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    body = os.urandom(9 << 20)  # above MULTIPART_THRESHOLD
    put_object(s3_endpoint, bucket, "big.bin", body)
    url = f"s3://{bucket}/big.bin"

    async def scenario() -> None:
        store = S3Store()
        try:
            info = await store.head(url)
            before = store.stats.requests
            assert await store.get(url, expect=info) == body
            parts = store.stats.requests - before
            assert parts == -(-len(body) // MIN_PART_BYTES)  # unmeasured: 1 MiB parts
            measured = store.rates[bucket]
            assert measured.samples == parts and measured.bytes_per_second > 0
            store.rates[bucket] = _link(4 * STREAMS * len(body) / PART_SECONDS)  # a fast link
            before = store.stats.requests
            assert await store.get(url, expect=info) == body
            assert store.stats.requests - before == 1  # whole, If-Match and checksum as ever
            store.rates[bucket] = _link(1e6)  # a slow path again
            before = store.stats.requests
            assert await store.get(url, expect=info) == body
            assert store.stats.requests - before == parts
        finally:
            await store.close()

    run(scenario())


def test_an_object_rewritten_between_heads_and_get_is_read_again(s3_endpoint: str) -> None:
    """state.json rewritten by the controller between a reader's HEAD and its GET: the GET's
    If-Match on the HEAD's ETag failed and the reader was told the object 'changed after
    the version was published' (a helper's hunt, 2 reads in 296 beside a controller). With
    no content promised (no ``expect``) it reads what is there now; one promised still fails."""
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    put_object(s3_endpoint, bucket, "state.json", b"old")
    url = f"s3://{bucket}/state.json"

    async def scenario() -> None:
        store = S3Store()
        head = store.head
        rewrites = [b"new"]

        async def head_then_rewrite(target: str) -> ObjectInfo:
            info = await head(target)
            if rewrites:  # the writer saves once, right after the reader's HEAD
                put_object(s3_endpoint, bucket, "state.json", rewrites.pop())
            return info

        store.head = head_then_rewrite  # type: ignore[method-assign]
        try:
            assert await store.get(url) == b"new"
            promised = await head(url)
            put_object(s3_endpoint, bucket, "state.json", b"newer")
            with pytest.raises(OriginChanged):
                await store.get(url, expect=promised)
        finally:
            await store.close()

    run(scenario())


@pytest.fixture
def silent_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[socket.socket]]:
    """An S3 endpoint that accepts connections and never answers; the connections it took.

    Counting them counts the tries made (each try after no answer is a new connection).
    """
    from s3server import s3_env

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(512)
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    for key, value in s3_env(f"http://127.0.0.1:{server.getsockname()[1]}").items():
        monkeypatch.setenv(key, value)
    try:
        yield accepted
    finally:
        server.close()
        for conn in accepted:
            conn.close()


def test_an_endpoint_that_never_answers_fails_after_botocores_tries_each_one_logged(
    silent_endpoint: list[socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    """A server that accepts connections and never answers: botocore's tries, no more.

    Each read timeout was tried again here on top of botocore's own tries: 6 × 6
    tries of 30 s, `edgecache versions` silent for 18 minutes (seen with a hung
    registry).
    """
    from edgecache.cache.errors import OriginError

    store = S3Store(attempts=3, read_timeout=0.5)
    caplog.set_level("WARNING", logger="edgecache.cache.storage.s3")
    try:
        with pytest.raises(OriginError, match=r"did not answer within 0.5 s, 3 tries") as err:
            run(store.list("s3://reg/edgecache/tokens/versions/"))
        assert "AWS_ENDPOINT_URL" in str(err.value)
        # The registry's callers tell "unreachable" from a refusal by this cause.
        assert isinstance(err.value.__cause__, ConnectionError)
        assert len(silent_endpoint) == 3
        said = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
        assert len(said) == 2 and "(try 1 of 3)" in said[0], said
    finally:
        run(store.close())


def test_tries_botocores_retry_quota_stops_are_neither_logged_nor_claimed(
    silent_endpoint: list[socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    """A review: 30 calls at once to a server that never answers (a node's staging) ran into
    botocore's retry quota after 50 retries, yet every call logged "trying again" up to its
    6th try and its error claimed 6 tries; the retries were not counted in the stats."""
    store = S3Store(attempts=6, read_timeout=0.3)
    caplog.set_level("WARNING", logger="edgecache.cache.storage.s3")

    async def heads() -> list[BaseException]:
        calls = (store.head(f"s3://b/k{i}") for i in range(30))
        return await asyncio.gather(*calls, return_exceptions=True)  # type: ignore[arg-type]

    try:
        errors = run(heads())
        said = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
        claimed = [int(re.search(r", (\d+) tr(y|ies) \(", str(e)).group(1)) for e in errors]
        tries = len(silent_endpoint)
        assert sum(claimed) == tries, (claimed, tries)
        assert len(said) == store.stats.retries == tries - 30, (len(said), tries)
        assert tries < 30 * 6  # the quota did stop it short
    finally:
        run(store.close())
