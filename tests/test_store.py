import os
import shutil
import subprocess
import sys
import tempfile
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import lmdb
import pyarrow as pa
import pytest
from datagen import TOKEN_SCHEMA
from storeutil import flip_on_disk, shard_frames

from edgecache.cache.errors import (
    CacheDirError,
    CacheFull,
    ChunkCorrupt,
    ChunkTruncated,
    EmptyShard,
    InvalidName,
    ReadOnlyStore,
    ShardNotCached,
    ShardTooLarge,
    StoreForked,
    WriterLocked,
)
from edgecache.cache.keys import ShardKey
from edgecache.cache.store import REAP_EVERY, CacheStore

K = ShardKey("tokens", 1, 0)
FUTURE = datetime.now(UTC) + timedelta(days=1)


def test_put_then_read_back(store: CacheStore) -> None:
    frames = shard_frames()
    info = store.put_shard(K, frames)
    assert info.chunk_count == len(frames) and info.row_count == 2000
    assert store.get_chunk(K, 0) == frames[0]
    assert list(store.iter_chunks(K, start=1)) == frames[1:]
    with store.read_shard(K) as reader:
        table = pa.Table.from_batches(list(reader.batches(TOKEN_SCHEMA)))
        assert table.column("label").to_pylist() == list(range(2000))
    assert store.stats.hits == 3 and store.stats.misses == 0


def test_miss_is_counted_and_named(store: CacheStore) -> None:
    with pytest.raises(ShardNotCached, match=r"tokens@1/shard-0 is not in the cache"):
        store.read_shard(K)
    with pytest.raises(KeyError):
        store.get_chunk(K, 0)
    assert store.stats.misses == 2
    assert store.shard_info(K) is None and not store.contains(K)


def test_listing_and_accounting(store: CacheStore) -> None:
    for shard in range(3):
        store.put_shard(ShardKey("tokens", 2, shard), shard_frames(seed=shard))
    store.put_shard(ShardKey("images", 1, 0), shard_frames())
    versions = {(v.dataset, v.version): v for v in store.versions()}
    assert set(versions) == {("images", 1), ("tokens", 2)}
    assert versions["tokens", 2].shard_count == 3
    assert [s.key.shard for s in store.shards("tokens", 2)] == [0, 1, 2]
    total = sum(v.stored_bytes for v in versions.values())
    assert store.stats.used_bytes == total and store.stats.shard_count == 4
    assert store.datasets() == ["images", "tokens"]
    assert store.evict_version("tokens", 2) == versions["tokens", 2].stored_bytes
    assert store.stats.used_bytes == versions["images", 1].stored_bytes
    assert store.shards("tokens", 2) == []


def test_replacing_a_shard_keeps_accounting(store: CacheStore) -> None:
    store.put_shard(K, shard_frames(seed=1))
    info = store.put_shard(K, shard_frames(rows=500, seed=2))
    assert store.stats.used_bytes == info.stored_bytes
    assert store.versions()[0].shard_count == 1


def test_lru_eviction_of_unpinned_shards(tmp_path: Path) -> None:
    frames = shard_frames()
    size = sum(map(len, frames))
    with CacheStore(tmp_path / "c", capacity_bytes=int(size * 3.5), sync=False) as s:
        for shard in range(3):
            s.put_shard(ShardKey("a", 1, shard), frames)
        s.get_chunk(ShardKey("a", 1, 0), 0)  # shard 0 is now more recent than 1
        first, second = s.shard_info(ShardKey("a", 1, 0)), s.shard_info(ShardKey("a", 1, 1))
        assert first and second and first.last_access > second.last_access
        s.put_shard(ShardKey("b", 1, 0), frames)
        resident = {
            (i.key.dataset, i.key.shard)
            for v in s.versions()
            for i in s.shards(v.dataset, v.version)
        }
        assert resident == {("a", 0), ("a", 2), ("b", 0)}
        assert s.stats.evicted_shards == 1
        assert s.stats.used_bytes <= s.capacity_bytes


