"""Bytes per shard of the partition plan: max/mean for every built-in workload's model and the bench model.

    python bench/plan_balance.py                 # 2 and 4 shards, the default 4 MiB partition_bytes
    python bench/plan_balance.py --shards 2,3,8

No cluster and no training: each model is built as ``ps-worker`` builds it, and its plan is made by
``ps_common.plan.make_plan`` from what ``PSClient.init`` puts in it (the dense parameters, then the
buffers; a sparse embedding table's weight leaves the plan, its rows are spread by id). The busiest
shard sets a sync step's time, so max/mean is the slowdown the plan costs against a perfect split.
"""

from __future__ import annotations

import argparse

import torch

from ps_common.plan import DEFAULT_PARTITION_BYTES, make_plan
from ps_worker.planning import model_specs
from ps_worker.tables.modules import table_weights
from ps_worker.workloads.registry import WORKLOADS


class Flat(torch.nn.Module):
    """The 100 MB bench model of ``bench/grpc_ps.py``: one float32 parameter of 25,000,000 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(25_000_000))


class MnistNet(torch.nn.Module):
    """pytorch/examples ``mnist/main.py``'s ``Net`` (its ``fc1`` is 4.5 MiB: one layer outweighs the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, 1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, 1)
        self.fc1 = torch.nn.Linear(9216, 128)
        self.fc2 = torch.nn.Linear(128, 10)


def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    out = {f"workload {name}": make().model() for name, make in WORKLOADS.items()}
    out["pytorch/examples mnist Net"] = MnistNet()
    out["bench 100 MB (grpc_ps.py)"] = Flat()
    return out


def loads(model: torch.nn.Module, shards: int) -> list[int]:
    """Payload bytes per shard of ``model``'s plan (parameters without tables, then buffers)."""
    tables = table_weights(model)
    named = [(k, p) for k, p in model.named_parameters() if k not in tables]
    named += [(k, b if b.is_floating_point() else b.to(torch.float64)) for k, b in model.named_buffers()]
    return make_plan(model_specs(named), shards, DEFAULT_PARTITION_BYTES).shard_bytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", default="2,4", help="comma-separated shard counts (default 2,4)")
    counts = [int(s) for s in p.parse_args().shards.split(",")]
    print("| model | plan bytes | " + " | ".join(f"max/mean, {s} shards" for s in counts) + " |")
    print("|---|---|" + "---|" * len(counts))
    for name, model in models().items():
        cells = []
        for s in counts:
            per = loads(model, s)
            cells.append(f"{max(per) / (sum(per) / s):.3f}")
        print(f"| {name} | {sum(loads(model, 1)):,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
