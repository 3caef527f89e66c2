"""Units of the edge node that need no server: staging gate, settings, wire encoding, sizes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgecache.cache.errors import ConfigError
from edgecache.cache.units import format_bytes, parse_rate, parse_size
from edgecache.cache.wire import encode_chunk
from edgecache.edge.config import NodeConfig, load_node_config
from edgecache.edge.staging_gate import StagingGate, TokenBucket
from edgecache.v1 import edge_pb2


def test_gate_drops_to_one_fetch_while_reads_stream() -> None:
    async def scenario() -> tuple[int, int]:
        gate = StagingGate(rate=None, concurrency=4)
        running = peak_idle = peak_busy = 0

        async def fetch(busy: bool) -> None:
            nonlocal running, peak_idle, peak_busy
            await gate.acquire(1)
            running += 1
            if busy:
                peak_busy = max(peak_busy, running)
            else:
                peak_idle = max(peak_idle, running)
            await asyncio.sleep(0.01)
            running -= 1
            await gate.release()

        await asyncio.gather(*(fetch(False) for _ in range(8)))
        await gate.read_started()
        await asyncio.gather(*(fetch(True) for _ in range(6)))
        await gate.read_finished()
        return peak_idle, peak_busy

    assert asyncio.run(scenario()) == (4, 1)


def test_token_bucket_spaces_requests_at_the_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(10_000_000, clock=lambda: now[0])  # 10 MB/s, starts empty
    waits = []
    for _ in range(5):  # 1 MB each, sent as soon as allowed
        waits.append(bucket.debit(1_000_000))
        now[0] += waits[-1]
    assert waits == pytest.approx([0.1] * 5) and now[0] == pytest.approx(0.5)
    now[0] += 10  # idle for long: at most one second of budget builds up
    assert bucket.debit(10_000_000) == 0 and bucket.debit(1_000_000) == pytest.approx(0.1)
    assert bucket.debit(50_000_000) == pytest.approx(5.1)  # a request larger than a second's


def test_gate_holds_staging_back_to_its_byte_rate() -> None:
    async def scenario() -> float:
        gate = StagingGate(rate=10_000_000, concurrency=8)  # 10 MB/s
        started = time.monotonic()
        for _ in range(5):
            await gate.acquire(1_000_000)
            await gate.release()
        return time.monotonic() - started

    # 5 MB at 10 MB/s cannot pass in less than about 0.5 s; how much longer a loaded
    # machine takes is not the gate's doing (speed is measured in bench/).
    assert asyncio.run(scenario()) >= 0.45


def test_a_fetch_cancelled_during_the_rate_wait_gives_its_slot_back() -> None:
    """The slot was taken before the rate wait and given back only by the caller, which a
    cancellation during the wait never reached: one slot lost for good each time."""

    async def scenario() -> int:
        # 1 byte/s: a 1 MB fetch waits for days, so the cancel always lands during the wait
        # (at 1 MB/s the wait was a second, which a stalled loop on a loaded host outlasted).
        gate = StagingGate(rate=1, concurrency=2)
        waiting = asyncio.ensure_future(gate.acquire(1_000_000))
        await asyncio.sleep(0.05)
        assert not waiting.done() and gate._running == 1  # the slot is held during the wait
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return gate._running

    assert asyncio.run(scenario()) == 0


def test_a_wanted_fetch_stops_waiting_for_the_rate_and_holds_no_slot() -> None:
    """A training read that joins a Stage's fetch sets ``unless``: the fetch's wait for
    staging's budget ends with nothing held, so nothing is released for it either."""

    async def scenario() -> tuple[bool, int, bool, int]:
        gate = StagingGate(rate=1, concurrency=2)  # 1 byte/s: a 1 MB fetch waits for days
        wanted = asyncio.Event()
        waiting = asyncio.ensure_future(gate.acquire(1_000_000, unless=wanted))
        await asyncio.sleep(0.05)
        assert not waiting.done() and gate._running == 1
        wanted.set()
        held = await asyncio.wait_for(waiting, 5)
        running_after = gate._running
        # Set before the call: no wait at all, no slot taken.
        held_again = await asyncio.wait_for(gate.acquire(1_000_000, unless=wanted), 5)
        return held, running_after, held_again, gate._running

    assert asyncio.run(scenario()) == (False, 0, False, 0)


