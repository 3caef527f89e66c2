"""A TCP proxy on loopback that can blackhole or corrupt a connection, for fault tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from edgecache.cache import rendezvous


class _Server(Protocol):
    @property
    def address(self) -> str: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=_Server)


def ranked_first(
    make: Callable[[], S], other: str, *, dataset: str = "tokens", version: int = 1, shard: int = 0
) -> S:
    """A server from ``make`` that rendezvous asks before ``other`` for a shard.

    Peers are asked in rendezvous order per shard and a server's port is the OS's
    choice, so a test that needs its faulty peer asked first draws ports until one
    ranks first. The losers stay open until then: a port closed at once may be
    handed out again by the next bind and lose again, every time (CI saw 64 in a row).
    """
    losers: list[S] = []
    try:
        for _ in range(64):
            server = make()
            first = rendezvous.rank([server.address, other], dataset, version, shard)[0]
            if first == server.address:
                return server
            losers.append(server)
        raise AssertionError(f"none of 64 ports ranked first for shard {shard}")
    finally:
        for server in losers:
            server.close()


class FaultyProxy:
    """Forwards 127.0.0.1:<port> to a target; ``blackhole()`` stops all forwarding
    (connections stay open, as with a dropped route), ``corrupt_after(n)`` flips one
    byte of the server's reply stream once ``n`` more bytes have passed. ``latency``
    holds each piece of the client's stream that long: the node behind it measures
    farther than one reached directly, so a reader's pool ranks it second, whatever
    the load on the host (loopback RTTs of two nodes tie, and which is read first
    was a coin toss)."""

    def __init__(self, target: str, *, latency: float = 0.0) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._latency = latency
        self._blackholed = threading.Event()
        self._corrupt_at: int | None = None
        self._cut_at: int | None = None
        self._stall_at: int | None = None
        self.stalled = threading.Event()  # set once stall_after's point is reached
        self._passed = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def blackhole(self) -> None:
        self._blackholed.set()

    def corrupt_after(self, nbytes: int) -> None:
        self._corrupt_at = self._passed + nbytes

    def cut_after(self, nbytes: int) -> None:
        """Abort every connection once ``nbytes`` more reply bytes have passed (a dying peer)."""
        self._cut_at = self._passed + nbytes

    def stall_after(self, nbytes: int) -> None:
        """Blackhole everything once ``nbytes`` more reply bytes have passed (a peer that
        hangs mid-stream); ``stalled`` is set then, so a test can act at that moment."""
        self._stall_at = self._passed + nbytes

    def close(self) -> None:
        """Stop, closing every connection (a node then sees its clients go)."""

        def stop() -> None:
            for writer in self._writers:
                writer.transport.abort()
            self._loop.call_soon(self._loop.stop)  # after the sockets' close callbacks

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers += (writer, up_writer)
        await asyncio.gather(
            self._pipe(reader, up_writer, downstream=False),
            self._pipe(up_reader, writer, downstream=True),
            return_exceptions=True,
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, downstream: bool
    ) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                writer.close()
                return
            while self._blackholed.is_set():
                await asyncio.sleep(3600)  # hold the bytes, keep the connection open
            if not downstream and self._latency:
                await asyncio.sleep(self._latency)
            if downstream:
                at = self._corrupt_at
                if at is not None and self._passed <= at < self._passed + len(data):
                    flipped = bytearray(data)
                    flipped[at - self._passed] ^= 0x40
                    data = bytes(flipped)
                    self._corrupt_at = None
                stall = self._stall_at
                if stall is not None and self._passed + len(data) >= stall:
                    writer.write(data[: stall - self._passed])  # up to the point, then silence
                    self._stall_at = None
                    self._passed = stall
                    self._blackholed.set()
                    self.stalled.set()
                    await asyncio.sleep(3600)
                self._passed += len(data)
                if self._cut_at is not None and self._passed >= self._cut_at:
                    self._cut_at = None
                    for each in self._writers:
                        each.transport.abort()
                    return
            writer.write(data)
            await writer.drain()
