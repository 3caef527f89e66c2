"""Measure the simulated link itself: round trip, bulk rate, loss.

A reader of the benchmark should see that the link behaves as specified
before trusting any edgecache figure measured over it. The server runs on the
origin side, the client on the edge side, as plain TCP over the same path
the node's S3 requests take:

* RTT: one-byte echoes on an open connection with TCP_NODELAY, timed by
  the application (``ping`` is fooled here: it reads the kernel's receive
  timestamp, taken before the delay line on the receiving side);
* rate: the server sends as fast as TCP lets it, over 1 stream and over N
  parallel streams, for a few seconds each; the client counts bytes after a
  warm-up, so slow start does not count against the link;
* loss is read by the caller from the link's own drop counters.

    python -m bench.wan.probe serve HOST PORT
    python -m bench.wan.probe measure HOST PORT [--streams 1,32] [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence

CHUNK = 256 << 10
START_GRACE_S = 20.0  # how long streams may take to start delivering before bulk gives up


def serve(host: str, port: int) -> None:
    """Echo (first byte ``e``) or send forever (``b``) to every connection, in threads."""
    listener = socket.create_server((host, port), reuse_port=False, backlog=128)
    print("ready", flush=True)
    payload = bytes(CHUNK)

    def handle(conn: socket.socket) -> None:
        with conn:
            try:
                mode = conn.recv(1)
                if mode == b"e":
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    while data := conn.recv(64):
                        conn.sendall(data)
                elif mode == b"b":
                    while True:
                        conn.sendall(payload)
            except OSError:
                return

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def rtt(host: str, port: int, count: int = 20) -> dict[str, float]:
    """Connect time and one-byte echo round trips, in milliseconds."""
    started = time.perf_counter()
    conn = socket.create_connection((host, port), timeout=10)
    connect_ms = (time.perf_counter() - started) * 1e3
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(b"e")
    samples = []
    with conn:
        for _ in range(count):
            started = time.perf_counter()
            conn.sendall(b"x")
            if not conn.recv(64):
                raise ConnectionError("echo server closed the connection")
            samples.append((time.perf_counter() - started) * 1e3)
            time.sleep(0.02)
    return {
        "connect_ms": round(connect_ms, 2),
        "rtt_min_ms": round(min(samples), 2),
        "rtt_median_ms": round(statistics.median(samples), 2),
        "rtt_max_ms": round(max(samples), 2),
    }


def bulk(host: str, port: int, streams: int, seconds: float, warmup: float) -> dict[str, object]:
    """Bytes per second over ``streams`` parallel connections, counted for ``seconds``.

    Counting starts after ``warmup`` seconds and once every stream has delivered.
    """
    counts = [0] * streams
    stop = threading.Event()
    timeline: list[tuple[float, int]] = []

    def reader(k: int) -> None:
        conn = socket.create_connection((host, port), timeout=10)
        with conn:
            conn.sendall(b"b")
            buffer = bytearray(CHUNK)
            while not stop.is_set():
                n = conn.recv_into(buffer)
                if not n:
                    return
                counts[k] += n

    threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    # The counted stretch starts after the warm-up *and* once every stream has
    # delivered: on a loaded host connecting can outlast a short warm-up, and a
    # stretch that starts before the bytes flow measures the connecting, not the link
    # (a 0.3 s smoke stretch once counted no byte at all).
    mark = None
    give_up = warmup + seconds + START_GRACE_S
    while (now := time.perf_counter() - started) < give_up:
        total = sum(counts)
        timeline.append((round(now, 2), total))
        if mark is None and now >= warmup and all(counts):
            mark = (now, total)
        if mark is not None and now - mark[0] >= seconds:
            break
        time.sleep(0.1)
    end = (time.perf_counter() - started, sum(counts))
    stop.set()
    if mark is None:
        silent = sum(1 for c in counts if not c)
        raise RuntimeError(
            f"{silent} of {streams} bulk streams to {host}:{port} received nothing in "
            f"{give_up:.0f} s: the link or its server is down"
        )
    rate = (end[1] - mark[1]) / (end[0] - mark[0])
    return {
        "streams": streams,
        "seconds": seconds,
        "bytes_per_s": round(rate),
        "mbit_s": round(rate * 8 / 1e6, 2),
        "timeline": timeline,
    }


def measure(
    host: str, port: int, streams: Sequence[int], seconds: float, warmup: float
) -> dict[str, object]:
    """RTT, then one bulk transfer per entry of ``streams``."""
    return {
        **rtt(host, port),
        "bulk": [bulk(host, port, n, seconds, warmup) for n in streams],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("serve", "measure"))
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds not counted")
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.host, args.port)
        return
    streams = [int(s) for s in args.streams.split(",")]
    json.dump(measure(args.host, args.port, streams, args.seconds, args.warmup), sys.stdout)


if __name__ == "__main__":
    main()
