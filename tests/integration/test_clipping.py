"""DistributedOptimizer.clip_grad_norm_ clips a sync round's averaged gradient by its norm over every
shard, as DDP + torch.nn.utils.clip_grad_norm_ does; through real shards."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import torch.nn.functional as F

from ps_proto.v1 import ps_pb2
from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT, small_model
from tests.helpers import ddp_clip_script as script
from tests.integration.test_ddp_semantics import run_ranks

ROOT = Path(__file__).resolve().parents[2]

BATCH = 8
WORKERS = 2
MAX_NORM = 0.3
"""Cuts most steps of the small model (its averaged gradient's norm is about 0.3 to 1)."""


def data(n: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g) * 2, torch.randint(0, 3, (n,), generator=g)


SPEC = {"name": "sgd", "lr": 0.2, "momentum": 0.9}


def reference(steps: int) -> tuple[torch.nn.Module, list[float]]:
    """One process: the mean gradient of every rank's batch, torch's clip_grad_norm_, torch's SGD."""
    x, y = data(steps * WORKERS * BATCH)
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    norms = []
    for t in range(steps):
        opt.zero_grad()
        lo = t * WORKERS * BATCH
        F.cross_entropy(model(x[lo : lo + WORKERS * BATCH]), y[lo : lo + WORKERS * BATCH]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return model, norms


def train(addresses: list[str], steps: int, **client_kw: Any) -> list[tuple[torch.nn.Module, list[float]]]:
    """2 sync ranks, each its half of every step's batch, clipped with clip_grad_norm_."""
    x, y = data(steps * WORKERS * BATCH)
    models = [small_model() for _ in range(WORKERS)]  # before the threads: small_model seeds the global RNG

    def work(rank: int) -> tuple[torch.nn.Module, list[float]]:
        model = models[rank]
        with PSClient(addresses, rank=rank, num_workers=WORKERS, timeout=RPC_TIMEOUT, **client_kw) as client:
            client.init(model, SPEC)
            opt = DistributedOptimizer(model, client)
            norms = []
            for t in range(steps):
                opt.zero_grad()
                lo = (t * WORKERS + rank) * BATCH
                F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH]).backward()
                norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
                opt.step()
        return model, norms

    return run_ranks(WORKERS, work)


def assert_close(a: torch.nn.Module, b: torch.nn.Module, tol: float = 1e-5) -> None:
    for (key, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        diff = (p.double() - q.double()).abs().max().item()
        assert diff <= tol, f"{key}: max abs difference {diff}"


@pytest.mark.parametrize("partition_bytes", [4 << 20, 64], ids=["whole_parameters", "split_parameters"])
def test_clip_equals_torch_clip_of_the_averaged_gradient(start_cluster, partition_bytes: int) -> None:
    """2 shards x 2 workers: every step's clipped round equals one process's mean gradient clipped by
    torch.nn.utils.clip_grad_norm_, and clip_grad_norm_ returns that norm on every rank."""
    steps = 8
    shards = start_cluster(num_shards=2, num_workers=WORKERS)
    ranks = train([s.address for s in shards], steps, partition_bytes=partition_bytes)
    ref_model, ref_norms = reference(steps)
    assert sum(n > MAX_NORM for n in ref_norms) >= steps // 2, ref_norms  # the clip cuts
    for model, norms in ranks:
        assert_close(model, ref_model)
        assert norms == ranks[0][1]  # the same total norm on every rank, bitwise
        for got, want in zip(norms, ref_norms, strict=True):
            assert abs(got - want) <= 1e-5 * max(1.0, want), (norms, ref_norms)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, math.nan, math.inf])
def test_bad_max_norm_is_refused_and_pushes_nothing(start_cluster, max_norm: float) -> None:
    shards = start_cluster(num_shards=2, num_workers=1)
    model = small_model()
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, SPEC)
        opt = DistributedOptimizer(model, client)
        x, y = data(BATCH)
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(ValueError, match="max_norm"):
            opt.clip_grad_norm_(max_norm)
        with pytest.raises(ValueError, match="norm_type"):
            opt.clip_grad_norm_(1.0, norm_type=1.0)
        assert client.clock == 0 and all(s.shard.status().version == 0 for s in shards)
        opt.clip_grad_norm_(1.0)  # a good call afterwards clips and steps as usual
        assert opt.step() == 1


