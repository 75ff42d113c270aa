"""A shard ``kill -9``ed a few rounds after a periodic checkpoint and restarted from it: the ranks
push the rounds it lost again, from the gradients they kept, and the job ends bitwise where an
uninterrupted run ends, on every rank and every shard; never a wait without end.

Real ``ps-server`` and ``ps-worker digits`` processes (:mod:`tests.chaos.harness`), ended by PID.
Before the redo log, the same fault hung 3 runs of 10 for good (the shards one round apart) and
forked the model in others: a rank dropped the step the restarted shard had lost and pushed fresh
gradients, computed on a model half of one version and half of another, for the lost rounds.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.chaos.harness import Cluster, ClusterSpec, Network, poll

STEPS = 60
EVERY = 10
LEASE = 3.0
"""Seconds: short, so that the paused rank is evicted soon (the bitwise runs take 4 leases, so that a
loaded machine evicts nobody there: an eviction changes the rounds, and the run is no reference)."""


def shard_status(cluster: Cluster) -> list[dict]:
    return [s for s in (cluster.status() or []) if "version" in s]


def run(
    tmp_path: Path, fault: str, transport: str = "tcp", lease: float = 4 * LEASE, durable: bool = False
) -> list[dict]:
    """One 2 x 2 sync job of :data:`STEPS` steps with checkpoints every :data:`EVERY` versions; ``fault``:
    ``none``, ``kill`` (shard 1 killed 3 or more rounds after a checkpoint, restarted at
    once), ``kill-twice`` (rank 1 paused, shard 1 killed again while rank 0's push of a lost round
    waits there for rank 1's, restarted again, rank 1 continued) or
    ``kill-pause`` (the same as ``kill`` while rank 1 is paused past its lease); ``durable``: the shards
    run with ``--durable-acks`` (nothing acknowledged is lost; the redo log is off). Returns the
    ranks' ``done`` summaries, checked: both exit 0, both shards at :data:`STEPS`."""
    spec = ClusterSpec(
        num_shards=2,
        num_workers=2,
        steps=STEPS,
        lease=lease,
        checkpoint_every=1 if durable else EVERY,
        slow_ms=40,
        worker_timeout=30,
        retry_deadline=300,
        data_path=transport,
        durable_acks=durable,
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    net = Network(2, want=False)
    cluster = Cluster(spec, tmp_path, net)
    try:
        cluster.start()
        if fault != "none":

            def after_checkpoint() -> bool:
                st = shard_status(cluster)
                if len(st) < 2 or st[1]["last_checkpoint"] is None:
                    return False
                if durable:  # every acknowledged version is on disk: kill it mid-run
                    return st[1]["version"] >= EVERY + 3
                return st[1]["last_checkpoint"] >= EVERY and st[1]["version"] >= st[1]["last_checkpoint"] + 3

            assert poll(after_checkpoint, 120), "shard 1 did not checkpoint"
            paused = cluster.workers[1]
            assert paused is not None
            if fault in ("kill-pause", "kill-twice"):
                paused.signal(signal.SIGSTOP)
            shard = cluster.shards[1]
            assert shard is not None
            shard.kill()
            cluster.start_shard(1)  # resumes from its newest checkpoint, rounds behind shard 0
            if fault == "kill-twice":  # a second crash while rank 0 pushes it a lost round again

                def redoing() -> bool:  # rank 0's push of the first lost round is held: rank 1 is paused
                    st = shard_status(cluster)
                    if len(st) < 2 or st[1]["restored_from"] is None:
                        return False
                    rank0 = next((w for w in st[1]["workers"] if w["rank"] == 0), None)
                    return rank0 is not None and st[1]["version"] == st[1]["restored_from"] < rank0["clock"]

                assert poll(redoing, 60), "rank 0 pushed shard 1 no lost round again"
                again = cluster.shards[1]
                assert again is not None
                again.kill()
                cluster.start_shard(1)
                paused.signal(signal.SIGCONT)  # both ranks push the lost rounds again, to the shard restarted again
            if fault == "kill-pause":
                states = lambda: [w["state"] for s in shard_status(cluster) for w in s["workers"]]  # noqa: E731
                evicted = lambda: "WORKER_STATE_EVICTED" in states()  # noqa: E731
                assert poll(evicted, 60), "rank 1 was not evicted while paused"
                paused.signal(signal.SIGCONT)
        assert poll(cluster.workers_done, 240), "the job did not finish (a hang)"
        cluster.closing = True
        cluster.reap()
        finals = cluster.finals()
        assert [f.returncode for f in finals] == [0, 0], [p.files[1].name for p in cluster.workers if p]
        at = [int(s["version"]) for s in shard_status(cluster)]
        assert at == [STEPS, STEPS], f"shards at versions {at}"
        return [f.done or {} for f in finals]
    finally:
        cluster.close()
        net.close()


_REFERENCES: dict[str, set[str]] = {}


def reference(tmp_path: Path, transport: str) -> set[str]:
    """The uninterrupted run's parameters on ``transport`` (run once per transport for this module's tests)."""
    if transport not in _REFERENCES:
        _REFERENCES[transport] = {d["params_sha256"] for d in run(tmp_path / "reference", "none", transport)}
    return _REFERENCES[transport]


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "durable"), [("tcp", False), ("grpc", False), ("tcp", True)])
def test_a_shard_restarted_from_an_older_checkpoint_gets_its_lost_rounds_pushed_again(
    tmp_path: Path, transport: str, durable: bool
) -> None:
    reference_ = reference(tmp_path, transport)
    faulted = {d["params_sha256"] for d in run(tmp_path / "kill", "kill", transport, durable=durable)}
    assert len(reference_) == 1 and len(faulted) == 1, (reference_, faulted)
    assert faulted == reference_, "the redone rounds did not end where the uninterrupted run ends"


@pytest.mark.slow
def test_a_shard_killed_again_while_its_lost_rounds_are_pushed_again_ends_bitwise(tmp_path: Path) -> None:
    reference_ = reference(tmp_path, "tcp")
    # rank 1 stays paused through two restarts: a lease long enough that a loaded machine evicts no one
    faulted = {d["params_sha256"] for d in run(tmp_path / "kill", "kill-twice", lease=10 * LEASE)}
    assert len(faulted) == 1 and faulted == reference_, (reference_, faulted)


@pytest.mark.slow
def test_a_rank_paused_past_its_lease_while_a_shard_restarts_ends_on_one_model(tmp_path: Path) -> None:
    shas = {d["params_sha256"] for d in run(tmp_path, "kill-pause", lease=LEASE)}
    assert len(shas) == 1 and None not in shas, f"ranks finished on different models: {shas}"
