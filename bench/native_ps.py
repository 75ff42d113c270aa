"""Prototype of a native data path: the sync push+pull step of one worker and one shard over a raw
TCP socket, with no copy in user space. Measured as the ``native`` system of bench/run.py (bench/README.md);
not part of grpc-ps.

Roles (started by ``run.py``, system ``native``):
- ``shard``: accepts one connection. The parameters are ``partition_bytes`` partitions of a flat
  float32 vector, each a leaf tensor stepped by one ``torch.optim.SGD``. Per step, for each
  partition in order: ``recv_into`` the gradient buffer of that partition (the kernel's copy is the
  only one), check it is finite (one BLAS dot: finite only if every element is), step the optimizer
  on that partition alone, and ``sendall`` the partition's new values straight from the parameter's
  memory. Partition k's update and answer go out while the worker still sends k+1, k+2 ... (the
  pipelining a sync round of one rank allows).
- ``worker``: sends every partition of the gradient straight from the tensor's memory
  (``sendall(memoryview)``) while a second thread ``recv_into``s the answers straight into the
  weights. One step moves the payload up and down once, as grpc-ps's PushPull does.

What it leaves out, and a real data path behind the same RPCs would need: the gRPC call that
carries the header (rank, clock, version, plan digest, hyperparameters) and says which data
connection and which buffers the bytes go to; more than one rank per round (sum in rank order
before the step); authentication of the data connection (the call's token binds it); and TLS
(where TLS is on, the bytes would stay on the gRPC stream).
"""

from __future__ import annotations

import argparse
import socket
import struct
import threading

import torch
from _common import reply, serve, timed
from floor import recv_exactly

HEADER = struct.Struct("<QQ")
"""Per partition: its index and its byte count."""


def _views(numel: int, partition_bytes: int) -> list[tuple[int, int]]:
    per = max(1, partition_bytes // 4)
    return [(lo, min(numel, lo + per)) for lo in range(0, numel, per)]


def shard_role() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(300)
    state: dict[str, object] = {}

    def loop() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(HEADER.size)
        with conn:
            for _ in range(10**9):
                try:
                    recv_exactly(conn, memoryview(head))
                except ConnectionError:
                    return
                k, n = HEADER.unpack(head)
                params: list[torch.Tensor] = state["params"]  # type: ignore[assignment]
                grads: list[torch.Tensor] = state["grads"]  # type: ignore[assignment]
                p, g = params[k], grads[k]
                if n != g.numel() * 4:
                    raise ValueError(f"partition {k}: {n} bytes, expected {g.numel() * 4}")
                recv_exactly(conn, g.numpy().data.cast("B"))
                if not torch.isfinite(torch.dot(g, g)):
                    raise ValueError(f"partition {k} is not finite")
                p.grad = g
                state["optimizer"].step()  # type: ignore[attr-defined]
                p.grad = None
                conn.sendall(p.detach().numpy().data.cast("B"))

    def setup(bytes: int, partition_bytes: int = 4 << 20) -> None:  # noqa: A002 - the protocol's field name
        numel = bytes // 4
        full = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        params = [full[lo:hi].clone().requires_grad_(True) for lo, hi in _views(numel, partition_bytes)]
        state.update(
            params=params,
            grads=[torch.empty_like(p) for p in params],
            optimizer=torch.optim.SGD(params, lr=1e-3),
        )

    threading.Thread(target=loop, name="native-shard", daemon=True).start()
    reply({"ready": True, "port": listener.getsockname()[1]})
    serve({"setup": setup})


def worker_role(port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=300)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    state: dict[str, object] = {}

    def setup(bytes: int, partition_bytes: int = 4 << 20) -> None:  # noqa: A002
        numel = bytes // 4
        weights = torch.zeros(numel)
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3
        spans = _views(numel, partition_bytes)
        state.update(spans=spans, weights=weights, grad=grad)

    def receive(spans: list[tuple[int, int]], weights: torch.Tensor) -> None:
        for lo, hi in spans:
            recv_exactly(sock, weights[lo:hi].numpy().data.cast("B"))

    def step() -> None:
        spans: list[tuple[int, int]] = state["spans"]  # type: ignore[assignment]
        weights: torch.Tensor = state["weights"]  # type: ignore[assignment]
        grad: torch.Tensor = state["grad"]  # type: ignore[assignment]
        receiver = threading.Thread(target=receive, args=(spans, weights), name="native-recv")
        receiver.start()
        for k, (lo, hi) in enumerate(spans):
            sock.sendall(HEADER.pack(k, (hi - lo) * 4))
            sock.sendall(grad[lo:hi].numpy().data.cast("B"))
        receiver.join(60)
        if receiver.is_alive():
            raise TimeoutError("the shard's answer did not arrive within 60 s")

    def run(iters: int, warmup: int) -> dict[str, object]:
        return {"samples": {"sync step": timed(step, iters, warmup)}}

    reply({"ready": True})
    try:
        serve({"setup": setup, "run": run})
    finally:
        sock.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=("shard", "worker"))
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.role == "shard":
        shard_role()
    else:
        worker_role(args.port)


if __name__ == "__main__":
    main()