def test_ranks_sending_different_coefficients_are_refused(start_cluster) -> None:
    """The shard steps a held round with the first rank's coefficient; another rank's different one
    is FAILED_PRECONDITION, and the same one is accepted."""
    shards = start_cluster(num_shards=1, num_workers=WORKERS)
    models = [small_model() for _ in range(WORKERS)]
    clients = [
        PSClient([s.address for s in shards], rank=r, num_workers=WORKERS, timeout=RPC_TIMEOUT) for r in range(WORKERS)
    ]
    try:
        run_ranks(WORKERS, lambda r: clients[r].init(models[r], SPEC))
        replies = run_ranks(
            WORKERS,
            lambda r: clients[r].path.push({k: torch.ones_like(p) for k, p in models[r].named_parameters()}, hold=True),
        )
        (a,), (b,) = replies
        assert a.clip.round == b.clip.round == 0 and a.clip.sum_squares == b.clip.sum_squares == 195.0
        assert shards[0].shard.status().version == 0  # held, not stepped
        out = [{k: p.data for k, p in m.named_parameters()} for m in models]
        clients[0].path.pull(out[0], clip=ps_pb2.ClipCoefficient(round=0, coefficient=0.5))
        with pytest.raises(grpc.RpcError) as refused:
            clients[1].path.pull(out[1], clip=ps_pb2.ClipCoefficient(round=0, coefficient=0.25))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "0.5" in refused.value.details()
        assert clients[1].path.pull(out[1], clip=ps_pb2.ClipCoefficient(round=0, coefficient=0.5)) == 1
        with pytest.raises(grpc.RpcError) as bad:
            clients[1].path.pull(out[1], clip=ps_pb2.ClipCoefficient(round=0, coefficient=1.5))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the round stepped once, with the mean gradient (ones) times 0.5: sgd lr 0.2, momentum 0.9
        assert_close(models[0], models[1], tol=0.0)
        fresh = small_model()
        for p, q in zip(models[0].parameters(), fresh.parameters(), strict=True):
            assert torch.allclose(p, q - 0.2 * 0.5, atol=1e-7)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("mode", ["async", "ssp", "easgd"])
