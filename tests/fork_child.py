"""Fork N children while a NodePool probes its node all the time; each child calls the node.

Run by tests/test_node_pool.py in a fresh process (gRPC's fork handling is
process-wide): prints how many children failed. gRPC says on stderr when it
forked with a thread inside a call ("skipping fork() handlers").
"""

from __future__ import annotations

import os
import sys

from edgecache.clients.endpoints import parse_endpoint
from edgecache.clients.node_client import connect
from edgecache.clients.node_pool import NodePool
from edgecache.v1 import edge_pb2


def main(address: str, forks: int) -> None:
    pool = NodePool([parse_endpoint(address)], probe_interval=0.0005)
    pool._last_read = float("inf")  # probing as a reading pool does (an idle one is quiet)
    failed = 0
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            # Twice, on a new channel each: a call slow on a loaded host is not a child
            # whose inherited gRPC is broken (that one fails both).
            for _ in range(2):
                try:
                    connect(address).Status(edge_pb2.StatusRequest(), timeout=5)
                except Exception:  # noqa: BLE001, S112 - the parent counts a child failing both
                    continue
                os._exit(0)
            os._exit(3)
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    pool.close()
    print(f"failed {failed}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
