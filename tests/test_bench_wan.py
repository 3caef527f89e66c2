"""Smoke tests of ``python -m bench.wan``: the WAN benchmark at toy sizes, so it cannot rot.

The whole benchmark runs once (``--smoke``: 4 MiB, a 20 ms link) over network
namespaces where this machine permits them, else over the loopback proxy,
and must produce every figure and timeline the lead renders; the proxy link
is exercised on its own too, so the fallback cannot rot where namespaces
work. No timing is asserted: on a shared 2-core machine toy sizes measure
nothing. Every namespace and process the benchmark starts must be gone after.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from benchproc import left_behind, marked, namespaces, run_marked


def test_wan_smoke(tmp_path: Path) -> None:
    out = tmp_path / "wan.json"
    marker = f"wan-smoke-{uuid.uuid4().hex}"
    before = namespaces()
    code, log = run_marked(
        [sys.executable, "-m", "bench.wan", "--smoke", "--json", str(out)],
        "BENCH_WAN_TEST",
        marker,
        120,
    )
    assert code == 0, log[-4000:]
    assert not left_behind(before), f"namespaces left behind: {left_behind(before)}"
    assert not marked(marker), "processes of the benchmark outlived it"

    doc = json.loads(out.read_text())
    link = doc["link"]
    assert link["kind"] in ("netns", "proxy") and link["chosen_because"]
    measured = link["measured"]
    assert measured["rtt_median_ms"] > 0
    assert [b["streams"] for b in measured["bulk"]] == [1, 4]
    assert all(b["bytes_per_s"] > 0 and b["timeline"] for b in measured["bulk"])
    if link["kind"] == "netns":
        assert set(measured["loss"]) == {"to_edge", "to_origin"}

    data = doc["data"]
    assert data["shards"] == 4 and data["rows"] > 0 and data["parquet_bytes"] > 0

    staging = doc["staging"]
    assert staging["bytes_per_s"] > 0 and staging["staging_s"] > 0
    assert staging["timeline"] and staging["shards_timeline"][-1][1] == data["shards"]

    epochs = doc["epochs"]
    for key in ("cold", "prestaged", "local", "lmdb"):
        e = epochs[key]
        assert e["samples"] == data["rows"], (key, e["samples"])
        assert 0 < e["first_batch_s"] <= e["seconds"]
        assert e["timeline"][-1][1] == e["batches"]
    assert epochs["cold"]["link_timeline"]

    contention = doc["contention"]
    for key in ("alone", "with_staging"):
        assert contention[key]["samples"] > 0 and contention[key]["samples_per_s"] > 0
    assert contention["link_timeline"] and contention["epoch_windows"]["with"]

    rows = {r["key"]: r for r in doc["rows"]}
    assert set(rows) >= {"staging", "prestaged_vs_local", "saved_vs_cold", "reads_with_staging"}
    assert all(
        isinstance(r["value"], float) and r["met"] in (True, False)
        for r in rows.values()
        if r["target"]
    )
    assert {"edgecache", "torch", "moto"} <= set(doc["versions"])
    assert "edgecache over a simulated WAN" in log
    # The page renders from it whichever link ran: the proxy link measures no loss, and
    # the renderer's KeyError on that failed `make bench` on hosts without netem.
    import copy
    import importlib

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        render = importlib.import_module("bench.render")
    finally:
        sys.path.pop(0)
    proxied = copy.deepcopy(doc)
    proxied["link"]["measured"]["loss"] = {}
    for each in (doc, proxied):
        section = render._section_wan(each, None)
        assert "## Wide-area link" in section
    assert "loss not simulated" in render._section_wan(proxied, None)


PROXY_CHECK = """
import json, socket, threading, time
from bench.wan.link import LinkSpec, ProxyLink
from bench.wan.probe import measure, serve
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); port = listener.getsockname()[1]
listener.close()
threading.Thread(target=serve, args=("127.0.0.1", port), daemon=True).start()
for _ in range(200):  # until the server listens
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        break
    except ConnectionRefusedError:
        time.sleep(0.05)
link = ProxyLink(LinkSpec(rtt_ms=10, rate_mbit=200, loss=0))
try:
    host, edge_port = link.expose(port)
    print(json.dumps(measure(host, edge_port, [2], seconds=0.3, warmup=0.1)))
finally:
    link.close()
