"""The README's Python API example as a complete script: an MLP on scikit-learn's 8x8 digits.

Run it with ``ps-launch --shards 2 --workers 2 examples/python_api.py``; under compose or Kubernetes
the same file runs unchanged (see the README, "Your own training script"). The cluster comes from
the environment contract (``PS_SERVERS``, ``PS_RANK``, ``PS_NUM_WORKERS``, ``PS_STEPS``...).
"""

import itertools
import json

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ps_worker import DistributedOptimizer, PSClient
from ps_worker.env import read_env
from ps_worker.resume import batches, resume_step

env = read_env()  # PS_SERVERS, PS_RANK, PS_NUM_WORKERS, PS_STEPS, PS_LR...: errors name the variable
torch.manual_seed(env.seed)  # every rank builds the same model; rank 0's values win at init anyway
x, y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
data = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

# PSClient.from_env(model) does the next two lines in one (TLS, PS_WIRE_DTYPE... included)
client = PSClient(list(env.servers), rank=env.rank, num_workers=env.num_workers, token=env.token or None)
client.init(model, optimizer={"name": "sgd", "lr": env.lr, "momentum": env.momentum})  # rank 0 writes, others wait
opt = DistributedOptimizer(model, client)
sampler = DistributedSampler(data, num_replicas=client.num_workers, rank=client.rank, seed=env.seed, drop_last=True)
loader = DataLoader(data, batch_size=env.batch_size, sampler=sampler, drop_last=True)
start = resume_step(client)  # 0, or the cluster's clock when the job resumes from checkpoints
loss = torch.tensor(float("nan"))
for xb, yb in itertools.islice(batches(loader, sampler, start), max(0, env.steps - start)):
    opt.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()  # push grads, pull weights: one PushPull call per shard
client.close()

with torch.no_grad():
    predicted = model(torch.tensor(x_test, dtype=torch.float32)).argmax(1)
    accuracy = float((predicted == torch.tensor(y_test)).float().mean())
print(f"rank {env.rank}: {env.steps} steps, last loss {loss.item():.4f}, held-out accuracy {accuracy:.4f}")
print(json.dumps({"event": "done", "rank": env.rank, "accuracy": accuracy}))  # ps-launch's summary shows it
