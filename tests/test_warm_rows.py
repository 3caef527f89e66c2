"""What warm says a staged item came from: the bytes the nodes moved, not the plan's source."""

from __future__ import annotations

import pytest

from edgecache.clients.cli.staging import _row, _sizes_said
from edgecache.clients.ops import WarmItem


@pytest.mark.parametrize(
    ("origin", "peer", "source", "said_from", "sizes"),
    [
        # Every shard from origin (the peer refused this node's token): the row said
        # "from pa" and "stored bytes from a peer".
        (11_000, 0, "origin", "origin", "source bytes from origin"),
        (0, 9_000, "peer", "pa", "stored bytes from a peer"),
        (4_000, 5_000, "mixed", "pa and origin", "source bytes from origin plus stored bytes"),
        (0, 0, "peer", "pa", "stored bytes from a peer"),  # a dry run: the plan's source
    ],
)
def test_a_stage_row_says_where_its_bytes_came_from(
    origin: int, peer: int, source: str, said_from: str, sizes: str
) -> None:
    item = WarmItem("pb", "t@1", ["127.0.0.1:1"], 10_000, peers=["127.0.0.1:2"])
    item.origin_bytes, item.peer_bytes = origin, peer
    row = _row(item, "done" if origin or peer else "would stage", "pa")
    assert (row["source"], row["from"]) == (source, said_from)
    assert sizes in _sizes_said([row])


def test_a_task_the_executor_moved_to_origin_says_origin() -> None:
    item = WarmItem("pb", "t@1", ["127.0.0.1:1"], 10_000)  # peers dropped: its source failed
    item.origin_bytes = 11_000
    assert _row(item, "done", "pa")["from"] == "origin"
