"""The emulated network's pure parts: address plan, tbf parameters, bytes-on-the-wire formulas.

No namespaces are made here (that needs root and is the bench's job, ``bench/emulated.py``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import emulated  # noqa: E402
import netns  # noqa: E402


def test_plan_names_fit_ifnamsiz_and_addresses_are_distinct() -> None:
    roles = ["w0", "w1", "w2", "w3", "s0", "s1", "s2", "s3"]
    plan = netns.plan_network(roles, pid=4_194_304, subnet=77)
    assert plan.switch_ns == "psb4194304-switch"
    assert [h.address for h in plan.hosts] == [f"10.77.0.{i}" for i in range(1, 9)]
    assert all(len(h.veth_host) <= 15 and len(h.veth_switch) <= 15 for h in plan.hosts)
    names = [h.ns for h in plan.hosts] + [h.veth_host for h in plan.hosts] + [h.veth_switch for h in plan.hosts]
    assert len(set(names)) == len(names)
    assert plan.host("s1").address == "10.77.0.6"
    with pytest.raises(KeyError):
        plan.host("s9")


@pytest.mark.parametrize("roles", [[], ["w0", "w0"], ["W0"], ["switch"], ["a-b"]])
def test_plan_refuses_bad_roles(roles: list[str]) -> None:
    with pytest.raises(ValueError):
        netns.plan_network(roles, pid=1)


def test_leftovers_are_only_the_bench_namespaces_of_dead_runs() -> None:
    names = ["psb12-w0", "psb12-switch", "psb13-w0", "gps8730a", "psbx-w0", "other"]
    assert netns.leftover_namespaces(names, alive={13}) == ["psb12-w0", "psb12-switch"]


def test_rates_and_burst() -> None:
    assert netns.parse_rate("1gbit") == 10**9
    assert netns.parse_rate("500mbit") == 5 * 10**8
    assert netns.parse_rate("2.5Gbit") == 25 * 10**8
    for bad in ("1gbps", "", "0bit", "fast"):
        with pytest.raises(ValueError):
            netns.parse_rate(bad)
    assert netns.tbf_burst(10**9) == 500_000  # 4 ms at 1 Gbit/s
    assert netns.tbf_burst(10**7) == 64 * 1024  # never below one GSO super-packet


def test_ps_and_ring_bytes() -> None:
    n = 25_000_000
    assert emulated.ps_link_bytes(n, workers=2, shards=1) == 2 * n  # the one shard link carries both workers
    assert emulated.ps_link_bytes(n, workers=2, shards=2) == n
    assert emulated.ps_link_bytes(n, workers=2, shards=4) == n  # the worker link is the bottleneck
    assert emulated.ps_link_bytes(n, workers=2, shards=2, wire_itemsize=2) == n // 2
    assert emulated.ring_link_bytes(n, ranks=2) == n
    assert emulated.ring_link_bytes(n, ranks=4) == 3 * n // 2
    assert emulated.wire_seconds(125_000_000, 10**9) == pytest.approx(1.0)


def test_crossover_shard_count() -> None:
    # fp32 on both sides: S > W^2 / (2(W-1)); W=2 ties at S=2, W=4 needs S > 8/3.
    assert emulated.min_shards_to_beat_ring(2) == pytest.approx(2.0)
    assert emulated.min_shards_to_beat_ring(4) == pytest.approx(8 / 3)
    # bf16 on the PS wire halves it: W=2 beats fp32 ring with S > 1.
    assert emulated.min_shards_to_beat_ring(2, wire_itemsize=2) == pytest.approx(1.0)
    assert math.isinf(emulated.min_shards_to_beat_ring(1))


def test_systems_of_a_run() -> None:
    systems = emulated.plan_systems(2, [1, 2, 4], ["float32", "bfloat16"], [2, 4], ["grpc-ps", "gloo", "rpc"])
    keys = [s.key for s in systems]
    assert keys[:3] == ["grpc-ps 2w×1s", "grpc-ps 2w×2s", "grpc-ps 2w×4s"]
    assert "grpc-ps 2w×2s bf16" in keys and "gloo all_reduce 4 ranks" in keys and keys[-1] == "rpc PS 2w"
    by_key = {s.key: s for s in systems}
    assert by_key["rpc PS 2w"].link_bytes(100) == 200
    assert by_key["gloo all_reduce 4 ranks"].link_bytes(100) == 150
    assert by_key["grpc-ps 2w×2s bf16"].link_bytes(100) == 50
