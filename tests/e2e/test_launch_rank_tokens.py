"""``ps-launch --rank-tokens`` (issue 43): the shards get a token per rank, each worker holds only its
own, and a worker holding rank 1's token cannot push (or join) as rank 0 through the real processes."""

from __future__ import annotations

import hashlib
import json
import stat
import subprocess
import sys

from ps_server.service.rank_tokens import load_rank_tokens

LAUNCH = [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "2", "--no-progress", "--no-metrics"]

SCRIPT = """
import hashlib, json, os
import grpc, torch
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import DistributedOptimizer, PSClient
from ps_common.errors import reason_of

def digest(value):
    return hashlib.sha256(value.encode()).hexdigest()

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
client = PSClient.from_env(model)  # joins with PS_TOKEN: this rank's own token
rank, own = client.rank, os.environ["PS_TOKEN"]
refused = {}
if rank == 1:  # rank 1's token, requests stamped rank 0, straight to each shard
    as_me = (("authorization", "Bearer " + own),)
    for address in os.environ["PS_SERVERS"].split(","):
        with grpc.insecure_channel(address) as channel:
            stub = ps_pb2_grpc.ParameterServiceStub(channel)
            header = ps_pb2.PushHeader(rank=0, incarnation=1, clock=0, version=0)
            part = ps_pb2.Partition(key="weight", offset=0, length=4, dtype=ps_pb2.DTYPE_FLOAT32, data=bytes(16))
            calls = {
                "PushPullOnce": lambda: stub.PushPullOnce(
                    ps_pb2.PushPullOnceRequest(header=header, partitions=[part]), timeout=30, metadata=as_me),
                "Push": lambda: stub.Push(iter([ps_pb2.PushRequest(header=header)]), timeout=30, metadata=as_me),
                "Join": lambda: stub.Join(
                    ps_pb2.JoinRequest(rank=0, num_workers=2, incarnation=2**40), timeout=30, metadata=as_me),
            }
            for name, call in calls.items():
                try:
                    call()
                    refused[f"{address} {name}"] = "accepted"
                except grpc.RpcError as exc:
                    refused[f"{address} {name}"] = f"{exc.code().name} {reason_of(exc)}"
opt = DistributedOptimizer(model, client)
for step in range(int(os.environ["PS_STEPS"])):
    opt.zero_grad()
    model(torch.ones(8, 4)).pow(2).mean().backward()
    opt.step()
client.close()
print(json.dumps({"event": "done", "rank": rank, "token": digest(own), "refused": refused,
                  "env": sorted(digest(v) for v in os.environ.values() if v)}))
"""


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def test_each_worker_holds_only_its_token_and_cannot_push_as_another_rank(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    argv = [*LAUNCH, "--rank-tokens", "--steps", "4", "--json", "--log-dir", str(logs), str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"a token per rank in {logs / 'rank-tokens'}; each worker holds only its own" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps_run_per_rank"] == [4, 4] and summary["version"] == 4  # the refusals changed nothing
    for name in ("rank-tokens", "admin-token"):
        assert stat.S_IMODE((logs / name).stat().st_mode) == 0o600, name
    tokens = load_rank_tokens(str(logs / "rank-tokens"))
    assert tokens.ranks == {0, 1}
    admin = (logs / "admin-token").read_text().strip()
    said = {}
    for rank in (0, 1):
        (line,) = [s for s in (logs / f"worker-{rank}.log").read_text().splitlines() if s.startswith('{"event"')]
        said[rank] = json.loads(line)
    for rank, other in ((0, 1), (1, 0)):
        assert said[rank]["token"] == digest(tokens.token_of(rank))  # its own token...
        held = set(said[rank]["env"])
        assert digest(tokens.token_of(other)) not in held and digest(admin) not in held  # ...and no other
    refused = said[1]["refused"]
    assert len(refused) == 6 and set(refused.values()) == {"PERMISSION_DENIED WRONG_RANK"}, refused
    # a second run on the log directory keeps the job's tokens (its shards resume with them)
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert load_rank_tokens(str(logs / "rank-tokens")).token_of(1) == tokens.token_of(1)