def test_reopened_with_less_capacity_fits_lru_first_and_keeps_pins(tmp_path: Path) -> None:
    """A cache opened with less capacity than it holds evicts as a write would, at once."""
    frames = shard_frames()
    size = sum(map(len, frames))
    with CacheStore(tmp_path / "c", capacity_bytes=size * 10, sync=False) as s:
        s.pin_version("keep", 1, FUTURE)
        s.put_shard(ShardKey("keep", 1, 0), frames)
        for shard in range(3):
            s.put_shard(ShardKey("a", 1, shard), frames)
        s.get_chunk(ShardKey("a", 1, 0), 0)  # shard 0 is now the most recent of a@1
    with CacheStore(tmp_path / "c", capacity_bytes=int(size * 2.5), sync=False) as s:
        fitted = s.fit_capacity()
        assert (fitted.used_bytes, fitted.evicted_shards) == (4 * size, 2)
        assert fitted.held_after == 2 * size <= s.capacity_bytes
        assert [(v.dataset, v.version) for v in fitted.pinned] == [("keep", 1)]
        assert [i.key.shard for i in s.shards("a", 1)] == [0]
        assert len(s.shards("keep", 1)) == 1
        assert (s.stats.evicted_shards, s.stats.evicted_bytes) == (2, 2 * size)
        assert s.fit_capacity().evicted_shards == 0  # within it now: nothing more goes
    with CacheStore(tmp_path / "c", capacity_bytes=size // 2, sync=False) as s:
        fitted = s.fit_capacity()  # the pinned shard alone is over: it stays, and says so
        assert fitted.held_after == size > s.capacity_bytes
        assert len(s.shards("keep", 1)) == 1 and s.shards("a", 1) == []
        # A new shard is refused, saying the cache is over its capacity ("only -14.2 KiB
        # is free", it said).
        with pytest.raises(CacheFull, match="over its capacity of") as refused:
            s.put_shard(ShardKey("a", 1, 5), shard_frames(rows=200))
        assert "is free" not in str(refused.value), refused.value


def test_pins_block_eviction_and_are_named(tmp_path: Path) -> None:
    frames = shard_frames()
    size = sum(map(len, frames))
    with CacheStore(tmp_path / "c", capacity_bytes=int(size * 2.5), sync=False) as s:
        s.pin_version("keep", 3, FUTURE)
        s.put_shard(ShardKey("keep", 3, 0), frames)
        s.put_shard(ShardKey("keep", 3, 1), frames)
        with pytest.raises(CacheFull, match=r"pinned: keep@3 .*Unpin or evict"):
            s.put_shard(ShardKey("new", 1, 0), frames)
        assert len(s.shards("keep", 3)) == 2  # nothing partial, nothing lost
        assert s.shards("new", 1) == []
        s.pin_version("keep", 3, None)
        s.put_shard(ShardKey("new", 1, 0), frames)
        assert len(s.shards("keep", 3)) == 1


def test_expired_pin_no_longer_protects(tmp_path: Path) -> None:
    frames = shard_frames()
    size = sum(map(len, frames))
    with CacheStore(tmp_path / "c", capacity_bytes=int(size * 1.5), sync=False) as s:
        s.pin_version("old", 1, datetime.now(UTC) - timedelta(seconds=1))
        s.put_shard(ShardKey("old", 1, 0), frames)
        s.put_shard(ShardKey("new", 1, 0), frames)
        assert s.shards("old", 1) == []


def test_pin_needs_timezone(store: CacheStore) -> None:
    with pytest.raises(ValueError, match="timezone"):
        store.pin_version("a", 1, datetime(2030, 1, 1))


def test_extend_pin_only_lengthens(store: CacheStore) -> None:
    later, sooner = datetime(2030, 1, 2, tzinfo=UTC), datetime(2030, 1, 1, tzinfo=UTC)
    store.extend_pin("a", 1, later)  # pins a version with no shard yet, as pin_version does
    store.extend_pin("a", 1, sooner)
    (held,) = store.versions()
    assert held.pinned_until == later
    with pytest.raises(ValueError, match="timezone"):
        store.extend_pin("a", 1, datetime(2030, 1, 3))


def test_shard_larger_than_capacity(tmp_path: Path) -> None:
    with CacheStore(tmp_path / "c", capacity_bytes=10_000, sync=False) as s:
        with pytest.raises(ShardTooLarge, match="larger than the whole cache capacity"):
            s.put_shard(K, shard_frames())
        assert s.stats.used_bytes == 0


def test_empty_and_damaged_input_is_refused(store: CacheStore) -> None:
    with pytest.raises(EmptyShard):
        store.put_shard(K, [])
    frames = shard_frames()
    frames[1] = frames[1][:-5]
    with pytest.raises(ChunkTruncated):
        store.put_shard(K, frames)
    assert store.shard_info(K) is None
    with pytest.raises(InvalidName):
        store.put_shard(ShardKey("../x", 1, 0), shard_frames())
    with pytest.raises(ValueError, match="version"):
        store.put_shard(ShardKey("a", 0, 0), shard_frames())
    store.put_shard(K, shard_frames())
    with pytest.raises(IndexError, match="chunk 99 does not exist"):
        store.get_chunk(K, 99)


def test_bit_rot_in_lmdb_is_detected_and_shard_dropped(tmp_path: Path) -> None:
    frames = shard_frames()
    with CacheStore(tmp_path / "c", capacity_bytes=64 << 20, sync=False) as s:
        s.put_shard(K, frames)
    flip_on_disk(tmp_path / "c", frames[2], offset=1000)
    with CacheStore(tmp_path / "c", sync=False) as s:
        assert s.get_chunk(K, 1) == frames[1]  # other chunks still fine
        with pytest.raises(ChunkCorrupt, match="chunk 2: chunk checksum mismatch"):
            s.get_chunk(K, 2)
        assert s.shard_info(K) is None  # dropped: the next read is a miss and refetches
        assert s.stats.corrupt_chunks == 1 and s.stats.used_bytes == 0


@pytest.mark.parametrize(
    ("field", "offset", "bit"),
    [
        ("magic", 1, 0),
        ("format", 2, 1),
        ("codec", 3, 2),
        ("rows", 5, 0),
        ("payload_len: claims 2 GiB more", 11, 7),
        ("payload_len: claims less", -1, -1),
        ("raw_len", 17, 3),
        ("checksum", 30, 6),
    ],
)
def test_damaged_header_field_drops_the_shard(
    tmp_path: Path, field: str, offset: int, bit: int
) -> None:
    # A damaged length field is damage like any other: the same ChunkCorrupt, the shard
    # dropped, the corrupt counter up (a lying payload_len used to escape as a sibling).
    frames = shard_frames()
    with CacheStore(tmp_path / "c", capacity_bytes=64 << 20, sync=False) as s:
        s.put_shard(K, frames)
    if field == "payload_len: claims less":
        # Clear the length's highest set bit (wherever the encoder's output size puts it).
        top = int.from_bytes(frames[2][8:16], "little").bit_length() - 1
        offset, bit = 8 + top // 8, top % 8
    flip_on_disk(tmp_path / "c", frames[2], offset=offset, bit=bit)
    with CacheStore(tmp_path / "c", sync=False) as s:
        with pytest.raises(ChunkCorrupt, match="chunk 2: "):
            s.get_chunk(K, 2)
        assert s.shard_info(K) is None, field
        assert s.stats.corrupt_chunks == 1


def test_missing_chunk_or_lying_record_drops_the_shard(tmp_path: Path) -> None:
    from edgecache.cache.keys import chunk_key
    from edgecache.v1 import store_pb2

    frames = shard_frames()
    with CacheStore(tmp_path / "c", capacity_bytes=64 << 20, sync=False) as s:
        s.put_shard(K, frames)
        s.put_shard(ShardKey("tokens", 1, 1), frames)
        env, dbs = s._env, s._dbs
        assert env is not None
        with env.begin(write=True) as txn:  # damage LMDB's values the way bit rot would
            txn.delete(chunk_key(K.encode(), 1), db=dbs[b"chunks"])
            raw_key = ShardKey("tokens", 1, 1).encode()
            record = store_pb2.StoredShard.FromString(txn.get(raw_key, db=dbs[b"shards"]))
            record.chunk_rows[0] += 1
            txn.put(raw_key, record.SerializeToString(), db=dbs[b"shards"])
        with pytest.raises(ChunkCorrupt, match="chunk 1: the chunk is missing"):
            s.get_chunk(K, 1)
        with pytest.raises(ChunkCorrupt, match="chunk 0: chunk holds .* rows, the shard record"):
            s.get_chunk(ShardKey("tokens", 1, 1), 0)
        assert s.shard_info(K) is None and s.shard_info(ShardKey("tokens", 1, 1)) is None
        assert s.stats.corrupt_chunks == 2 and s.stats.used_bytes == 0


def test_bit_rot_seen_by_read_only_reader_is_never_returned(tmp_path: Path) -> None:
    frames = shard_frames()
    with CacheStore(tmp_path / "c", capacity_bytes=64 << 20, sync=False) as s:
        s.put_shard(K, frames)
    flip_on_disk(tmp_path / "c", frames[0], offset=5, bit=3)  # inside the header
    with CacheStore(tmp_path / "c", readonly=True) as r:
        with pytest.raises(ChunkCorrupt):
            r.get_chunk(K, 0)


def test_views_die_with_the_reader(store: CacheStore) -> None:
    store.put_shard(K, shard_frames())
    with store.read_shard(K) as reader:
        view = reader.chunk(0)
        assert len(view) > 0
    with pytest.raises(ValueError, match="released"):
        bytes(view)


def test_exported_view_keeps_its_snapshot_alive(store: CacheStore) -> None:
    frames = shard_frames()
    store.put_shard(K, frames)
    with store.read_shard(K) as reader:
        held = pa.py_buffer(reader.chunk(0))  # an export the store cannot revoke
    store.evict_version("tokens", 1)
    store.put_shard(ShardKey("other", 1, 0), shard_frames(seed=9))
    assert held.to_pybytes() == frames[0]  # still the old, intact snapshot
    del held
    store.put_shard(ShardKey("other", 1, 1), shard_frames(seed=9))
    # Reads reap lingering transactions once every REAP_EVERY reads: this one goes within
    # that many, and with it the old snapshot.
    for _ in range(REAP_EVERY + 1):
        store.read_shard(ShardKey("other", 1, 1)).close()
    assert store._lingering == []


def test_lingering_transactions_are_reaped_every_few_reads(store: CacheStore) -> None:
    """A reader holding views of many windows keeps a transaction lingering for each: reads
    reap those no longer in use once every REAP_EVERY reads, so they never pile up, and a
    freed one stays open for at most that many more reads."""
    store.put_shard(K, shard_frames())
    held = []
    for _ in range(3 * REAP_EVERY):
        with store.read_shard(K) as reader:
            held.append(pa.py_buffer(reader.chunk(0)))  # exported: its transaction lingers
    assert len(store._lingering) == len(held)  # all in use: none can go
    del held[:-2]
    for _ in range(REAP_EVERY):
        store.read_shard(K).close()
    assert len(store._lingering) == 2  # the two still in use
    del held
    store.close()  # reaps the rest: nothing left open
    assert store._lingering == []


def test_readonly_store_refuses_writes(tmp_path: Path) -> None:
    with CacheStore(tmp_path / "c", capacity_bytes=64 << 20, sync=False) as s:
        s.put_shard(K, shard_frames())
    with CacheStore(tmp_path / "c", readonly=True) as r:
        assert r.capacity_bytes == 64 << 20
        assert r.get_chunk(K, 0)
        with pytest.raises(ReadOnlyStore, match="read-only"):
            r.put_shard(K, shard_frames())


def test_missing_directory_for_reader(tmp_path: Path) -> None:
    with pytest.raises(CacheDirError, match="no edgecache store at"):
        CacheStore(tmp_path / "nope", readonly=True)


def test_foreign_lmdb_is_refused(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "x"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"meta", txn=txn))
        txn.put(b"format", b"something-else", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(CacheDirError, match="not an edgecache store"):
        CacheStore(tmp_path / "x", capacity_bytes=1 << 20)


def test_unwritable_directory() -> None:
    # Under /tmp directly: pytest's tmp_path sits in a 0700 directory nobody cannot enter.
    base = Path(tempfile.mkdtemp(prefix="edgecache-ro-"))
    base.chmod(0o755)
    target = base / "ro"
    target.mkdir()
    target.chmod(0o555)
    code = (
        "import os, sys\n"
        "from edgecache.cache.store import CacheStore\n"
        "from edgecache.cache.errors import CacheDirError\n"
        # root ignores mode bits: drop to nobody once everything is imported
        "if os.geteuid() == 0: os.setgid(65534); os.setuid(65534)\n"
        "for p in (sys.argv[1], sys.argv[1] + '/sub'):\n"
        "    try: CacheStore(p, capacity_bytes=1 << 20)\n"
        "    except CacheDirError as e: print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused:") == 2, out.stdout
    assert "not writable" in out.stdout and "cannot create cache directory" in out.stdout
    target.chmod(0o755)
    shutil.rmtree(base)


def test_second_writer_process_is_refused(tmp_path: Path) -> None:
    with CacheStore(tmp_path / "c", capacity_bytes=1 << 20) as s:
        code = (
            "import sys\n"
            "from edgecache.cache.store import CacheStore\n"
            "from edgecache.cache.errors import WriterLocked\n"
            "try: CacheStore(sys.argv[1])\n"
            "except WriterLocked as e: print(e); sys.exit(3)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(s.path)], capture_output=True, text=True
        )
        assert out.returncode == 3, out.stderr
        assert f"pid {os.getpid()}" in out.stdout and "opens the directory read-only" in out.stdout
        with pytest.raises(WriterLocked):  # also within one process
            CacheStore(s.path)
    CacheStore(tmp_path / "c").close()  # released on close


def test_store_refuses_to_cross_fork(store: CacheStore) -> None:
    store.put_shard(K, shard_frames())
    pid = os.fork()
    if pid == 0:
        try:
            store.get_chunk(K, 0)
        except StoreForked:
            os._exit(7)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7


def test_concurrent_reader_threads_and_processes(tmp_path: Path) -> None:
    shards = {ShardKey("t", 1, i): shard_frames(seed=i) for i in range(4)}
    with CacheStore(tmp_path / "c", capacity_bytes=256 << 20, sync=False) as s:
        for key, frames in shards.items():
            s.put_shard(key, frames)
        errors: list[BaseException] = []

        def read_all() -> None:
            try:
                for _ in range(5):
                    for key, frames in shards.items():
                        assert list(s.iter_chunks(key)) == frames
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=read_all) for _ in range(4)]
        code = (
            "import sys\n"
            "from edgecache.cache.store import CacheStore\n"
            "from edgecache.cache.keys import ShardKey\n"
            "s = CacheStore(sys.argv[1], readonly=True)\n"
            "print(sum(len(c) for i in range(4) for c in s.iter_chunks(ShardKey('t', 1, i))))\n"
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(s.path)], stdout=subprocess.PIPE, text=True
            )
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        s.put_shard(ShardKey("t", 2, 0), shard_frames(seed=7))  # a write while they read
        for t in threads:
            t.join()
        expected = sum(len(c) for frames in shards.values() for c in frames)
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert int(out) == expected
        assert not errors, errors


