"""A sync rank paused (SIGSTOP) mid-round past its lease, evicted, then resumed, with and without a
``kill -9`` of a shard restarted on its checkpoints: every round is applied on every shard with the
same ranks (docs/faults.md#rounds-atomic-across-shards), and both ranks finish on the same model.

Real ``ps-server`` and ``ps-worker digits`` processes (:mod:`tests.chaos.harness`), ended by PID.
Before the fix, rank 1's retry after its rejoin was stamped again with the round it rejoined at
(a round later than the one its gradient was for, and on one shard only): shard 1 ended one version
ahead of shard 0 and the two ranks with different parameters (3 runs of 3).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.chaos.harness import Cluster, ClusterSpec, Network, evicted, poll

STEPS = 40
PAUSE_AT = 12
LEASE = 3.0


def versions(cluster: Cluster) -> list[int]:
    status = cluster.status() or []
    return [int(s["version"]) for s in status if "version" in s]


@pytest.mark.slow
@pytest.mark.parametrize("shard_kill", ["none", "before-eviction", "after-eviction"])
def test_rank_paused_mid_round_rejoins_and_both_ranks_end_on_one_model(tmp_path: Path, shard_kill: str) -> None:
    spec = ClusterSpec(
        num_shards=2,
        num_workers=2,
        steps=STEPS,
        lease=LEASE,
        checkpoint_every=5,
        slow_ms=30,
        worker_timeout=30,
        retry_deadline=300,  # a rank paused for a long time on a loaded machine still retries
    )
    net = Network(2, want=False)
    cluster = Cluster(spec, tmp_path, net)
    try:
        cluster.start()
        assert poll(lambda: min(versions(cluster) or [0]) >= PAUSE_AT, 120), "training did not start"
        paused = cluster.workers[1]
        assert paused is not None
        paused.signal(signal.SIGSTOP)  # mid-round, most likely: a step is a PushPull and its wait
        if shard_kill == "after-eviction":
            time.sleep(LEASE + 1.0)  # the fault's timing, not a synchronization: rank 1 evicted first
        if shard_kill != "none":
            shard = cluster.shards[1]
            assert shard is not None
            shard.kill()
            cluster.start_shard(1)  # resumes from its newest checkpoint, behind shard 0
        # shard 0 evicts it; a round whose push reached shard 0 only waits on the other shard for it
        # (rounds atomic across shards), so it is resumed, as a paused process is, and delivers it
        assert poll(lambda: evicted(cluster.status(), 1, shards=[0]), 60), "rank 1 was not evicted while paused"
        paused.signal(signal.SIGCONT)
        assert poll(cluster.workers_done, 240), "the job did not finish (a hang)"
        cluster.closing = True  # account the exits; restart nothing
        cluster.reap()
        finals = cluster.finals()
        assert [f.returncode for f in finals] == [0, 0], [p.files[1].name for p in cluster.workers if p]
        # no process failed and was started again: each rank's one process went on to the end
        assert cluster.restarts == [0, 0], [(i.rank, i.returncode) for i in cluster.incarnations]
        done = [f.done or {} for f in finals]
        at = versions(cluster)
        assert len(at) == 2 and at[0] == at[1] == STEPS, f"shards at versions {at}"
        shas = {d.get("params_sha256") for d in done}
        assert len(shas) == 1 and None not in shas, f"ranks finished on different models: {shas}"
    finally:
        cluster.close()
        net.close()
