"""The machine's own limits: memcpy of the payload, and a round trip of it over one loopback TCP socket pair.

Roles (started by ``run.py``):
- ``memcpy``: ``torch.clone`` and ``numpy.copyto`` of the payload, each call timed.
- ``tcp-server``: accepts one connection; for each message (8-byte length, then the bytes) received
  into a preallocated buffer, sends the same bytes back. Plain blocking sockets, no framing library.
- ``tcp-client``: sends the payload and receives it back; one round trip moves the payload up and
  down once each, as a push and a pull do.
"""

from __future__ import annotations

import argparse
import socket
import struct
import threading

import numpy as np
from _common import reply, serve, timed

HEADER = struct.Struct("<Q")


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def memcpy_role() -> None:
    import torch  # only here: the TCP roles start faster without it

    state: dict[str, object] = {}

    def setup(bytes: int) -> None:  # noqa: A002 - the protocol's field name
        src = torch.randn(bytes // 4)
        state.update(src=src, dst=torch.empty_like(src), np_src=src.numpy(), np_dst=np.empty(bytes // 4, np.float32))

    def run(iters: int, warmup: int) -> dict[str, object]:
        src, dst = state["src"], state["dst"]
        np_src, np_dst = state["np_src"], state["np_dst"]
        return {
            "samples": {
                "torch.clone": timed(lambda: src.clone(), iters, warmup),  # type: ignore[attr-defined]
                "torch copy_": timed(lambda: dst.copy_(src), iters, warmup),  # type: ignore[attr-defined]
                "numpy copyto": timed(lambda: np.copyto(np_dst, np_src), iters, warmup),  # type: ignore[arg-type]
            }
        }

    reply({"ready": True})
    serve({"setup": setup, "run": run})


def tcp_server_role() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(300)

    def echo() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        head = bytearray(HEADER.size)
        with conn:
            for _ in range(10**9):
                try:
                    recv_exactly(conn, memoryview(head))
                except ConnectionError:
                    return
                (n,) = HEADER.unpack(head)
                if len(buf) < n:
                    buf = bytearray(n)
                view = memoryview(buf)[:n]
                recv_exactly(conn, view)
                conn.sendall(view)

    threading.Thread(target=echo, name="echo", daemon=True).start()
    reply({"ready": True, "port": listener.getsockname()[1]})
    serve({})


def tcp_client_role(port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=300)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    state: dict[str, bytearray] = {}

    def setup(bytes: int) -> None:  # noqa: A002
        state["out"] = bytearray(np.random.default_rng(0).standard_normal(bytes // 4, np.float32).tobytes())
        state["back"] = bytearray(len(state["out"]))

    def round_trip() -> None:
        out, back = state["out"], state["back"]
        sock.sendall(HEADER.pack(len(out)))
        sock.sendall(out)
        recv_exactly(sock, memoryview(back))

    def run(iters: int, warmup: int) -> dict[str, object]:
        return {"samples": {"round trip": timed(round_trip, iters, warmup)}}

    reply({"ready": True})
    try:
        serve({"setup": setup, "run": run})
    finally:
        sock.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=("memcpy", "tcp-server", "tcp-client"))
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.role == "memcpy":
        memcpy_role()
    elif args.role == "tcp-server":
        tcp_server_role()
    else:
        tcp_client_role(args.port)


if __name__ == "__main__":
    main()