def test_a_wanted_fetchs_queued_requests_go_without_a_slot() -> None:
    async def scenario() -> tuple[list[str], int, int]:
        gate = StagingGate(rate=None, concurrency=4)
        await gate.read_started()  # one staging request at a time
        wanted = asyncio.Event()
        order: list[str] = []
        release_first = asyncio.Event()

        async def part(name: str, n: int, unless: asyncio.Event | None) -> None:
            async with gate.request(order=n, unless=unless):
                order.append(name)
                if name == "other-0":
                    await release_first.wait()

        first = asyncio.ensure_future(part("other-0", 0, None))  # holds the only slot
        await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(part(f"wanted-{i}", 1, wanted)) for i in range(3)]
        later = asyncio.ensure_future(part("other-2", 2, None))
        await asyncio.sleep(0.05)
        assert order == ["other-0"]  # everyone else queues behind the slot
        wanted.set()
        await asyncio.wait_for(asyncio.gather(*queued), 5)
        held_while_first_runs = gate._requests
        release_first.set()
        await asyncio.wait_for(asyncio.gather(first, later), 5)
        await gate.read_finished()
        return order, held_while_first_runs, gate._requests

    order, held, after = asyncio.run(scenario())
    assert order == ["other-0", "wanted-0", "wanted-1", "wanted-2", "other-2"]
    assert held == 1 and after == 0  # the wanted parts took no slot; all were given back


def test_settings_precedence_and_errors(tmp_path: Path) -> None:
    file = tmp_path / "node.yaml"
    file.write_text(
        "region: from-file\ncache-dir: /var/cache/a\nregistry: s3://b/_r\ncapacity: 2GiB\n"
    )
    env = {"EDGECACHE_REGION": "from-env", "EDGECACHE_STAGING_RATE": "100MB/s"}
    settings = load_node_config(file, {"region": "from-flag", "listen": None}, env)
    assert settings.region == "from-flag"
    assert settings.capacity == 2 << 30 and settings.staging_rate == 100_000_000
    assert settings.listen == "127.0.0.1:7070"
    assert load_node_config(file, {}, env).region == "from-env"
    with pytest.raises(ConfigError, match=r"--capacity \(.*node.yaml\): .*invalid size"):
        file.write_text("region: r\ncache_dir: /c\nregistry: s3://b/r\ncapacity: huge\n")
        load_node_config(file, {}, {})
    with pytest.raises(ConfigError, match=r"--registry \(not set anywhere\)"):
        load_node_config(None, {"region": "r", "cache_dir": "/c"}, {})
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        load_node_config(
            None,
            {"region": "r", "cache_dir": "/c", "registry": "file:///r", "tls_key": "k.pem"},
            {},
        )
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load_node_config(
            None, {"region": "r", "cache_dir": "/c", "registry": "file:///r", "listen": "nope"}, {}
        )
    file.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_node_config(file, {}, {})
    file.write_text("region: r\nbogus: 1\ncache_dir: /c\nregistry: s3://b/r\n")
    # An unknown YAML key is no flag: named as it was written, with the settings there are.
    with pytest.raises(ConfigError, match=r"bogus \(.*node\.yaml\): there is no such setting"):
        load_node_config(file, {}, {})


