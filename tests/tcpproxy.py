"""A TCP proxy on loopback that can blackhole or corrupt a connection, for fault tests."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from edgecache.cache import rendezvous


class _Server(Protocol):
    @property
    def address(self) -> str: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=_Server)


# Ports under the kernel's ephemeral range (32768-60999 by default): nothing is handed
# them by a bind to port 0 or an outgoing connection, so one chosen here is free unless
# another test chose it too, and then the bind says so.
_CHOSEN_PORTS = range(20000, 32768)


def ranked_first(
    make: Callable[[int], S],
    other: str,
    *,
    dataset: str = "tokens",
    version: int = 1,
    shard: int = 0,
    names: Mapping[str, str] | None = None,
) -> S:
    """A server from ``make(port)`` that rendezvous asks before ``other`` for a shard.

    Peers are asked in rendezvous order per shard, so a test that needs its faulty
    peer asked first needs a port that ranks before ``other``'s. Drawing the OS's
    ports until one did failed now and then: against some addresses barely one port
    in a hundred ranks first (CI's ``other`` let 134 of 10,000 win, so 64 draws all
    lost two times in five). The ports that win are computed instead, and the first
    of them that binds is used; ``make`` raises OSError for a port already taken.
    ``names`` are the ids the staging node learns from the peers' Status (replicas
    split shards by them): a server that answers no Status is ranked by its address.
    A TCP proxy forwards Status and is ranked as the node behind it, whatever its port.
    """
    start = random.randrange(len(_CHOSEN_PORTS))  # tests in parallel start apart
    taken = 0
    for i in range(len(_CHOSEN_PORTS)):
        port = _CHOSEN_PORTS[(start + i) % len(_CHOSEN_PORTS)]
        address = f"127.0.0.1:{port}"
        if rendezvous.rank([address, other], dataset, version, shard, names=names)[0] != address:
            continue
        try:
            return make(port)
        except OSError:
            taken += 1
            if taken == 64:
                break
    raise AssertionError(f"no free port on 127.0.0.1 ranks before {other} for shard {shard}")


class FaultyProxy:
    """Forwards 127.0.0.1:<port> to a target; ``blackhole()`` stops all forwarding
    (connections stay open, as with a dropped route), ``corrupt_after(n)`` flips one
    byte of the server's reply stream once ``n`` more bytes have passed. ``latency``
    holds each piece of the client's stream that long: the node behind it measures
    farther than one reached directly, so a reader's pool ranks it second, whatever
    the load on the host (loopback RTTs of two nodes tie, and which is read first
    was a coin toss)."""

    def __init__(self, target: str, *, latency: float = 0.0, port: int = 0) -> None:
        # Bound here, in the caller's thread, so a port already taken raises OSError here.
        self._socket = socket.create_server(("127.0.0.1", port))
        host, _, target_port = target.rpartition(":")
        self._target = (host, int(target_port))
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
        self.port = self._socket.getsockname()[1]
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
        self._loop.run_until_complete(asyncio.start_server(self._handle, sock=self._socket))
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
