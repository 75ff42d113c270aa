"""Export without sockets: a shard's ExportParameters messages (ps_server.checkpoint.export) and their
assembly into full tensors (ps_admin.export), over a fake shard's checkpoint snapshot."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ps_admin.export import ExportError, ShardExport, assemble, cmd_export, fetch_consistent
from ps_admin.model_file import ModelFileError, table_tensors
from ps_common import errors
from ps_common.plan import ParameterSpec, make_plan
from ps_common.tables import initial_rows
from ps_server.checkpoint.export import export_messages, row_chunks
from ps_server.core.limits import Limits

SPECS = [
    ParameterSpec("fc.weight", (6, 8), "float32"),
    ParameterSpec("fc.bias", (6,), "float32"),
    ParameterSpec("bn.num_batches_tracked", (), "float64"),
    ParameterSpec("emb", (5, 4), "bfloat16"),
]
PLAN = make_plan(SPECS, 2, partition_bytes=32)
FULL = {
    "fc.weight": torch.randn(6, 8),
    "fc.bias": torch.randn(6),
    "bn.num_batches_tracked": torch.tensor(7.0, dtype=torch.float64),
    "emb": torch.randn(5, 4).to(torch.bfloat16),
}


class FakeShard:
    """What export_messages uses of a Shard: its index, its limits and export_state()."""

    def __init__(self, shard_index: int, initialized: bool = True) -> None:
        self.shard_index = shard_index
        self.limits = Limits()
        self.initialized = initialized

    def export_state(self) -> dict[str, Any]:
        if not self.initialized:
            raise errors.NotInitializedError("nothing to checkpoint before Init")
        owned = PLAN.owned_by(self.shard_index)
        return {
            "plan": {
                "specs": [[s.key, list(s.shape), s.dtype] for s in SPECS],
                "num_shards": PLAN.num_shards,
                "partition_bytes": PLAN.partition_bytes,
                "digest": PLAN.digest,
            },
            "tensors": [FULL[p.key].reshape(-1)[p.offset : p.offset + p.length].clone() for p in owned],
            "optimizer": {"name": "sgd", "kwargs": {"lr": 0.1}, "groups": [], "buffers": ["bn.num_batches_tracked"]},
            "version": 12,
        }


def shard_export(k: int, address: str = "") -> ShardExport:
    head, *rest = export_messages(FakeShard(k))
    return ShardExport(k, address or f"127.0.0.1:{5000 + k}", head, [m.partition for m in rest])


def test_each_shard_sends_its_plan_first_then_one_partition_per_message() -> None:
    head, *rest = export_messages(FakeShard(1))
    assert head.shard_index == 1 and head.version == 12 and not head.HasField("partition")
    assert [s.key for s in head.plan.specs] == [s.key for s in SPECS] and head.plan.digest == PLAN.digest
    assert list(head.buffers) == ["bn.num_batches_tracked"]
    owned = PLAN.owned_by(1)
    assert [(m.partition.key, m.partition.offset, m.partition.length) for m in rest] == [
        (p.key, p.offset, p.length) for p in owned
    ]
    assert all(m.version == 12 and len(m.partition.data) <= PLAN.partition_bytes for m in rest)


def test_an_uninitialized_shard_says_so() -> None:
    with pytest.raises(errors.NotInitializedError, match="rank 0 has not initialized it"):
        list(export_messages(FakeShard(0, initialized=False)))


def test_assembled_tensors_are_the_full_parameters_with_their_dtypes() -> None:
    state, versions = assemble([shard_export(0), shard_export(1)])
    assert versions == [12, 12] and list(state) == [s.key for s in SPECS]
    for key, t in FULL.items():
        if key == "bn.num_batches_tracked":
            assert state[key].dtype == torch.int64 and int(state[key]) == 7
        else:
            assert state[key].dtype == t.dtype and torch.equal(state[key], t), key


def test_shards_out_of_order_or_missing_partitions_are_refused() -> None:
    with pytest.raises(ExportError, match="shard-index order"):
        assemble([shard_export(1), shard_export(0)])
    short = shard_export(1)
    short.partitions.pop()
    with pytest.raises(ExportError, match="do not cover"):
        assemble([shard_export(0), short])
    twice = shard_export(1)
    twice.partitions.append(twice.partitions[0])
    with pytest.raises(ExportError, match="do not cover"):
        assemble([shard_export(0), twice])
    other = shard_export(1)
    assert other.head is not None
    other.head.plan.digest = "0" * 64
    with pytest.raises(ExportError, match="another model"):
        assemble([shard_export(0), other])


def at_version(export: ShardExport, version: int) -> ShardExport:
    export.head.version = version  # type: ignore[union-attr]
    return export


class Shards:
    """fetch_all over fake shards whose versions follow a script: each answer of shard k takes the
    next version of ``script[k]`` (its last one once the script ran out)."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = script
        self.asked: list[list[str]] = []

    def __call__(self, addresses, token, deadline, creds=None) -> list[ShardExport]:
        self.asked.append(list(addresses))
        out = []
        for address in addresses:
            k = int(address.rsplit(":", 1)[1]) - 5000
            versions = self.script[k]
            out.append(at_version(shard_export(k), versions.pop(0) if len(versions) > 1 else versions[0]))
        return out