def test_capacity_is_remembered(tmp_path: Path) -> None:
    CacheStore(tmp_path / "c", capacity_bytes=5 << 20).close()
    with CacheStore(tmp_path / "c") as s:
        assert s.capacity_bytes == 5 << 20
    with CacheStore(tmp_path / "c", capacity_bytes=9 << 20) as s:
        assert s.capacity_bytes == 9 << 20


def test_churn_never_leaks_map_full(tmp_path: Path) -> None:
    frames = shard_frames(rows=4000)
    size = sum(map(len, frames))
    with CacheStore(tmp_path / "c", capacity_bytes=size * 4, sync=False) as s:
        for i in range(60):  # 15x the capacity through the cache
            s.put_shard(ShardKey("churn", 1 + i % 7, i), frames)
            assert s.stats.used_bytes <= s.capacity_bytes


def test_manifest_versions_outlive_eviction_and_keep_to_their_dataset(tmp_path: Path) -> None:
    with CacheStore(tmp_path / "c", capacity_bytes=1 << 30) as store:
        for dataset, version in (("tok", 2), ("tok", 10), ("tok2", 1), ("to", 3)):
            store.put_manifest(dataset, version, b"manifest")
        assert store.manifest_versions("tok") == [2, 10]
        assert store.manifest_versions("to") == [3] and store.manifest_versions("x") == []
        assert store.versions() == []  # no data held: the manifests are all that is kept


