"""Model export: a finished job's model from its shards, after every worker has exited.

``ps-admin export`` (Admin/ExportParameters) writes a ``torch.save`` state_dict that a process
importing only torch loads into the same architecture; ``ps_worker.export`` assembles the same
tensors through a joined client's pull.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from ps_admin.export import write_model
from ps_common.tables import initial_rows, shard_of
from ps_common.wire import table_spec_to_proto
from ps_proto.v1 import ps_pb2
from ps_server.server import ShardServer
from ps_worker import DistributedOptimizer, PSClient
from ps_worker.export import pull_into
from ps_worker.model_file import init_from
from ps_worker.tables.modules import ShardedEmbedding
from ps_worker.workloads.digits import DigitsWorkload
from tests.conftest import RPC_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
PROCESS_TIMEOUT = 240


def servers_of(shards: Sequence[ShardServer]) -> str:
    return ",".join(s.address for s in shards)


def ps_admin(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ps_admin.cli", "--timeout", str(RPC_TIMEOUT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=PROCESS_TIMEOUT, cwd=ROOT)


# A process that imports torch and nothing of grpc-ps (a finder refuses ps_*; -I leaves the
# checkout off sys.path): the digits MLP, the exported file, the held-out set; prints accuracy.
FRESH = textwrap.dedent(
    """
    import hashlib, importlib.abc, json, sys

    class NoGrpcPs(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("ps_common", "ps_worker", "ps_server", "ps_admin", "ps_proto"):
                raise ImportError("grpc-ps must not be needed to load an exported model: " + name)
            return None

    sys.meta_path.insert(0, NoGrpcPs())
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model.load_state_dict(torch.load(sys.argv[1], weights_only=True))
    x, y = torch.load(sys.argv[2], weights_only=True)
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    h = hashlib.sha256()
    for key, p in model.named_parameters():  # as ps_worker.workloads.train.params_sha256
        h.update(key.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    loaded = sorted(m for m in sys.modules if m.split(".")[0].startswith("ps_"))
    print(json.dumps({"accuracy": accuracy, "params_sha256": h.hexdigest(), "grpc_ps_modules": loaded}))
    """
)


def test_export_after_every_worker_exited_loads_without_grpc_ps(start_cluster, tmp_path: Path) -> None:
    shards = start_cluster(2, num_workers=2, admin_token="admin-secret", token="worker-secret")
    env = {**os.environ, "PS_TOKEN": "worker-secret", "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ps_worker.workloads.cli",
                *("--servers", servers_of(shards), "--rank", str(rank), "--num-workers", "2"),
                *("--steps", "40", "--batch-size", "32", "--metrics-port", "-1", "--device", "cpu", "--json"),
                "digits",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for rank in range(2)
    ]
    summaries = []
    for w in workers:
        try:
            out, err = w.communicate(timeout=PROCESS_TIMEOUT)
        finally:
            w.kill()
        assert w.returncode == 0, err[-2000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    assert summaries[0]["params_sha256"] == summaries[1]["params_sha256"]

    model_file = tmp_path / "model.pt"
    refused = ps_admin("--servers", servers_of(shards), "export", "--out", str(model_file))
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and not model_file.exists()
    admin = ("--servers", servers_of(shards), "--admin-token", "admin-secret")
    done = ps_admin(*admin, "export", "--out", str(model_file))
    assert done.returncode == 0, done.stderr
    assert f"wrote {model_file}: 4 tensors" in done.stdout

    _, held_out = DigitsWorkload().datasets()
    torch.save(list(held_out.tensors), tmp_path / "held_out.pt")
    fresh = subprocess.run(
        [sys.executable, "-I", "-c", FRESH, str(model_file), str(tmp_path / "held_out.pt")],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
        cwd=tmp_path,
    )
    assert fresh.returncode == 0, fresh.stderr
    result = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert result["grpc_ps_modules"] == []
    assert result["params_sha256"] == summaries[0]["params_sha256"]  # bitwise the workers' final model
    assert result["accuracy"] == pytest.approx(summaries[0]["accuracy"], abs=1e-9)


class WithBatchNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


def test_client_state_dict_and_pull_into_match_the_exported_file(start_cluster, tmp_path: Path) -> None:
    shards = start_cluster(2, num_workers=1)
    torch.manual_seed(0)
    model = WithBatchNorm()
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT, partition_bytes=64) as c:
        c.init(model, {"name": "sgd", "lr": 0.1})
        opt = DistributedOptimizer(model, c)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 8)).square().mean().backward()
            opt.step()
        assert c.plan is not None and len(c.plan.owned_by(0)) > 1 and len(c.plan.owned_by(1)) > 1
        values = c.state_dict(like=model.state_dict())
        assert list(values) == [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]
        assert values["bn.num_batches_tracked"].dtype == torch.int64
        for key, t in model.state_dict().items():
            assert torch.equal(values[key], t), key
        fresh = WithBatchNorm()
        assert c.pull_into(fresh) == c.version
        for key, t in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], t), key
        with pytest.raises(KeyError, match="no"):
            pull_into(c, torch.nn.Linear(8, 3))

    model_file = tmp_path / "model.pt"
    done = ps_admin("--servers", servers_of(shards), "export", "--out", str(model_file))
    assert done.returncode == 0, done.stderr
    exported = torch.load(model_file, weights_only=True)
    assert list(exported) == list(values)
    for key, t in values.items():
        assert exported[key].dtype == t.dtype and torch.equal(exported[key], t), key
    loaded = WithBatchNorm()
    loaded.load_state_dict(exported)  # strict: every key, every shape


def test_export_refusals_write_nothing(start_cluster, tmp_path: Path) -> None:
    shards = start_cluster(2, num_workers=1)
    model_file = tmp_path / "model.pt"
    early = ps_admin("--servers", servers_of(shards), "export", "--out", str(model_file))
    assert early.returncode == 1 and "FAILED_PRECONDITION" in early.stderr and "rank 0 has not" in early.stderr
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as c:
        c.init(torch.nn.Linear(4, 2))
    swapped = ps_admin("--servers", f"{shards[1].address},{shards[0].address}", "export", "--out", str(model_file))
    assert swapped.returncode == 1 and "shard-index order" in swapped.stderr
    assert not model_file.exists() and not list(tmp_path.glob(".ps-export-*"))


def test_export_rpc_refuses_garbage_and_needs_the_admin_token(start_cluster) -> None:
    import grpc

    (shard,) = start_cluster(1, num_workers=1, admin_token="admin-secret", token="worker-secret")
    with grpc.insecure_channel(shard.address) as channel:
        call = channel.unary_stream("/ps.v1.Admin/ExportParameters")
        with pytest.raises(grpc.RpcError) as garbage:
            list(
                call(
                    b"\xff\xff\xff\x0f garbage",
                    timeout=RPC_TIMEOUT,
                    metadata=(("authorization", "Bearer admin-secret"),),
                )
            )
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        worker_token = (("authorization", "Bearer worker-secret"),)
        with pytest.raises(grpc.RpcError) as refused:
            list(call(b"", timeout=RPC_TIMEOUT, metadata=worker_token))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_exports_during_sync_training_are_of_one_version(start_cluster, start_trainer, wait_until, tmp_path) -> None:
    """2 shards x 2 sync ranks training flat out: every export is written from one version of all
    shards (the shards behind are read again), never a mix with only a warning."""
    shards = start_cluster(2, num_workers=2)
    trainers = [start_trainer(shards.addresses, rank=r, num_workers=2) for r in range(2)]
    wait_until(lambda: all(t.steps >= 5 for t in trainers), 60, "training under way")
    for i in range(5):
        model_file = tmp_path / f"model{i}.pt"
        done = ps_admin("--servers", servers_of(shards), "export", "--out", str(model_file))
        assert done.returncode == 0, done.stderr
        assert "different versions" not in done.stderr, done.stderr
        assert model_file.exists()
    assert all(t.steps > 5 for t in trainers) and all(t.error is None for t in trainers)
    for t in trainers:
        t.stop()


class WithTables(torch.nn.Module):
    """A sparse nn.Embedding (a dense [300, 4] table in the file), a table over a hashed id space
    too large for a matrix (``big.weight.ids``/``.rows`` in the file) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(300, 4, sparse=True)
        self.big = ShardedEmbedding(2**40, 3, seed=7)
        self.fc = torch.nn.Linear(7, 1)

    def forward(self, ids: torch.Tensor, hashed: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.emb(ids), self.big(hashed)], 1)).squeeze(1)


