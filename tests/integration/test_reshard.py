"""Offline reshard on real shards: a sync job checkpointed on 2 shards, resharded onto 3 and onto 1,
resumes and ends bitwise where an uninterrupted run on 3 (1) shards ends; its embedding table rows
too. Bad input is refused and changes nothing."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ps_common.errors import CheckpointError
from ps_server.checkpoint.files import CheckpointStore
from ps_server.checkpoint.reshard import ReshardError, reshard_states
from ps_server.checkpoint.reshard_cli import checkpoint_files, main, read_set, reshard_directory
from ps_server.tables.admission import AdmissionFilter
from ps_server.tables.table import table_row_bytes
from ps_server.tables.table_io import spec_from_export
from ps_worker import DistributedOptimizer, PSClient

RPC_TIMEOUT = 20.0
WORKERS = 2
K, M = 4, 3  # rounds before the stop, rounds after the restart


class Model(nn.Module):
    """A dense MLP (partitions cut differently on 1, 2 and 3 shards) and, when ``table``, a sparse
    embedding (a shard table, rows placed by id)."""

    def __init__(self, table: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(200, 4, sparse=True) if table else None
        self.fc1 = nn.Linear(8 if table else 12, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = torch.cat([x[:, :4], self.emb(ids)], 1)
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (
        torch.randn(8, 12, generator=g),
        torch.randint(0, 200, (8,), generator=g),
        torch.randint(0, 3, (8,), generator=g),
    )


def train(addresses: list[str], steps: range, table: bool) -> dict[str, torch.Tensor]:
    """Ranks 0..WORKERS-1 (threads) run sync ``steps``; rank 0's final parameters (and table rows)."""
    optimizer: dict[str, Any] = {"name": "adam", "lr": 0.01}
    if table:
        optimizer["sparse"] = {"name": "adam", "lr": 0.05}
    out: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    models = []
    for _ in range(WORKERS):
        torch.manual_seed(0)  # before the threads: torch's global generator is shared
        models.append(Model(table))

    def worker(rank: int) -> None:
        try:
            m = models[rank]
            with PSClient(addresses, rank=rank, num_workers=WORKERS, timeout=RPC_TIMEOUT) as c:
                c.init(m, dict(optimizer))
                opt = DistributedOptimizer(m, c)
                for step in steps:
                    x, ids, y = batch(step, rank)
                    opt.zero_grad()
                    F.cross_entropy(m(x, ids), y).backward()
                    opt.step()
                if rank == 0:
                    out.update({k: v.detach().clone() for k, v in m.named_parameters()})
                    if table:
                        out["emb.weight"] = c.pull_rows("emb.weight", torch.arange(200))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return out


def run(start_cluster, shards: int, steps: range, table: bool, checkpoint_dir: Path | None = None) -> dict:
    config: dict[str, Any] = {"mode": "sync"}
    if checkpoint_dir is not None:
        config |= {"checkpoint_dir": str(checkpoint_dir), "checkpoint_every": 2}
    cluster = start_cluster(num_shards=shards, num_workers=WORKERS, **config)
    try:
        return train(cluster.addresses, steps, table)
    finally:
        for s in cluster:
            s.stop(grace=0.2)


