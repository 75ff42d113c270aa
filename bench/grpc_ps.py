"""grpc-ps: one worker process driving ``PSClient`` against real ``ps-server`` shard processes.

A step is what ``DistributedOptimizer.step()`` does in sync mode: ``client.push_pull({key: grad},
{key: weight})``, one PushPull call per shard that pushes the gradient and copies the round's new
weights in place. The model is either one flat float32 parameter of the payload's size, or
(``model="digits"``) the built-in digits MLP; ``wire_dtype`` bfloat16/float16 halves the bytes.
"""

from __future__ import annotations

import argparse

import torch
from _common import reply, serve, timed

from ps_common.process_env import tune_malloc_at_start
from ps_worker.client import PSClient
from ps_worker.workloads.digits import DigitsWorkload


class Flat(torch.nn.Module):
    """One parameter ``w`` of ``numel`` float32 (a model's weights, flattened)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument(
        "--plain",
        action="store_true",
        help="started without GLIBC_TUNABLES: set up the process as ps-worker does (restart with them)",
    )
    args = p.parse_args()
    if args.plain:
        tune_malloc_at_start()
    state: dict[str, object] = {}

    def close() -> None:
        client = state.pop("client", None)
        if isinstance(client, PSClient):
            client.close()

    def setup(
        servers: list[str],
        bytes: int = 0,
        model: str = "flat",
        partition_bytes: int = 4 << 20,  # noqa: A002
        wire_dtype: str = "float32",
        data_path: str = "tcp",
    ) -> dict[str, object]:
        close()
        torch.manual_seed(0)
        net = DigitsWorkload().model() if model == "digits" else Flat(bytes // 4)
        client = PSClient(
            servers,
            args.rank,
            args.workers,
            timeout=300,
            retry_deadline=60,
            partition_bytes=partition_bytes,
            wire_dtype=None if wire_dtype == "float32" else wire_dtype,
            data_path=data_path,
        )
        state["client"] = client
        client.init(net, {"name": "sgd", "lr": 1e-3})
        params = {k: p.data for k, p in net.named_parameters()}
        state["params"] = params
        state["grads"] = {k: torch.randn_like(t) * 1e-3 for k, t in params.items()}
        return {"bytes": sum(t.numel() * t.element_size() for t in params.values())}

    def step() -> None:
        client = state["client"]
        assert isinstance(client, PSClient)
        client.push_pull(state["grads"], state["params"])  # type: ignore[arg-type]

    def run(iters: int, warmup: int) -> dict[str, object]:
        return {"samples": {"sync step": timed(step, iters, warmup)}}

    reply({"ready": True})
    try:
        serve({"setup": setup, "run": run, "close": close})
    finally:
        close()


if __name__ == "__main__":
    main()