# Loads both files in a process that cannot import grpc-ps: no site (-S: no .pth, so no editable
# install), isolated (-I), sys.path only the directories torch and safetensors live in; prints each
# tensor's dtype, shape and sha256 of its bytes.
NO_GRPC_PS = textwrap.dedent(
    """
    import hashlib, json, sys
    sys.path += sys.argv[3].split("|")  # -I -S: the standard library only, then these
    try:
        import ps_server
    except ImportError:
        pass
    else:
        raise SystemExit("grpc-ps is importable here: " + ps_server.__file__)
    import torch
    from safetensors.torch import load_file

    def digest(state):
        raw = {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()}
        return {k: [str(v.dtype), list(v.shape), hashlib.sha256(raw[k]).hexdigest()] for k, v in state.items()}

    print(json.dumps([digest(load_file(sys.argv[1])), digest(torch.load(sys.argv[2], weights_only=True))]))
    """
)


def digest(state: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {
        k: [str(v.dtype), list(v.shape), hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()]
        for k, v in state.items()
    }


def test_export_with_tables_loads_without_grpc_ps_and_imports_back(start_cluster, tmp_path: Path) -> None:
    """Both formats hold the dense parameters and every table row bitwise as the shards serve them
    (rows sent in one-row chunks: partition_bytes 512); a fresh job on 2 new shards started from the file
    (``init_from``: rank 0 seeds the rows in InitTables chunks of 512 bytes) exports the same file again."""
    from safetensors.torch import load_file

    shards = start_cluster(2, num_workers=1)
    torch.manual_seed(0)
    model = WithTables()
    hashed = torch.tensor([3, 2**39 + 11, 2**40 - 1, 123456789])
    with PSClient(shards.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT, partition_bytes=512) as c:
        c.init(model, {"name": "sgd", "lr": 0.1, "sparse": {"name": "adagrad", "lr": 0.5}})
        opt = DistributedOptimizer(model, c)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad()
            model(
                torch.randint(0, 300, (8,), generator=g), hashed[torch.randint(0, 4, (8,), generator=g)]
            ).sum().backward()
            opt.step()
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        expected["emb.weight"] = c.pull_rows("emb.weight", torch.arange(300))
        expected["big.weight.ids"] = hashed.sort().values
        expected["big.weight.rows"] = c.pull_rows("big.weight", hashed.sort().values)
    assert not torch.equal(expected["big.weight.rows"], initial_rows("big.weight", 7, 1.0, hashed.sort().values, 3))

    files = [tmp_path / "model.safetensors", tmp_path / "model.pt"]
    assert write_model(shards.addresses, "", str(files[0])).endswith("version 3 (safetensors)")
    assert write_model(shards.addresses, "", str(files[1])).startswith(f"wrote {files[1]}: 5 tensors")
    exported = load_file(files[0])
    assert exported["emb.weight"].shape == (300, 4) and exported["emb.weight"].dtype == torch.float32
    assert digest(exported) == digest(expected)
    dirs = sorted({str(Path(m.__file__).resolve().parents[1]) for m in (torch, sys.modules["safetensors"])})
    fresh = subprocess.run(
        [sys.executable, "-I", "-S", "-c", NO_GRPC_PS, *map(str, files), "|".join(dirs)],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
        cwd=tmp_path,
    )
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout) == [digest(expected), digest(expected)]

    torch.manual_seed(1)
    again = WithTables()
    assert init_from(again, str(files[1])) == ["emb.weight", "big.weight.ids", "big.weight.rows"]
    second = start_cluster(2, num_workers=1)
    with PSClient(second.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT, partition_bytes=512) as c:
        c.init(again, {"name": "sgd", "lr": 0.1, "sparse": {"name": "adagrad", "lr": 0.5}})
        assert c.tables is not None and c.tables.calls["InitTables"] >= 4  # declare + >= 1 row chunk per shard
        round_trip = tmp_path / "again.pt"
        write_model(second.addresses, "", str(round_trip))
        back = torch.load(round_trip, weights_only=True)
        assert digest(back) == digest(expected)  # dense and table keys bitwise
        check_seed_refusals(c, expected["emb.weight"])