@pytest.mark.parametrize("keep", [0, 100, 2_000_000])
def test_a_data_file_cut_short_is_refused_naming_it_not_a_crash(tmp_path: Path, keep: int) -> None:
    """A truncated data.mdb killed the node with SIGBUS at its first read (nothing logged, a
    crash loop); an empty one said "Bad file descriptor". Now: CacheDirError naming the file,
    for the writer and for readers, in a child process (a SIGBUS would kill this one)."""
    with CacheStore(tmp_path / "c", capacity_bytes=64 << 20) as store:
        for i in range(6):
            store.put_shard(ShardKey("tok", 1, i), shard_frames(rows=4000, seed=i))
    data = tmp_path / "c" / "data.mdb"
    assert data.stat().st_size > keep
    os.truncate(data, keep)
    for readonly in (False, True):
        code = (
            "import sys\nfrom edgecache.cache.store import CacheStore\n"
            "from edgecache.cache.errors import CacheDirError\n"
            f"try:\n    s = CacheStore(sys.argv[1], readonly={readonly})\n"
            "    print([len(s.shards(v.dataset, v.version)) for v in s.versions()])\n"
            "except CacheDirError as exc:\n    print('refused:', exc)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True
        )
        assert out.returncode == 0, (out.returncode, out.stderr[-500:])
        assert out.stdout.startswith("refused:") and str(data) in out.stdout, out.stdout
        assert "is damaged" in out.stdout and "empty --cache-dir" in out.stdout, out.stdout
