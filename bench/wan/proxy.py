"""The fallback link: a TCP proxy on loopback that delays and rate-limits.

Used where network namespaces are not permitted. Every byte read from one
side waits for the shared token bucket of its direction (all connections
together share the link's rate, as on one path), then is written to the
other side half a round trip later. It cannot drop packets, so it does not
reproduce TCP's loss recovery or its per-connection throughput limit; the
namespace link does.

    python -m bench.wan.proxy --target 127.0.0.1:PORT --rtt-ms 80 --rate-mbit 100

Prints ``listening on 127.0.0.1:PORT``; runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

READ_BYTES = 64 << 10
IN_FLIGHT_CHUNKS = 64  # per connection and direction: 4 MiB in the delay line at most


class TokenBucket:
    """A byte rate shared by every connection in one direction."""

    def __init__(self, rate: float, burst: float = 64 << 10) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.stamp = asyncio.get_running_loop().time()
        self._lock = asyncio.Lock()

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may pass (one taker at a time: FIFO, like a queue)."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            now = loop.time()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= nbytes
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    bucket: TokenBucket,
    delay: float,
) -> None:
    loop = asyncio.get_running_loop()
    line: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(IN_FLIGHT_CHUNKS)

    async def take_in() -> None:
        try:
            while data := await reader.read(READ_BYTES):
                await bucket.take(len(data))
                await line.put((loop.time() + delay, data))
        finally:
            await line.put(None)

    async def give_out() -> None:
        while (item := await line.get()) is not None:
            due, data = item
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    try:
        await asyncio.gather(take_in(), give_out())
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def serve(target: tuple[str, int], rtt: float, rate: float) -> None:
    """Accept on a free loopback port and forward each connection through the link."""
    up, down = TokenBucket(rate), TokenBucket(rate)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.sleep(rtt)  # the handshake's round trip
            await asyncio.gather(
                _pipe(reader, up_writer, up, rtt / 2),
                _pipe(up_reader, writer, down, rtt / 2),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            # Shutting down. Python 3.11's streams log a cancelled handler as an error;
            # ending quietly here is the end of the connection anyway.
            writer.close()
            up_writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(f"listening on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the origin-side server")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    args = parser.parse_args()
    host, _, port = args.target.rpartition(":")
    asyncio.run(serve((host, int(port)), args.rtt_ms / 1e3, args.rate_mbit * 1e6 / 8))


if __name__ == "__main__":
    main()
