"""Peer: a ``torch.distributed.rpc`` parameter server, the canonical synchronous pattern.

One PS process holds the weights and an SGD optimizer; each worker calls
``rpc_sync("ps", update_and_fetch, args=(grad,))``, which adds the gradient and, once every worker's
gradient of the round is in, averages them, steps the optimizer and answers every worker with the
new weights (PyTorch's "batch-updating parameter server" example, ``@rpc.functions.async_execution``
with a shared ``torch.futures.Future``). The worker copies the weights into its model, as a pull does.

TensorPipe is restricted to its TCP transport (``uv``) and ``basic`` channel, so the bytes cross
loopback TCP as they do for gRPC and gloo; its same-host shortcuts (shared memory, cross-memory
attach) would not exist between two machines. ``--host`` (default 127.0.0.1) is the PS's address,
where the ranks meet; on another interface ``TP_SOCKET_IFNAME`` names the one TensorPipe listens
on (``emulated.py`` sets it in each network namespace).
"""

from __future__ import annotations

import argparse
import threading

import torch
import torch.distributed.rpc as rpc
from _common import reply, serve, timed


class ParameterServer:
    """Weights of ``numel`` float32, summed gradients of a round of ``workers`` pushes."""

    def __init__(self, numel: int, workers: int, lr: float = 1e-3) -> None:
        self.weight = torch.zeros(numel, requires_grad=True)
        self.weight.grad = torch.zeros(numel)
        self.optimizer = torch.optim.SGD([self.weight], lr=lr)
        self.workers = workers
        self.pending = 0
        self.lock = threading.Lock()
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()


PS: ParameterServer | None = None


@rpc.functions.async_execution
def update_and_fetch(grad: torch.Tensor) -> torch.futures.Future[list[torch.Tensor]]:
    """Add ``grad`` to the round; the returned future completes with the weights after the round's step."""
    ps = PS
    assert ps is not None and ps.weight.grad is not None
    with ps.lock:
        ps.weight.grad += grad
        ps.pending += 1
        future = ps.future
        if ps.pending == ps.workers:
            ps.weight.grad /= ps.workers
            ps.optimizer.step()
            ps.optimizer.zero_grad(set_to_none=False)
            ps.pending = 0
            ps.future = torch.futures.Future()
            future.set_result([ps.weight.detach()])
    return future


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True, help="0 is the PS, 1..W the workers")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address of the PS (rank 0), where the ranks meet")
    args = p.parse_args()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{args.host}:{args.port}",
        num_worker_threads=16,
        rpc_timeout=300,
        _transports=["uv"],
        _channels=["basic"],
    )
    name = "ps" if args.rank == 0 else f"worker{args.rank}"
    rpc.init_rpc(name, rank=args.rank, world_size=args.workers + 1, rpc_backend_options=options)
    state: dict[str, torch.Tensor] = {}

    def setup(bytes: int) -> None:  # noqa: A002 - the protocol's field name
        global PS
        if args.rank == 0:
            PS = ParameterServer(bytes // 4, args.workers)
        else:
            state["grad"] = torch.randn(bytes // 4) * 1e-3
            state["weight"] = torch.zeros(bytes // 4)

    def step() -> None:
        (weights,) = rpc.rpc_sync("ps", update_and_fetch, args=(state["grad"],))
        state["weight"].copy_(weights)

    def run(iters: int, warmup: int) -> dict[str, object]:
        return {"samples": {"sync step": timed(step, iters, warmup)}}

    reply({"ready": True})
    try:
        serve({"setup": setup, "run": run})
    finally:
        rpc.shutdown(graceful=False)


if __name__ == "__main__":
    main()
