"""EdgeDataset's parameters and methods as a user calls them wrongly (a helper's hunt, stop 51).

A real node on loopback serves the version; every error must name what to fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from edgeutil import publish, write_parquet_shards

from edgecache.cache.errors import InvalidEndpoint, StateMismatch
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import start_local_node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("review51")
    write_parquet_shards(root / "origin", 2, rows=1000)
    registry = f"file://{root}/registry"
    publish(registry, f"file://{root}/origin", "toks")
    running = start_local_node("eu", root / "cache", registry)
    try:
        yield running.address
    finally:
        running.stop()


def test_stats_keep_their_bytes_and_endpoints_after_close(node: str) -> None:
    """After a with block stats() said 0 bytes and no endpoints beside the samples; after a
    close between epochs it mixed two spans (samples of both, bytes of one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with EdgeDataset("toks@1", endpoints=[node], batch_size=100) as ds:
            for _ in ds:
                pass
            inside = ds.stats()
        after = ds.stats()
        for _ in ds:
            pass
        again = ds.stats()
        ds.close()
    assert inside["bytes"] > 0 and list(inside["endpoints"]) == [node]
    assert after["bytes"] == inside["bytes"] and list(after["endpoints"]) == [node]
    assert after["samples"] == inside["samples"] == 2000
    assert again["samples"] == 4000 and again["bytes"] == 2 * inside["bytes"]


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"endpoints": 18600}, "endpoints must be a host:port or lmdb:// string, or a list"),
        ({"endpoints": b"127.0.0.1:18600"}, "got b'127.0.0.1:18600' (bytes)"),
        ({"config": 3, "region": "eu"}, "config must be the path of a topology file"),
        # Followed, "drop endpoints=" failed again: there was no config= to read instead.
        ({"endpoints": ["127.0.0.1:1"], "region": "eu"}, "pass config= with it, or drop region="),
    ],
)
def test_wrong_endpoints_and_config_are_named(kwargs: dict, said: str) -> None:
    with pytest.raises(InvalidEndpoint) as caught:
        EdgeDataset("toks@1", **kwargs)
    assert said in str(caught.value), caught.value


def test_a_state_of_a_newer_format_says_to_upgrade(node: str) -> None:
    """It was explained as an old format 1/2 state, with advice to start the epoch again
    (the checkpoint's progress thrown away where an upgrade resumes it exactly)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = EdgeDataset("toks@1", endpoints=[node])
    state = ds.state_dict()
    state["format"] = int(state["format"]) + 1
    with pytest.raises(StateMismatch, match="saved by a newer edgecache .* upgrade edgecache"):
        ds.load_state_dict(state)
    ds.close()


@pytest.mark.parametrize(("rank", "world"), [("2", "2"), ("0", "0"), ("-1", "2")])
def test_a_bad_rank_from_the_environment_is_named_as_the_environments(
    node: str, monkeypatch: pytest.MonkeyPatch, rank: str, world: str
) -> None:
    """It blamed rank= and world_size=, which the user never passed."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=rf"\$RANK={rank} and \$WORLD_SIZE={world}"):
        EdgeDataset("toks@1", endpoints=[node])
