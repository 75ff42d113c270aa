"""Peer: ``torch.distributed`` gloo all_reduce of the payload between ranks, each rank a process.

An all_reduce leaves every rank with the sum, which is what a sync parameter-server step gives
(push the gradient, pull the weights the summed gradient produced). Ranks meet through
``init_method=tcp://MASTER_ADDR:PORT`` (``--master-addr``, default 127.0.0.1: loopback); gloo
moves the bytes over TCP (on another interface, ``GLOO_SOCKET_IFNAME`` names the one to use, as
``emulated.py`` does in its network namespaces).
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from _common import reply, serve, timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1", help="address of rank 0's rendezvous store")
    args = p.parse_args()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=300),
    )
    state: dict[str, torch.Tensor] = {}

    def setup(bytes: int) -> None:  # noqa: A002 - the protocol's field name
        state["t"] = torch.randn(bytes // 4)

    def run(iters: int, warmup: int) -> dict[str, object]:
        t = state["t"]
        dist.barrier()
        return {"samples": {"all_reduce": timed(lambda: dist.all_reduce(t), iters, warmup)}}

    reply({"ready": True})
    try:
        serve({"setup": setup, "run": run})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
