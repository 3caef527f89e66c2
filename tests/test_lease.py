"""The controller's lease: one holder at a time, on a filesystem registry and on S3."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from s3server import make_bucket

from edgecache.cache.lease import UNLISTED_HOLDER, Lease
from edgecache.cache.storage import FsspecStore, S3Store


def stores(tmp_path: Path, s3_endpoint: str | None) -> list[tuple[object, str]]:
    out: list[tuple[object, str]] = [(FsspecStore(), f"file://{tmp_path}/registry/_controller")]
    if s3_endpoint:
        bucket = f"lease-{uuid.uuid4().hex[:10]}"
        make_bucket(s3_endpoint, bucket)
        out.append((S3Store(), f"s3://{bucket}/_edgecache/_controller"))
    return out


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_one_holder_renewal_expiry_release(tmp_path: Path, backend: str, request) -> None:
    endpoint = request.getfixturevalue("s3_endpoint") if backend == "s3" else None
    store, prefix = stores(tmp_path, endpoint)[-1]

    async def scenario() -> None:
        a = Lease(store, prefix, "controller-a", ttl=10)  # type: ignore[arg-type]
        b = Lease(store, prefix, "controller-b", ttl=10)  # type: ignore[arg-type]
        t = 1_000_000.0
        assert await a.acquire(now=t) is None  # a holds it
        held = await b.acquire(now=t + 1)
        assert held is not None and held.holder == "controller-a"  # b is refused, told who
        assert await a.acquire(now=t + 5) is None  # a renews
        refused = await b.acquire(now=t + 12)  # a's renewal runs to t + 15
        assert refused is not None and refused.holder == "controller-a"
        assert await b.acquire(now=t + 16) is None  # a stopped renewing: b takes over
        lost = await a.acquire(now=t + 17)  # a, back from a pause, finds it lost
        assert lost is not None and lost.holder == "controller-b" and a.generation is None
        await b.release()
        assert await a.acquire(now=t + 18) is None  # released: free at once
        for _ in range(20):
            assert await a.acquire(now=t + 19) is None
        listed = await store.list(prefix + "/")  # type: ignore[attr-defined]
        assert len(listed) <= 13  # old generations are deleted as new ones are written
        await store.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_racing_contenders_get_one_winner(tmp_path: Path) -> None:
    store, prefix = stores(tmp_path, None)[0]

    async def scenario() -> list[bool]:
        leases = [Lease(store, prefix, f"c{i}", ttl=30) for i in range(8)]  # type: ignore[arg-type]
        results = await asyncio.gather(*(lease.acquire(now=5.0) for lease in leases))
        return [r is None for r in results]

    won = asyncio.run(scenario())
    assert sum(won) == 1


def test_gained_tells_a_lease_taken_anew_from_a_renewal(tmp_path: Path) -> None:
    # A holder that takes the lease anew may find what it guards changed by another
    # holder in between; a renewal (even of an expired generation) may not.
    store, prefix = stores(tmp_path, None)[0]

    async def scenario() -> None:
        a = Lease(store, prefix, "a", ttl=10)  # type: ignore[arg-type]
        b = Lease(store, prefix, "b", ttl=10)  # type: ignore[arg-type]
        t = 1_000_000.0
        assert await a.acquire(now=t) is None and a.gained  # first taken
        assert await a.acquire(now=t + 5) is None and not a.gained  # renewed
        assert await a.acquire(now=t + 30) is None and not a.gained  # expired, nobody took it
        assert await b.acquire(now=t + 50) is None and b.gained  # taken over
        assert await a.acquire(now=t + 51) is not None  # refused: b holds it
        await b.release()
        assert await a.acquire(now=t + 52) is None and a.gained  # taken again after b
        await a.release()
        assert await a.acquire(now=t + 53) is None and a.gained  # released, taken again
        await store.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


class _Unlisting:
    """A store whose listing shows nothing (an eventually consistent one, before it catches up)."""

    def __init__(self, store: FsspecStore) -> None:
        self.store = store

    async def list(self, prefix: str) -> list[object]:
        return []

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def test_a_write_lost_to_a_record_not_listed_yet_is_not_a_lease_held(tmp_path: Path) -> None:
    # b lost the create-only write of generation 1 to a, but its store did not list a's
    # record: acquire read that as "nobody holds it" and said b held the lease beside a.
    store, prefix = stores(tmp_path, None)[0]

    async def scenario() -> None:
        a = Lease(store, prefix, "a", ttl=10)  # type: ignore[arg-type]
        b = Lease(_Unlisting(store), prefix, "b", ttl=10)  # type: ignore[arg-type]
        t = 1_000_000.0
        assert await a.acquire(now=t) is None  # a holds generation 1
        held = await b.acquire(now=t + 1)
        assert held is not None and held.holder == UNLISTED_HOLDER, held
        assert b.generation is None
        assert await a.acquire(now=t + 2) is None  # a still holds it, and renews
        await store.close()

    asyncio.run(scenario())
