"""``ps-launch train.py`` sets torchrun's whole environment: a script forms a gloo process group beside
grpc-ps (metrics, barriers) while its gradients go through the shards (issue 44)."""

from __future__ import annotations

import json
import subprocess
import sys

LAUNCH = [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "2", "--no-progress", "--no-metrics"]

SCRIPT = """
import json, os
from datetime import timedelta
import torch
import torch.distributed as dist
from ps_worker import DistributedOptimizer, PSClient

dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
client = PSClient.from_env(model)
opt = DistributedOptimizer(model, client)
steps = int(os.environ["PS_STEPS"])
x = torch.randn(64, 4, generator=torch.Generator().manual_seed(rank))
for step in range(steps):
    opt.zero_grad()
    loss = (model(x) - 1).pow(2).mean()
    loss.backward()
    opt.step()
dist.barrier()
metric = torch.tensor([float(rank + 1), float(loss)])
dist.all_reduce(metric)  # validation metrics summed over the ranks, as imagenet's script does
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(weights) for _ in range(world)]
dist.all_gather(gathered, weights)
dist.barrier()
client.close()
dist.destroy_process_group()
print(json.dumps({"event": "done", "rank_sum": metric[0].item(), "world": world,
                  "master": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]],
                  "same_weights": all(torch.equal(g, gathered[0]) for g in gathered)}))
"""


def test_a_script_forms_a_gloo_process_group_beside_grpc_ps(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    argv = [*LAUNCH, "--steps", "5", "--json", "--log-dir", str(logs), str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps_run_per_rank"] == [5, 5] and summary["version"] == 5  # trained through the shards
    said = []
    for rank in (0, 1):
        (line,) = [s for s in (logs / f"worker-{rank}.log").read_text().splitlines() if s.startswith('{"event"')]
        said.append(json.loads(line))
    assert [s["rank_sum"] for s in said] == [3.0, 3.0] and {s["world"] for s in said} == {2}
    assert all(s["same_weights"] for s in said)  # sync grpc-ps: both ranks end with the shards' weights
    (master,) = {tuple(s["master"]) for s in said}  # one MASTER_ADDR:MASTER_PORT for the job, drawn free
    assert master[0] == "127.0.0.1" and 1024 <= int(master[1]) <= 65535
