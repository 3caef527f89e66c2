"""Random sequences of put/get/evict/pin/drop against a simple model of the store."""

import shutil
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from storeutil import shard_frames

from edgecache.cache.errors import CacheFull, ShardNotCached
from edgecache.cache.keys import ShardKey
from edgecache.cache.store import CacheStore

# A few distinct shard contents of different sizes, encoded once.
CONTENTS = [shard_frames(rows=rows, seed=seed) for seed, rows in enumerate((300, 900, 1500, 2500))]
SIZES = [sum(map(len, c)) for c in CONTENTS]
CAPACITY = int(sum(SIZES) * 0.9)
FUTURE = datetime.now(UTC) + timedelta(days=365)

keys = st.builds(ShardKey, st.sampled_from(["a", "b"]), st.integers(1, 3), st.integers(0, 3))


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="edgecache-model-"))
        self.store = CacheStore(self.dir / "c", capacity_bytes=CAPACITY, sync=False)
        self.model: dict[
            ShardKey, int
        ] = {}  # key -> content index, for shards that may be resident
        self.pinned: set[tuple[str, int]] = set()

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir)

    def resident(self) -> dict[ShardKey, int]:
        """Drop model entries the store evicted; evictions must only hit unpinned versions."""
        actual = {
            info.key
            for v in self.store.versions()
            for info in self.store.shards(v.dataset, v.version)
        }
        for key in list(self.model):
            if key not in actual:
                assert key[:2] not in self.pinned, f"pinned shard {key} was evicted"
                del self.model[key]
        assert actual == set(self.model), "store holds shards the model never put"
        return self.model

    @rule(key=keys, content=st.integers(0, len(CONTENTS) - 1))
    def put(self, key: ShardKey, content: int) -> None:
        resident = self.resident()
        pinned_bytes = sum(
            SIZES[c] for k, c in resident.items() if k[:2] in self.pinned and k != key
        )
        try:
            self.store.put_shard(key, CONTENTS[content])
        except CacheFull:
            assert pinned_bytes + SIZES[content] > CAPACITY, "refused although it could fit"
            event("put refused: cache full of pins")
            return  # all or nothing: a refused replacement leaves the old copy as it was
        self.model[key] = content

    @rule(key=keys)
    def get(self, key: ShardKey) -> None:
        resident = self.resident()
        if key in resident:
            assert list(self.store.iter_chunks(key)) == CONTENTS[resident[key]]
        else:
            try:
                self.store.get_chunk(key, 0)
            except ShardNotCached:
                return
            raise AssertionError(f"{key} read back although not resident")

    @rule(dataset=st.sampled_from(["a", "b"]), version=st.integers(1, 3), pin=st.booleans())
    def pin(self, dataset: str, version: int, pin: bool) -> None:
        self.resident()
        self.store.pin_version(dataset, version, FUTURE if pin else None)
        (self.pinned.add if pin else self.pinned.discard)((dataset, version))

    @rule(dataset=st.sampled_from(["a", "b"]), version=st.integers(1, 3))
    def evict(self, dataset: str, version: int) -> None:
        resident = self.resident()
        freed = self.store.evict_version(dataset, version)
        gone = [k for k in resident if k[:2] == (dataset, version)]
        assert freed == sum(SIZES[resident[k]] for k in gone)
        for k in gone:
            del resident[k]
        self.pinned.discard((dataset, version))

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        resident = self.resident()
        if resident:
            key = data.draw(st.sampled_from(sorted(resident)))
            assert self.store.drop_shard(key) == SIZES[resident.pop(key)]

    @invariant()
    def accounting(self) -> None:
        resident = self.resident()
        stats = self.store.stats
        assert stats.used_bytes == sum(SIZES[c] for c in resident.values()) <= CAPACITY
        assert stats.shard_count == len(resident)
        for v in self.store.versions():
            mine = [k for k in resident if k[:2] == (v.dataset, v.version)]
            assert v.shard_count == len(mine)
            assert v.pinned(None) == ((v.dataset, v.version) in self.pinned)


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestStoreModel = StoreMachine.TestCase
