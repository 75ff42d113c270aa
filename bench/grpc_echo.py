"""The transport's floor: a minimal grpcio echo of the same bytes, in the same message sizes as grpc-ps.

Roles (started by ``run.py``):
- ``server``: a synchronous ``grpc.server`` (a thread pool, as ``ps-server`` runs) with two
  methods and pass-through (identity) serializers: ``Stream`` (bidirectional: every request
  message is yielded straight back) and ``Once`` (unary: the request is the response). No
  validation, no optimizer, no copy of ours: what is left is grpcio's own work and the kernel's.
- ``client``: the payload cut into messages of ``partition_bytes`` (grpc-ps's default 4 MiB
  partitions), each a ready-made ``bytes``; a step sends them all on one ``Stream`` call and reads
  every echo back; a payload that fits in one message takes one ``Once`` call instead, as grpc-ps
  does (PushPullOnce). One step moves the payload up and down once, as a sync push+pull does.

grpc-ps does more per step than this floor: it builds each message from the gradient tensor (one
copy), checks and sums what arrives, runs the optimizer, and the worker copies the new weights
into its parameters. The ratio "grpc-ps / grpc echo" is what grpc-ps costs above grpcio itself.
"""

from __future__ import annotations

import argparse
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from _common import reply, serve, timed

SERVICE = "bench.Echo"
LIMIT = 64 << 20
"""Largest message either side accepts, bytes (above grpc-ps's default 4 MiB partitions)."""
OPTIONS = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]


def _same(b: bytes) -> bytes:
    return b


def server_role() -> None:
    pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="echo")
    server = grpc.server(pool, options=[*OPTIONS, ("grpc.so_reuseport", 0)])

    def stream(requests: Any, context: grpc.ServicerContext) -> Any:
        yield from requests

    def once(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    handlers = {
        "Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same),
        "Once": grpc.unary_unary_rpc_method_handler(once, _same, _same),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    reply({"ready": True, "port": port})
    try:
        serve({})
    finally:
        server.stop(None)


def client_role(port: int) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
    stream = channel.stream_stream(f"/{SERVICE}/Stream", _same, _same)
    once = channel.unary_unary(f"/{SERVICE}/Once", _same, _same)
    state: dict[str, list[bytes]] = {}

    def setup(bytes: int, partition_bytes: int = 4 << 20) -> None:  # noqa: A002 - the protocol's field name
        data = np.random.default_rng(0).standard_normal(bytes // 4, np.float32).tobytes()
        state["messages"] = [data[i : i + partition_bytes] for i in range(0, len(data), partition_bytes)]

    def step() -> None:
        messages = state["messages"]
        if len(messages) == 1:
            back = [once(messages[0], timeout=60)]
        else:
            back = list(stream(iter(messages), timeout=60))
        if sum(map(len, back)) != sum(map(len, messages)):
            raise RuntimeError("the echo lost bytes")

    def run(iters: int, warmup: int) -> dict[str, object]:
        return {"samples": {"echo": timed(step, iters, warmup)}}

    reply({"ready": True})
    try:
        serve({"setup": setup, "run": run})
    finally:
        channel.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=("server", "client"))
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.role == "server":
        server_role()
    else:
        client_role(args.port)


if __name__ == "__main__":
    main()
