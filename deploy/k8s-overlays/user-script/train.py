"""A user's own training script, as the deployment tests run it through the worker image.

It knows nothing of compose or Kubernetes: it reads the environment contract (``PS_SERVERS``,
``PS_RANK``, ``PS_NUM_WORKERS``, ``PS_TOKEN``) through ``ps_worker.init_from_env()`` when that
exists, else builds a ``PSClient`` from the same variables; trains an MLP on scikit-learn's
bundled digits for ``PS_STEPS`` steps (300 by default), and prints one JSON summary line.
(deploy/k8s-overlays/user-script/train.py is a copy of this file, as a user would copy theirs.)
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ps_worker
from ps_worker import DistributedOptimizer, PSClient


def connect() -> PSClient:
    """The client of the environment contract."""
    if hasattr(ps_worker, "init_from_env"):
        return ps_worker.init_from_env()
    return PSClient(
        os.environ["PS_SERVERS"].split(","),
        rank=int(os.environ["PS_RANK"]),
        num_workers=int(os.environ["PS_NUM_WORKERS"]),
        token=os.environ.get("PS_TOKEN") or None,
    )


def main() -> None:
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_train, x_test = (torch.tensor(a / 16.0, dtype=torch.float32) for a in (x_train, x_test))
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    client = connect()
    client.init(model, {"name": "sgd", "lr": 0.1, "momentum": 0.9})
    opt = DistributedOptimizer(model, client)
    steps, batch = int(os.environ.get("PS_STEPS", "300")), 32
    mine = torch.arange(client.rank, len(x_train), client.num_workers)  # this rank's share of the data
    g = torch.Generator().manual_seed(client.rank)
    for _ in range(steps):
        idx = mine[torch.randint(len(mine), (batch,), generator=g)]
        opt.zero_grad()
        F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
        opt.step()
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    h = hashlib.sha256()
    for key, p in model.named_parameters():
        h.update(key.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    client.close()
    summary = {"event": "done", "rank": client.rank, "steps": steps, "accuracy": accuracy}
    print(json.dumps({**summary, "params_sha256": h.hexdigest()}), flush=True)


if __name__ == "__main__":
    main()
