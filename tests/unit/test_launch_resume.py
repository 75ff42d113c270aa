"""ps-launch on a log directory that holds a job's checkpoints: finished, or steps left?"""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path

from ps_launch.cli import finished_version, mean, nothing_to_do
from ps_proto.v1 import ps_pb2


def shard(version: int, clocks: list[int], mode: int = ps_pb2.MODE_SYNC, restored: bool = True, period: int = 10):
    st = ps_pb2.ShardStatus(version=version, config=ps_pb2.ClusterConfig(mode=mode, communication_period=period))
    st.workers.extend(ps_pb2.WorkerStatus(rank=r, clock=c) for r, c in enumerate(clocks))
    if restored:
        st.restored_from_version = version
    return st


def test_a_fresh_start_is_never_finished() -> None:
    assert finished_version([], 10) is None
    assert finished_version([shard(0, [0, 0], restored=False)], 10) is None
    assert finished_version([shard(20, [20, 20]), shard(20, [20, 20], restored=False)], 10) is None


def test_sync_is_finished_when_the_round_reached_steps() -> None:
    assert finished_version([shard(20, [20, 20]), shard(20, [20, 20])], 20) == 20
    assert finished_version([shard(20, [20, 20])], 10) == 20
    assert finished_version([shard(20, [20, 20])], 21) is None
    # a rank killed early (evicted) does not hold the job back: the rounds went on without it
    assert finished_version([shard(20, [20, 7])], 20) == 20


def test_async_and_ssp_count_each_rank_s_clock() -> None:
    for mode in (ps_pb2.MODE_ASYNC, ps_pb2.MODE_SSP):
        assert finished_version([shard(40, [20, 20], mode)], 20) == 40
        assert finished_version([shard(27, [20, 7], mode)], 20) is None  # rank 1 has steps left
        assert finished_version([shard(27, [20, 7], mode), shard(27, [20, 20], mode)], 20) == 27


def test_easgd_counts_whole_periods() -> None:
    assert finished_version([shard(4, [2, 2], ps_pb2.MODE_EASGD, period=10)], 25) == 4
    assert finished_version([shard(4, [2, 1], ps_pb2.MODE_EASGD, period=10)], 20) is None


def test_mean_of_ranks_that_trained_and_nothing_to_do_output() -> None:
    assert mean([1.0, None, 3.0, math.nan]) == 2.0 and mean([None]) is None and mean([]) is None
    out = io.StringIO()
    args = argparse.Namespace(steps=10, json=True, workload="digits", mode="sync")
    nothing_to_do(args, Path("/tmp/job"), 10, out)
    first, last = out.getvalue().splitlines()
    assert first == (
        "ps-launch: nothing to do: the job in /tmp/job finished at version 10 (every rank has run --steps 10); "
        "use a new --log-dir or raise --steps"
    )
    assert json.loads(last) == {
        "workload": "digits",
        "mode": "sync",
        "nothing_to_do": True,
        "log_dir": "/tmp/job",
        "version": 10,
        "steps": 10,
    }


def test_a_job_keeps_its_cluster_id_across_runs_on_one_log_dir(tmp_path) -> None:
    """ps-launch gives its shards one --cluster-id per log directory: a resumed job keeps it, another
    job's differs (their membership records are not followed by each other's shards)."""
    from ps_launch.cluster import cluster_id

    first = cluster_id(tmp_path / "")
    assert first.startswith("launch-") and cluster_id(tmp_path) == first
    other = tmp_path / "other"
    other.mkdir()
    assert cluster_id(other) != first