def test_a_resharded_job_resumes_bitwise_as_one_run_on_the_new_shard_count(tmp_path, start_cluster) -> None:
    table = True  # dense layers (partitions cut differently on 1, 2 and 3 shards) and a table
    old = tmp_path / "two"
    run(start_cluster, 2, range(K), table, old)
    assert sorted(checkpoint_files(old)) == [2, 4]
    saved = CheckpointStore(old, 1).load(K)["members"]
    marks = [(m["incarnation"], m["clock"], m["high_water"]) for m in saved]
    assert [c for _, c, _ in marks] == [K] * WORKERS
    for n in (3, 1):
        out = tmp_path / f"to-{n}"
        reshard_directory(old, n, out)
        assert sorted(checkpoint_files(out)[K]) == list(range(n))
        cluster = start_cluster(num_shards=n, num_workers=WORKERS, mode="sync", checkpoint_dir=str(out))
        assert all(s.shard.version == K and s.shard.status().restored_from_version == K for s in cluster)
        for s in cluster:  # every new shard refuses the replays the old ones refused
            assert [(m.incarnation, m.clock, m.high_water) for m in s.shard.membership.members] == marks
        try:
            resumed = train(cluster.addresses, range(K, K + M), table)
            finished = [s.shard.export_state() for s in cluster]
        finally:
            for s in cluster:
                s.stop(grace=0.2)
        straight = run(start_cluster, n, range(K + M), table)
        assert resumed.keys() == straight.keys()
        for key in straight:  # the shard averages in rank order element-wise: the cut does not matter
            assert torch.equal(resumed[key], straight[key]), key
        assert all(st["version"] == K + M for st in finished)
        assert [m["clock"] for m in finished[0]["members"]] == [K + M] * WORKERS
    assert sorted(checkpoint_files(old)) == [2, 4]  # --out leaves the source as it was
    # 2 -> 5 -> 2 gives the 2 shards' states back: parameters, optimizer state, members, rows
    _, states = read_set(old)
    for a, b in zip(states, reshard_states(reshard_states(states, 5), 2), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"], strict=True))
        assert str(a["optimizer_state"]) == str(b["optimizer_state"]) and a["members"] == b["members"]
        (ta,), (tb,) = a["tables"]["tables"], b["tables"]["tables"]
        order_a, order_b = torch.argsort(ta["ids"]), torch.argsort(tb["ids"])
        assert torch.equal(ta["ids"][order_a], tb["ids"][order_b]) and ta["step"] == tb["step"]
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ta["state"][name][order_a], tb["state"][name][order_b])
        assert torch.equal(ta["values"][order_a], tb["values"][order_b])
        for name in ("step_stamp", "time_stamp"):  # row lifetimes move with their rows
            assert torch.equal(ta["life"][name][order_a], tb["life"][name][order_b])


def test_bad_input_is_refused_and_changes_nothing(tmp_path, start_cluster) -> None:
    old = tmp_path / "two"
    run(start_cluster, 2, range(2), False, old)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(ReshardError, match="new shard count must be an int >= 1"):
        reshard_directory(old, 0, tmp_path / "zero")
    with pytest.raises(ReshardError, match="No checkpoint at version 7"):
        reshard_directory(old, 3, tmp_path / "seven", version=7)
    with pytest.raises(SystemExit) as usage:  # ps-admin reshard's flags
        main(["--from", str(old), "--to", "0"])
    assert usage.value.code == 2
    assert main(["--from", str(old), "--to", "3", "--out", str(tmp_path / "seven"), "--version", "7"]) == 1
    # a set with a shard missing at the newest version: the older complete set is taken
    (old / "shard-1-v000000000002.pt").rename(tmp_path / "aside.pt")
    with pytest.raises(ReshardError, match=r"has a checkpoint of every shard \(shard 0: \[2\]\)"):
        reshard_directory(old, 3, tmp_path / "missing")
    (tmp_path / "aside.pt").rename(old / "shard-1-v000000000002.pt")
    # a value changed inside shard 1's file (a valid zip, the old digest): the digest says so
    path = old / "shard-1-v000000000002.pt"
    good = path.read_bytes()
    envelope = torch.load(path, weights_only=True)
    envelope["state"]["tensors"][0][0] += 1.0
    torch.save(envelope, path)
    with pytest.raises(ReshardError, match="fails its sha256 digest check"):
        reshard_directory(old, 3)
    path.write_bytes(good)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    for name in ("zero", "seven", "missing"):
        assert not (tmp_path / name).exists()
    # mixed sets: another job's shard 1 at the same version (same model, same round)
    other = tmp_path / "other"
    run(start_cluster, 2, range(3), False, other)
    CheckpointStore(old, 1).save(CheckpointStore(other, 1).load(2), 2)
    with pytest.raises(ReshardError, match="of another job"):
        reshard_directory(old, 3)
    assert not any(p.name.startswith(("before-reshard", ".reshard")) for p in old.iterdir())
    # in place: the set moves into a folder of its own, the new one takes its place
    (old / "shard-1-v000000000002.pt").write_bytes(before["shard-1-v000000000002.pt"])
    assert "onto 1 shards in place" in reshard_directory(old, 1)
    assert {p.name for p in (old / "before-reshard-v2-2-shards").iterdir()} == {
        n for n in before if n.endswith(".pt")
    }  # the lock files stay
    assert sorted(p.name for p in old.glob("*.pt")) == ["shard-0-v000000000002.pt"]
    assert CheckpointStore(old, 0).load(2)["plan"]["num_shards"] == 1
    with pytest.raises(ReshardError, match="new shard count must be an int >= 1"):
        reshard_directory(old, 0)  # refused before anything moves
    assert sorted(p.name for p in old.glob("*.pt")) == ["shard-0-v000000000002.pt"]