def test_other_modes_refuse_clip_grad_norm(start_cluster, mode: str) -> None:
    """No round average exists outside sync: clip_grad_norm_ says so, and pushes nothing."""
    shards = start_cluster(num_shards=1, num_workers=1, mode=mode)
    model = small_model()
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, SPEC)
        local = torch.optim.SGD(model.parameters(), lr=0.1) if mode == "easgd" else None
        opt = DistributedOptimizer(model, client, local)
        x, y = data(BATCH)
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(RuntimeError, match=f"runs {mode}.*torch.nn.utils.clip_grad_norm_"):
            opt.clip_grad_norm_(1.0)
        assert client.clock == 0
        opt.step()  # an ordinary step still works
        if mode != "easgd":
            with pytest.raises(grpc.RpcError) as refused:  # the wire refuses a held push too
                client.path.push({k: torch.ones_like(p) for k, p in model.named_parameters()}, hold=True)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nanogpt_like_clip_equals_ddp_on_gloo(start_cluster, tmp_path: Path) -> None:
    """nanoGPT's recipe as its script has it: AdamW with decay groups built by parameter identity and
    handed over as the torch optimizer itself, accumulation over 2 micro-batches, a cosine LambdaLR
    and clipping at 1.0 that cuts: grpc-ps sync (2 workers x 2 shards) ends within 1e-5 of DDP on
    gloo (2 ranks) in parameters, in the optimizer state ``opt.state_dict()`` gives (AdamW's moments
    and steps, torch's numbering) and in every step's total norm."""
    port = _free_port()
    outs = [tmp_path / f"ddp{r}.pt" for r in range(script.WORLD)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.ddp_clip_script", str(r), str(port), str(outs[r])],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(script.WORLD)
    ]
    try:
        shards = start_cluster(num_shards=2, num_workers=script.WORLD)
        nets = [script.model() for _ in range(script.WORLD)]

        def work(rank: int) -> tuple[list[float], dict[str, Any]]:
            net = nets[rank]
            with PSClient(
                [s.address for s in shards],
                rank=rank,
                num_workers=script.WORLD,
                timeout=RPC_TIMEOUT,
                partition_bytes=256,
            ) as client:
                adamw = script.torch_optimizer(net)
                client.init(net, adamw)
                opt = DistributedOptimizer(net, client, adamw, backward_passes_per_step=script.K)
                norms = script.train(rank, net, opt, lambda: opt.clip_grad_norm_(script.MAX_NORM))
                return norms, opt.state_dict()

        results = run_ranks(script.WORLD, work, timeout=120)
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for rank in range(script.WORLD):
        ddp = torch.load(outs[rank], weights_only=True)
        norms, state = results[rank]
        assert sum(n > script.MAX_NORM for n in ddp["norms"]) >= script.STEPS // 2, ddp["norms"]  # the clip cuts
        for got, want in zip(norms, ddp["norms"], strict=True):
            assert abs(got - want) <= 1e-5 * max(1.0, want), (norms, ddp["norms"])
        for key, value in nets[rank].state_dict().items():
            diff = (value.double() - ddp["state"][key].double()).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {key}: max abs difference {diff} from DDP"
        want_state = ddp["optimizer"]["state"]
        assert sorted(state["state"]) == sorted(want_state) and len(want_state) == len(list(nets[rank].parameters()))
        for number, want in want_state.items():
            assert sorted(state["state"][number]) == sorted(want)  # step, exp_avg, exp_avg_sq
            for name, value in want.items():
                diff = (state["state"][number][name].double() - value.double()).abs().max().item()
                assert diff <= 1e-5, f"parameter {number} {name}: max abs difference {diff} from DDP's AdamW"
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        want_groups = [{k: v for k, v in g.items() if k != "params"} for g in ddp["optimizer"]["param_groups"]]
        assert [(g["lr"], g["weight_decay"]) for g in groups] == [(g["lr"], g["weight_decay"]) for g in want_groups]


def test_amp_unscale_then_clip_skips_an_overflowed_round_everywhere(start_cluster) -> None:
    """torch's AMP recipe (unscale_, clip, step, update): an overflow on rank 1 skips the round on
    every shard, clip_grad_norm_ returns inf on both ranks, and both scalers back off; clipping
    before unscale_ is refused with nothing pushed."""
    shards = start_cluster(num_shards=2, num_workers=WORKERS)
    x, y = data(4 * WORKERS * BATCH)

    def work(rank: int) -> tuple[list[float], float]:
        model = small_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        with PSClient([s.address for s in shards], rank=rank, num_workers=WORKERS, timeout=RPC_TIMEOUT) as client:
            client.init(model, SPEC)
            opt = DistributedOptimizer(model, client, grad_scaler=scaler)
            norms = []
            for t in range(4):
                opt.zero_grad()
                lo = (t * WORKERS + rank) * BATCH
                loss = F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH])
                if t == 1 and rank == 1:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                if t == 0:
                    with pytest.raises(RuntimeError, match="unscale_"):
                        opt.clip_grad_norm_(MAX_NORM)
                scaler.unscale_(opt)
                norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
                scaler.step(opt)
                scaler.update()
            assert client.version == 4
        return norms, scaler.get_scale()

    results = run_ranks(WORKERS, work)
    for norms, scale in results:
        assert norms[1] == math.inf and all(math.isfinite(n) for n in norms[:1] + norms[2:])
        assert scale == 2.0**7  # one back-off on every rank
    assert results[0][0] == results[1][0]
