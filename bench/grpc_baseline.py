"""A bare grpcio server-streaming baseline: ReadShard answered from memory.

    python -m bench.grpc_baseline FRAMES.pkl

Serves ``/edgecache.v1.EdgeCache/ReadShard`` with the same wire bytes an edge
node would send (loaded from a pickle of {shard: [chunk message bytes]}), on
grpc.aio with the same message-size options, and nothing else: no cache, no
checksums, no bookkeeping. Prints ``serving on HOST:PORT``. Its allocator is
set as ``edgecache serve`` sets the node's (``edge.allocator``): left at glibc's
defaults it faulted every message's pages in afresh, a handicap the node no
longer has, not grpcio's ceiling (with those settings in every process of a
``bench.peers`` run, the bare stream read 1.9 GB/s of images against 1.4).
"""

from __future__ import annotations

import asyncio
import pickle
import sys

import grpc
from grpc import aio

from edgecache.edge.allocator import keep_message_buffers
from edgecache.edge.server import CHANNEL_OPTIONS
from edgecache.v1 import edge_pb2


async def main(path: str) -> None:
    keep_message_buffers()
    with open(path, "rb") as f:
        shards: dict[int, list[bytes]] = pickle.load(f)

    async def read_shard(request: edge_pb2.ReadShardRequest, context: aio.ServicerContext):  # noqa: ANN202
        for message in shards[request.shard][request.start_chunk :]:
            yield message

    handler = grpc.method_handlers_generic_handler(
        "edgecache.v1.EdgeCache",
        {
            "ReadShard": grpc.unary_stream_rpc_method_handler(
                read_shard,
                request_deserializer=edge_pb2.ReadShardRequest.FromString,
                response_serializer=None,
            )
        },
    )
    server = aio.server(options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