def test_the_shards_behind_are_asked_again_until_one_version(monkeypatch: pytest.MonkeyPatch) -> None:
    shards = Shards([[8, 9], [7, 7, 9]])  # shard 1 catches up past shard 0, which then catches up
    monkeypatch.setattr("ps_admin.export.fetch_all", shards)
    addresses = ["127.0.0.1:5000", "127.0.0.1:5001"]
    exports, rounds = fetch_consistent(addresses, "", 5.0, within=10.0)
    assert [e.head.version for e in exports] == [9, 9]
    assert rounds == 4 and shards.asked[1:] == [[addresses[1]], [addresses[1]], [addresses[0]]]


def export_args(tmp_path: Path, allow_mixed: bool) -> SimpleNamespace:
    return SimpleNamespace(
        servers=["127.0.0.1:5000", "127.0.0.1:5001"],
        admin_token="",
        deadline=5.0,
        creds=None,
        consistency_deadline=0.2,
        allow_mixed=allow_mixed,
        out=str(tmp_path / "model.pt"),
        format="",
    )


def test_a_model_mixed_from_two_versions_is_not_written_unless_allowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("ps_admin.export.fetch_all", Shards([[5, 7, 9, 11], [4, 6, 8, 10]]))  # never equal
    out, err = io.StringIO(), io.StringIO()
    assert cmd_export(export_args(tmp_path, allow_mixed=False), out, err) == 1
    assert "different versions" in err.getvalue() and "--allow-mixed" in err.getvalue()
    assert not (tmp_path / "model.pt").exists()
    monkeypatch.setattr("ps_admin.export.fetch_all", Shards([[5, 7, 9, 11], [4, 6, 8, 10]]))
    assert cmd_export(export_args(tmp_path, allow_mixed=True), out, err) == 0
    assert (tmp_path / "model.pt").exists() and "--allow-mixed" in err.getvalue()


def test_table_rows_travel_in_bounded_chunks_and_fill_a_matrix_of_initial_rows() -> None:
    ids, values = torch.tensor([7, 2, 40]), torch.arange(15, dtype=torch.float32).view(3, 5)
    blocks = list(row_chunks("emb.weight", ids, values, budget=1024 + 2 * (8 + 4 * 5)))
    assert [len(b.ids) // 8 for b in blocks] == [2, 1] and all(len(b.data) == len(b.ids) // 8 * 20 for b in blocks)
    spec = SimpleNamespace(name="emb.weight", num_rows=50, dim=5, seed=3, init_std=0.5)
    sent = {"emb.weight": [(b.ids, b.data) for b in blocks]}
    weight = table_tensors([spec], sent)["emb.weight"]
    others = torch.tensor([i for i in range(50) if i not in (2, 7, 40)])
    assert weight.shape == (50, 5) and torch.equal(weight[ids], values)
    assert torch.equal(weight[others], initial_rows("emb.weight", 3, 0.5, others, 5))
    sparse = table_tensors([spec], sent, dense_limit=50 * 5 * 4 - 1)
    assert torch.equal(sparse["emb.weight.ids"], torch.tensor([2, 7, 40]))
    assert torch.equal(sparse["emb.weight.rows"], values[[1, 0, 2]])
    with pytest.raises(ModelFileError, match="out of range or twice"):
        table_tensors([spec], {"emb.weight": sent["emb.weight"] * 2})