def check_seed_refusals(c: PSClient, emb: torch.Tensor) -> None:
    """On a seeded job before its first push: a retried seed changes nothing, a seed of rank 1 or
    of a row out of range is refused (INVALID_ARGUMENT); after a push, FAILED_PRECONDITION."""
    assert c.tables is not None
    specs = [table_spec_to_proto(s) for s in c.tables.specs.values()]
    k, row = next((k, r) for r in range(300) if (k := int(shard_of(torch.tensor([r]), 2))) == 0)
    stub = c.transport.stubs[k]

    def seed(rank: int, ids: list[int], values: torch.Tensor) -> ps_pb2.InitTablesResponse:
        block = ps_pb2.RowBlock(
            table="emb.weight", ids=torch.tensor(ids).numpy().astype("<i8").tobytes(), dtype=ps_pb2.DTYPE_FLOAT32
        )
        block.data = values.numpy().astype("<f4").tobytes()
        request = ps_pb2.InitTablesRequest(rank=rank, incarnation=c.session.incarnation, tables=specs, rows=[block])
        return stub.InitTables(request, timeout=RPC_TIMEOUT)

    assert not seed(0, [row], emb[row : row + 1]).applied  # the same row again: a no-op
    assert torch.equal(c.pull_rows("emb.weight", torch.tensor([row])), emb[row : row + 1])
    for rank, ids in ((1, [row]), (0, [300])):
        with pytest.raises(grpc.RpcError) as refused:
            seed(rank, ids, torch.zeros(1, 4))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    c.push_rows({"emb.weight": (torch.tensor([row]), torch.ones(1, 4))})
    with pytest.raises(grpc.RpcError) as started:
        seed(0, [row], torch.zeros(1, 4))
    assert started.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "before training" in started.value.details()
    assert not torch.equal(c.pull_rows("emb.weight", torch.tensor([row])), torch.zeros(1, 4))


def test_bad_model_files_are_refused_before_any_shard_is_asked(tmp_path: Path) -> None:
    unknown = ps_admin("--servers", "127.0.0.1:1", "export", "--out", str(tmp_path / "model.bin"))
    assert unknown.returncode == 1 and "suffix '.bin'" in unknown.stderr and "--format" in unknown.stderr
    missing = ps_admin("--servers", "127.0.0.1:1", "export", "--out", str(tmp_path / "no" / "model.pt"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    with pytest.raises(ValueError, match="is not a model file of this model"):
        torch.save({"fc.weight": torch.zeros(1, 7)}, tmp_path / "wrong.pt")
        init_from(WithTables(), str(tmp_path / "wrong.pt"))