@given(
    index=st.integers(0, 2**32 - 1),
    count=st.integers(0, 2**32 - 1),
    rows=st.integers(0, 2**32 - 1),
    checksum=st.integers(0, 2**64 - 1),
    frame=st.binary(max_size=300),
)
def test_hand_encoded_chunk_matches_protobuf(
    index: int, count: int, rows: int, checksum: int, frame: bytes
) -> None:
    wire = encode_chunk(
        index=index, chunk_count=count, rows=rows, checksum=checksum, frame=memoryview(frame)
    )
    assert (
        wire
        == edge_pb2.Chunk(
            index=index, chunk_count=count, rows=rows, checksum=checksum, frame=frame
        ).SerializeToString()
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [("1024", 1024), ("4KiB", 4096), ("1.5GB", 1_500_000_000), ("2 TiB", 2 << 40), (7, 7)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "rate"), [("100MB/s", 10**8), ("10Gbit/s", 1_250_000_000), ("1GiB/s", 2**30)]
)
def test_rates(text: str, rate: int) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize("bad", ["", "GB", "10 parsecs", "-1GB", "1e9"])
def test_bad_sizes(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB"


def test_exposure_warns_only_beyond_loopback(tmp_path: Path) -> None:
    from edgecache.edge.server import exposure

    def config(listen: str, **extra: object) -> NodeConfig:
        return NodeConfig(
            region="eu", cache_dir=tmp_path, registry="file:///r", listen=listen, **extra
        )

    assert exposure(config("127.0.0.1:0")) == []
    assert exposure(config("[::1]:7070")) == []
    assert exposure(config("localhost:7070")) == []
    open_node = exposure(config("0.0.0.0:7070"))
    assert len(open_node) == 2 and "--token-file" in open_node[0] and "--tls-cert" in open_node[1]
    token = tmp_path / "t"
    token.write_text("x")
    secured = config(
        "10.0.0.5:7070", token_file=token, read_token_file=token, tls_cert=token, tls_key=token
    )
    assert exposure(secured) == []  # reads need a token too: nothing is open


def test_stored_damage_is_unavailable_never_failed_precondition() -> None:
    # Clients fail over or retry on UNAVAILABLE; FAILED_PRECONDITION ends their read.
    import grpc

    from edgecache.cache.errors import ChunkCorrupt, ChunkTruncated, EmptyShard, SchemaMismatch
    from edgecache.edge.service import status_for

    for damage in (ChunkCorrupt("x"), ChunkTruncated("x")):
        assert status_for(damage)[0] == grpc.StatusCode.UNAVAILABLE
    for origin_rows in (SchemaMismatch("x"), EmptyShard("x")):  # origin does not fit the version
        assert status_for(origin_rows)[0] == grpc.StatusCode.FAILED_PRECONDITION


def test_node_logic_knows_nothing_of_grpc() -> None:
    # EdgeNode yields domain results and raises edgecache errors; the service alone maps
    # them to gRPC status codes (importing it back would make the two one module).
    import ast

    import edgecache.edge.node as node
    import edgecache.edge.staging_gate as gate

    for module in (node, gate):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {
            name
            for stmt in ast.walk(tree)
            if isinstance(stmt, ast.Import | ast.ImportFrom)
            for name in (
                [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else [stmt.module]
            )
        }
        assert not {n for n in imported if n and (n == "grpc" or n.startswith("grpc."))}
        assert "edgecache.edge.service" not in imported


def test_stage_yields_each_shard_with_its_exception(tmp_path: Path) -> None:
    from edgecache.cache.errors import MalformedShard
    from edgecache.edge.node import EdgeNode, Fetched, StagedShard
    from edgecache.v1 import manifest_pb2

    async def scenario() -> list[StagedShard]:
        node = EdgeNode(
            NodeConfig(
                region="eu", cache_dir=tmp_path / "c", registry="file:///r", capacity="64MiB"
            )
        )
        failure = MalformedShard("row 3 of part-1 is not JSON")

        async def ensure_shard(manifest, shard, *, staging=False, **peers):  # noqa: ANN001, ANN202
            assert staging
            if shard == 1:
                raise failure
            return None, (Fetched(None, "origin", 30) if shard == 2 else None)  # type: ignore[arg-type]

        node.ensure_shard = ensure_shard  # type: ignore[method-assign]
        node.store.contains = lambda key: True  # type: ignore[method-assign] # nothing stored
        manifest = manifest_pb2.Manifest(dataset="d", version=1)
        for size in (10, 20, 30):
            manifest.shards.add(source_size=size)
        try:
            return [o async for o in node.stage(manifest, [], None)]
        finally:
            await node.close()

    outcomes = sorted(asyncio.run(scenario()), key=lambda o: o.shard)
    assert [(o.shard, o.source_bytes, o.fetched) for o in outcomes] == [
        (0, 10, False),
        (1, 20, False),
        (2, 30, True),
    ]
    assert isinstance(outcomes[1].error, MalformedShard) and outcomes[0].error is None


_CODES = ["UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "NOT_FOUND", "INTERNAL"]


@given(codes=st.lists(st.sampled_from(_CODES), min_size=1, max_size=8), data=st.data())
def test_a_stage_reports_a_failure_no_retry_mends_whatever_order_shards_fail_in(
    codes: list[str], data: st.DataObject
) -> None:
    """Shards fail in the order they finish: the Stage's code must not depend on it."""
    import grpc

    from edgecache.edge.service import stage_failure

    failures = [(i, f"shard {i}", grpc.StatusCode[c]) for i, c in enumerate(codes)]
    order = data.draw(st.permutations(failures))
    shard, _, code = stage_failure(order)
    retryable = {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
    if all(c in retryable for c in codes):
        assert code.name in retryable and (shard, code) == (order[0][0], order[0][2])
    else:
        assert code.name not in retryable  # e.g. origin lost an object: a retry fails again
        assert (shard, code) == next((f[0], f[2]) for f in order if f[2].name not in retryable)


def test_a_version_whose_files_come_slowly_does_not_hold_up_another_versions_transform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transforms were built under one node-wide lock: while one version's tokenizer was
    read from its origin, every other version's first fetch waited for it."""
    import edgecache.edge.node as node_module
    from edgecache.edge.node import EdgeNode
    from edgecache.v1 import manifest_pb2

    slow_origin = asyncio.Event()

    async def fetch_resources(stores, source_url, spec):  # noqa: ANN001, ANN202
        if source_url == "file:///slow/":  # the origin whose files take their time
            await slow_origin.wait()
        return {}

    monkeypatch.setattr(node_module, "fetch_resources", fetch_resources)

    async def scenario() -> bool:
        node = EdgeNode(
            NodeConfig(
                region="eu", cache_dir=tmp_path / "c", registry="file:///r", capacity="64MiB"
            )
        )
        try:
            slow = manifest_pb2.Manifest(dataset="a", version=1, digest="sha256:a")
            slow.source_url = "file:///slow/"
            quick = manifest_pb2.Manifest(dataset="b", version=1, digest="sha256:b")
            quick.source_url = "file:///quick/"
            waiting = asyncio.ensure_future(node._transform(slow))
            await asyncio.sleep(0.05)
            built = await asyncio.wait_for(node._transform(quick), timeout=10)
            slow_origin.set()
            await waiting
            return built is not None and not waiting.cancelled()
        finally:
            await node.close()

    assert asyncio.run(scenario())
