"""A fixed delay for the packets of one NFQUEUE queue: the link's round trip.

This kernel has no netem, so delay is added in userspace: an iptables rule
sends the packets the edge namespace puts on the link (requests and ACKs) to
an NFQUEUE, and this process holds each one for ``--delay-ms`` before
accepting it (:mod:`bench.wan.link` explains why one direction carries the
whole round trip). The delay is the same for every packet, so packets leave
in the order they came: one ``NFQNL_MSG_VERDICT_BATCH`` ("accept every packet
up to id N") releases all that are due, which keeps the cost per packet to
one parse of its metadata (no payload is copied: ``NFQNL_COPY_META``).

The netlink protocol is spoken directly (``AF_NETLINK``/``NETLINK_NETFILTER``,
about a dozen structs from ``linux/netfilter/nfnetlink_queue.h``) rather than
through PyPI's ``netfilterqueue``: that binding needs libnetfilter_queue's
headers to build and gives one verdict per packet, where a delay line needs
one verdict per release.

    ip netns exec NS python -m bench.wan.delay --queue 0 --delay-ms 80

Prints ``ready`` once bound; on SIGTERM/SIGINT it lets the packets it holds
go and exits (with no listener on the queue, the kernel drops its packets:
the link is cut).
"""

from __future__ import annotations

import argparse
import collections
import errno
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQA_CFG_MASK, NFQA_CFG_FLAGS = 4, 5
NFQA_CFG_F_GSO = 1 << 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_ACCEPT = 1

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_NFGENMSG = struct.Struct("!BBH")  # family, version, queue number (big-endian)
_NLATTR = struct.Struct("=HH")  # len, type


def _attr(kind: int, payload: bytes) -> bytes:
    body = _NLATTR.pack(_NLATTR.size + len(payload), kind) + payload
    return body + b"\0" * (-len(body) % 4)


class DelayQueue:
    """One NFQUEUE queue whose packets are accepted ``delay`` seconds after they arrive."""

    def __init__(self, queue: int, delay: float, *, maxlen: int = 65536) -> None:
        self.queue = queue
        self.delay_ns = int(delay * 1e9)
        self.held: collections.deque[tuple[int, int]] = collections.deque()  # (due ns, id)
        self.packets = 0
        self.max_held = 0
        self._seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        # A deep receive buffer: the kernel drops packets it cannot hand over.
        so_rcvbufforce = getattr(socket, "SO_RCVBUFFORCE", 33)
        self.sock.setsockopt(socket.SOL_SOCKET, so_rcvbufforce, 32 << 20)
        self.sock.bind((0, 0))
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)))
        self._config(
            _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
            + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))
            # GSO: take large segments as they are; they are never parsed here.
            + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
            + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO))
        )
        self.sock.setblocking(False)

    def _send(self, msg_type: int, payload: bytes, flags: int = NLM_F_REQUEST) -> None:
        self._seq += 1
        body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, self.queue) + payload
        header = _NLMSGHDR.pack(
            _NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, self._seq, 0
        )
        self.sock.send(header + body)

    def _config(self, payload: bytes) -> None:
        """Send one config message and wait for its acknowledgement."""
        self._send(NFQNL_MSG_CONFIG, payload, NLM_F_REQUEST | NLM_F_ACK)
        reply = self.sock.recv(65536)
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(reply)
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", reply, _NLMSGHDR.size)
            if code != 0:
                raise OSError(
                    -code, f"NFQUEUE config of queue {self.queue}: {errno.errorcode.get(-code)}"
                )

    def receive(self, buffer: bytearray) -> None:
        """Take every packet message waiting on the socket into the delay line."""
        view = memoryview(buffer)
        packet_type = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
        while True:
            try:
                size = self.sock.recv_into(buffer)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # we fell behind; the kernel dropped some
                    continue
                raise
            due = time.monotonic_ns() + self.delay_ns
            offset = 0
            while offset + _NLMSGHDR.size <= size:
                length, kind, _, _, _ = _NLMSGHDR.unpack_from(view, offset)
                if length < _NLMSGHDR.size:
                    break
                if kind == packet_type:
                    at = offset + _NLMSGHDR.size + _NFGENMSG.size
                    end = offset + length
                    while at + _NLATTR.size <= end:
                        alen, atype = _NLATTR.unpack_from(view, at)
                        if atype & 0x3FFF == NFQA_PACKET_HDR:
                            (packet_id,) = struct.unpack_from("!I", view, at + _NLATTR.size)
                            self.held.append((due, packet_id))
                            self.packets += 1
                            break
                        at += (alen + 3) & ~3
                offset += (length + 3) & ~3
            self.max_held = max(self.max_held, len(self.held))

    def release(self) -> float | None:
        """Accept every packet that is due; seconds until the next one is (None: none held)."""
        now = time.monotonic_ns()
        last = None
        held = self.held
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            self._send(
                NFQNL_MSG_VERDICT_BATCH,
                _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last)),
            )
        return (held[0][0] - now) / 1e9 if held else None

    def serve(self, stop: list[bool], tick: float = 0.001) -> None:
        """Delay packets until ``stop[0]`` is set, then let the held ones go.

        While packets are held the loop wakes every ``tick`` and takes all that
        arrived meanwhile in one go: one wake-up per packet would cost more CPU
        than everything else here. The delay is therefore exact to about a tick.
        """
        buffer = bytearray(1 << 20)
        while not stop[0]:
            if self.held:
                time.sleep(min(max(self.release() or 0.0, 0.0), tick))
            else:
                select.select([self.sock], [], [], 0.2)
            self.receive(buffer)
            self.release()
        self.delay_ns = 0
        self.held = collections.deque((0, i) for _, i in self.held)
        self.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    stop = [False]

    def finish(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    queue = DelayQueue(args.queue, args.delay_ms / 1e3)
    print("ready", flush=True)
    queue.serve(stop)
    print(
        f"delayed {queue.packets} packets; at most {queue.max_held} held at once", file=sys.stderr
    )


if __name__ == "__main__":
    main()