def test_async_exactly_once_marks_move_with_the_job(tmp_path, start_cluster) -> None:
    """async, one rank (deterministic): its high-water mark is on every new shard, the same process
    (same incarnation) goes on from its clock, and the result is bitwise the run on 3 shards."""

    def steps(addresses: list[str], which: range) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        m = Model(table=False)
        with PSClient(addresses, rank=0, num_workers=1, incarnation=7, timeout=RPC_TIMEOUT) as c:
            c.init(m, {"name": "sgd", "lr": 0.05, "momentum": 0.9})
            opt = DistributedOptimizer(m, c)
            for step in which:
                x, ids, y = batch(step, 0)
                opt.zero_grad()
                F.cross_entropy(m(x, ids), y).backward()
                opt.step()
        return {k: v.detach().clone() for k, v in m.named_parameters()}

    def job(shards: int, which: range, directory: Path | None = None) -> dict[str, torch.Tensor]:
        extra = {"checkpoint_dir": str(directory)} if directory else {}
        cluster = start_cluster(num_shards=shards, num_workers=1, mode="async", **extra)
        try:
            return steps(cluster.addresses, which)
        finally:
            for s in cluster:
                s.stop(grace=0.2)

    job(2, range(K), tmp_path / "two")
    reshard_directory(tmp_path / "two", 3, tmp_path / "three")
    cluster = start_cluster(num_shards=3, num_workers=1, mode="async", checkpoint_dir=str(tmp_path / "three"))
    assert [(m.incarnation, m.high_water) for s in cluster for m in s.shard.membership.members] == [(7, K - 1)] * 3
    try:
        resumed = steps(cluster.addresses, range(K, K + M))
    finally:
        for s in cluster:
            s.stop(grace=0.2)
    straight = job(3, range(K + M))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_an_admission_filter_restores_onto_another_width_without_losing_counts() -> None:
    """A count-min sketch of one width restored into a narrower one (more shards, or a smaller
    budget) or a wider one: no id's estimate drops below its count."""
    ids = torch.arange(0, 3000, 7)
    saved = AdmissionFilter(budget=4 * 2048, generations=2)
    for _ in range(3):
        saved.add(ids)
    want = saved.estimate(ids)
    assert int(want.min()) >= 3
    for budget in (4 * 2 * 256, 4 * 2 * 8192):
        fitted = AdmissionFilter(budget=budget, generations=2)
        assert fitted.width != saved.width
        fitted.restore(saved.export())
        assert bool((fitted.estimate(ids) >= want).all())


def test_a_shard_refuses_tables_beyond_its_bounds_after_a_reshard_onto_fewer_shards(tmp_path, start_cluster) -> None:
    """2 shards' table rows merged onto 1: the line says what the shard must hold; a shard started
    with lower --max-table-rows or --max-table-bytes refuses the checkpoint (CheckpointError, what
    to do) instead of holding more than its bound; with room it resumes."""
    old, one = tmp_path / "two", tmp_path / "one"
    run(start_cluster, 2, range(K), True, old)
    line = reshard_directory(old, 1, one)
    found = re.search(r"holds at most (\d+) rows of a table and (\d+) bytes of tables", line)
    assert found, line
    rows, held = int(found[1]), int(found[2])
    (saved,) = CheckpointStore(one, 0).load(K)["tables"]["tables"]
    assert rows == saved["ids"].numel() > 0 and held == rows * table_row_bytes(spec_from_export(saved))
    shard = {"num_shards": 1, "num_workers": WORKERS, "mode": "sync", "checkpoint_dir": str(one)}
    with pytest.raises(CheckpointError, match=rf"holds {rows} rows of table 'emb.weight', more than --max-table-rows"):
        start_cluster(**shard, max_table_rows=rows - 1)
    with pytest.raises(CheckpointError, match=rf"holds {held} bytes of tables .* more than --max-table-bytes"):
        start_cluster(**shard, max_table_bytes=held - 1)
    (cluster,) = start_cluster(**shard, max_table_rows=rows, max_table_bytes=held)
    assert cluster.shard.version == K and cluster.shard.tables.tables["emb.weight"].rows == rows
