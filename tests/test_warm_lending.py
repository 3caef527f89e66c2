"""warm carries out a plan in which one region lends another a version it then evicts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, publish, stub, write_parquet_shards

from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2


def test_a_lent_version_is_evicted_only_after_the_copy_from_it(tmp_path: Path) -> None:
    """a copies v@1 from c for a job in an hour; c then evicts v@1 for w@1. warm evicted
    at once (the guard looks at c's own jobs only), a's copy found nothing there and took
    every shard from origin, and the row still said "from c"."""
    registry = f"file://{tmp_path}/registry"
    for name in ("v", "w"):
        write_parquet_shards(tmp_path / "origin" / name, 2, rows=2000)
        publish(registry, f"file://{tmp_path}/origin/{name}", name)
    a = start_local_node("a", tmp_path / "cache-a", registry, capacity="400KiB")
    c = start_local_node("c", tmp_path / "cache-c", registry, capacity="400KiB")
    try:
        list(stub(c.address).Stage(edge_pb2.StageRequest(dataset="v", version=1)))
        config = tmp_path / "edgecache.yaml"
        config.write_text(
            f"registry: {registry}\nregions:\n"
            f"  a: {{nodes: ['{a.address}'], origin_bandwidth: 1MB/s, peers: {{c: 1GB/s}}}}\n"
            f"  c: {{nodes: ['{c.address}'], origin_bandwidth: 1MB/s}}\n"
        )
        now = datetime.now(UTC)
        schedule = tmp_path / "schedule.yaml"
        schedule.write_text(
            "jobs:\n"
            f"  - {{name: a1, region: a, start: '{(now + timedelta(hours=1)).isoformat()}', "
            "duration: 60m, datasets: [v@1]}\n"
            f"  - {{name: cw, region: c, start: '{(now + timedelta(hours=3)).isoformat()}', "
            "duration: 60m, datasets: [w@1]}\n"
        )
        code, out, err = edgecache("plan", str(schedule), "--config", str(config))
        said = " ".join((out + err).split())
        assert code == 0 and "from: c" in said and "evict v@1" in said, said
        # c keeps v@1 for a's copy: pinned to the copy's end, so its nodes keep it until then.
        assert "c: pin v@1 until" in said and "(kept for a's copy from here)" in said, said
        code, out, err = edgecache("warm", str(schedule), "--config", str(config))
        said = " ".join((out + err).split())
        assert code == 0, said
        assert "a: staged v@1" in said and "from c" in said, said
        status = stub(a.address).Status(edge_pb2.StatusRequest())
        assert status.staged_peer_bytes > 0 and status.origin_bytes == 0, status
        held = {v.dataset for v in stub(c.address).Status(edge_pb2.StatusRequest()).versions
                if v.shard_count}  # fmt: skip
        assert held == {"w"}, held  # the eviction happened, after the copy
    finally:
        a.stop()
        c.stop()
