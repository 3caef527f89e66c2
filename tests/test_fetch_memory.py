"""Shard fetches hold whole shards: a node-wide budget bounds how much they hold at once.

The budget's rules on their own (asyncio, no node), then a real node staging a
version under a small budget: every shard arrives, and the reservations never
passed the budget.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from edgeutil import node_settings, publish, stub, write_parquet_shards

from edgecache.edge.config import ConfigError, load_node_config
from edgecache.edge.fetch_memory import EXPANSION, FetchMemory
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


async def fetch(
    memory: FetchMemory, order: list[str], name: str, source: int, seconds: float
) -> None:
    """A fetch of a ``source``-byte object that holds its memory for ``seconds``."""
    async with memory.hold(source):
        order.append(f"{name} in")
        await asyncio.sleep(seconds)
        order.append(f"{name} out")


def test_fetches_wait_while_their_estimates_would_pass_the_budget() -> None:
    async def scenario() -> list[str]:
        memory = FetchMemory(budget=100 * EXPANSION)  # room for sources of 100 bytes in all
        order: list[str] = []

        await asyncio.gather(
            fetch(memory, order, "a", 60, 0.05),  # 60 of 100
            fetch(memory, order, "b", 30, 0.01),  # fits beside a
            fetch(memory, order, "c", 50, 0.01),  # waits for a
            fetch(
                memory, order, "huge", 10_000, 0.01
            ),  # more than the budget: reserves all of it, alone
        )
        assert memory.reserved == 0 and memory.peak <= memory.budget
        return order

    order = asyncio.run(scenario())
    assert order.index("b in") < order.index("a out") < order.index("c in")
    at = order.index("huge in")
    assert order[at + 1] == "huge out"  # nothing else ran while it held the whole budget


def test_kept_bytes_delay_fetches_but_never_block_one_with_none_in_flight() -> None:
    """Frames served without caching stay counted until their streams end, and a stream
    ends when its client reads on: a client waiting for the next window's fetch (a
    parked stream, a pipeline) would wait for ever on a fetch that waited for it."""

    async def scenario() -> list[str]:
        memory = FetchMemory(budget=100 * EXPANSION)
        kept = memory.keep(80 * EXPANSION)  # a passed-through shard's frames, still read
        order: list[str] = []

        # Alone, past what is kept: goes ahead (the old rule waited for the kept bytes).
        await asyncio.wait_for(fetch(memory, order, "alone", 50, 0.0), timeout=5)
        # Beside a fetch in flight, it waits for that fetch, not for the kept bytes.
        await asyncio.wait_for(
            asyncio.gather(
                fetch(memory, order, "first", 50, 0.05), fetch(memory, order, "second", 50, 0.0)
            ),
            timeout=5,
        )
        kept.release()
        assert memory.reserved == 0 and memory.fetching == 0
        return order

    order = asyncio.run(scenario())
    assert order[:2] == ["alone in", "alone out"]
    assert order.index("first out") < order.index("second in")


def test_a_node_stages_every_shard_within_its_fetch_memory(tmp_path: Path) -> None:
    write_parquet_shards(tmp_path / "origin", 4, rows=2000)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    settings = node_settings(tmp_path, registry, fetch_memory="64MiB", staging_concurrency=4)
    with running_node(settings) as node:
        last = list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        assert last[-1].shards_done == 4 and not last[-1].failures
        assert node.node is not None
        memory, metrics = node.node.fetch_memory, node.node.metrics
        assert 0 < memory.peak <= memory.budget == 64 << 20
        assert metrics.value("edgecache_fetch_memory_bytes") == 64 << 20
        assert metrics.value("edgecache_fetch_memory_reserved_bytes") == 0


def test_a_budget_too_small_for_a_fetch_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"fetch_memory .*at least 64MiB"):
        load_node_config(
            None,
            {"region": "eu", "cache_dir": Path("/tmp/c"), "registry": "s3://b/r"},
            {"EDGECACHE_FETCH_MEMORY": "1MiB"},
        )