"""


def test_proxy_link_carries_bytes_both_ways() -> None:
    """The fallback link (delaying, rate-limiting proxy) with the probe through it."""
    marker = f"wan-proxy-{uuid.uuid4().hex}"
    code, log = run_marked([sys.executable, "-c", PROXY_CHECK], "BENCH_WAN_TEST", marker, 60)
    assert code == 0, log[-3000:]
    figures = json.loads(log.strip().splitlines()[-1])
    assert figures["rtt_median_ms"] > 0 and figures["connect_ms"] > 0
    assert figures["bulk"][0]["streams"] == 2 and figures["bulk"][0]["bytes_per_s"] > 0
    assert not marked(marker)


# ------------------------------------------------ the staging path this benchmark drove
# Unit tests of what bench.wan needed from the node (cache/storage.py, edge/node.py):
# parallel ranged parts, a per-request slot, the staging gate's request limit and hold,
# and staging's preprocessing at a lower CPU priority.


def test_objects_are_split_into_enough_parts_to_fill_a_long_path() -> None:
    from edgecache.cache.storage.s3 import MIN_PART_BYTES, PART_BYTES, S3Store

    store = S3Store()
    assert store.part_size(24 << 20) == 2 << 20  # 12 parts
    assert store.part_size(4 << 20) == MIN_PART_BYTES  # 4 parts, never below 1 MiB
    assert store.part_size(1 << 30) == PART_BYTES  # 64 parts of 16 MiB
    assert S3Store(part_bytes=64 << 10).part_size(1 << 20) == 64 << 10  # the cap wins


def test_every_origin_request_runs_in_the_callers_slot(s3_endpoint: str) -> None:
    import asyncio
    import contextlib
    from collections.abc import AsyncIterator

    from s3server import make_bucket, put_object

    from edgecache.cache.storage import S3Store

    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    body = os.urandom((9 << 20) + 7)
    put_object(s3_endpoint, bucket, "k", body)
    entered, inside, peak = 0, 0, 0

    @contextlib.asynccontextmanager
    async def slot() -> AsyncIterator[None]:
        nonlocal entered, inside, peak
        entered += 1
        inside += 1
        peak = max(peak, inside)
        try:
            yield
        finally:
            inside -= 1

    async def scenario() -> bytes:
        store = S3Store()
        try:
            return await store.get(f"s3://{bucket}/k", slot=slot)
        finally:
            await store.close()

    assert asyncio.run(scenario()) == body
    assert entered == 10 and peak > 1  # 10 ranged parts of 1 MiB, in parallel


def test_gate_sends_one_staging_request_while_reads_stream_and_for_a_hold_after() -> None:
    import asyncio

    from edgecache.edge.node import StagingGate

    async def peak_requests(gate: StagingGate, n: int = 6) -> int:
        inside = peak = 0

        async def request() -> None:
            nonlocal inside, peak
            async with gate.request():
                inside += 1
                peak = max(peak, inside)
                await asyncio.sleep(0.01)
                inside -= 1

        await asyncio.gather(*(request() for _ in range(n)))
        return peak

    async def scenario() -> list[int]:
        # A 2 s hold: six 10 ms requests in a row must fit inside it even on a loaded
        # machine (0.3 s did not), and the sleep below steps past it.
        gate = StagingGate(rate=None, concurrency=4, hold=2.0, requests=3)
        idle = await peak_requests(gate)
        await gate.read_started()
        reading = await peak_requests(gate)
        await gate.read_finished()
        held = await peak_requests(gate)  # within the hold: still background
        await asyncio.sleep(2.1)
        after = await peak_requests(gate)
        return [idle, reading, held, after]

    assert asyncio.run(scenario()) == [3, 1, 1, 3]


def test_gate_lets_waiting_requests_in_oldest_fetch_first() -> None:
    import asyncio

    from edgecache.edge.node import StagingGate

    async def scenario() -> list[int]:
        gate = StagingGate(rate=None, concurrency=4, requests=1)
        order: list[int] = []
        release = asyncio.Event()

        async def first() -> None:
            async with gate.request(order=0):
                await release.wait()

        async def later(n: int) -> None:
            async with gate.request(order=n):
                order.append(n)

        holder = asyncio.create_task(first())
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(later(n)) for n in (7, 3, 5, 1)]
        await asyncio.sleep(0.01)
        waiting[0].cancel()  # a cancelled waiter gives its turn away
        release.set()
        await asyncio.gather(holder, *waiting, return_exceptions=True)
        return order

    assert asyncio.run(scenario()) == [1, 3, 5]


def test_staging_preprocesses_at_a_lower_cpu_priority() -> None:
    import threading

    from edgecache.edge.preprocessing import STAGING_NICE, lower_priority

    seen: list[int] = []
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def work() -> None:
        lower_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [min(base + STAGING_NICE, 19)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # that thread only
