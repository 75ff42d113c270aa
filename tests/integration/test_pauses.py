"""A pause on one rank stalls the others without killing them (ps_worker/awaiting.py).

Workers run with a short per-RPC deadline (:data:`TIMEOUT`), so a pause of rank 0 between steps
(its evaluation, emulated by a bounded sleep in its own thread while its heartbeat runs) crosses
several deadlines in a few seconds. A silent rank (no heartbeats) is still evicted by its lease, and
a rank alive that never pushes ends the wait after ``wait_timeout`` with an error naming it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import pytest
import torch
import torch.nn.functional as F

from ps_common.errors import AwaitingRanksError, RoundTimeoutError
from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import small_model

TIMEOUT = 1.0
"""The workers' per-RPC deadline, seconds."""

RETRY = 2.0
"""The workers' retry deadline, seconds: shorter than the pause, so that retries alone would not
outlast it."""

PAUSE = 4 * TIMEOUT
"""Rank 0's pause between two steps, seconds."""

LEASE = 10.0
"""The shards' lease timeout, seconds: a heartbeat every third of it keeps a paused rank in, also
on a loaded machine."""

SHORT_LEASE = 3.0
"""The lease of the test whose rank goes silent (evicted within seconds)."""

STEPS = 5
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
_SEEDING = threading.Lock()


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _client(addresses: list[str], rank: int, **kw: object) -> PSClient:
    return PSClient(addresses, rank, 2, timeout=TIMEOUT, retry_deadline=RETRY, **kw)  # type: ignore[arg-type]


def _train(
    addresses: list[str],
    rank: int,
    pause_after: int | None = None,
    silent_after: int | None = None,
    released: threading.Event | None = None,
    **kw: object,
) -> tuple[dict[str, torch.Tensor], int, int, dict[str, int]]:
    """Run :data:`STEPS` steps as ``rank``; returns (weights, calls made again, steps run, recoveries).

    ``pause_after``: sleep :data:`PAUSE` seconds after that many steps (an evaluation; the heartbeat
    runs). ``silent_after``: after that many steps stop heartbeating and stepping until ``released``.
    """
    with _SEEDING:  # small_model seeds torch's global generator: one thread at a time
        model = small_model()
    x, y = _data(rank)
    with _client(addresses, rank, **kw) as client:
        client.init(model, SGD, init_timeout=30)
        opt = DistributedOptimizer(model, client)
        for step in range(STEPS):
            if step == pause_after:
                time.sleep(PAUSE)  # this rank evaluates alone; the behaviour under test, bounded
            if step == silent_after:
                assert released is not None
                client.session.heartbeat.stop()
                assert released.wait(60), "the other rank did not finish without this one"
                return {}, client.session.waits.reissued, step, dict(client.recoveries)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return weights, client.session.waits.reissued, STEPS, dict(client.recoveries)


def _run_both(addresses: list[str], **kw: object) -> list[tuple[dict[str, torch.Tensor], int, int, dict[str, int]]]:
    pause_after = kw.pop("pause_after", None)
    with futures.ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(_train, addresses, 0, pause_after, **kw),  # type: ignore[arg-type]
            pool.submit(_train, addresses, 1, **kw),  # type: ignore[arg-type]
        ]
        return [j.result(timeout=90) for j in jobs]


@pytest.mark.parametrize(
    ("data_path", "partition_bytes"),
    [("grpc", 4 << 20), ("tcp", 4 << 20), ("tcp", 256)],
    ids=["grpc-once", "data-connection-once", "data-connection-frames"],
)
def test_a_pause_longer_than_the_deadline_stalls_the_other_rank_and_changes_nothing(
    start_cluster, caplog: pytest.LogCaptureFixture, data_path: str, partition_bytes: int
) -> None:
    kw = {"data_path": data_path, "partition_bytes": partition_bytes}
    plain = _run_both(start_cluster(2, num_workers=2, mode="sync", lease_timeout=LEASE).addresses, **kw)
    shards = start_cluster(2, num_workers=2, mode="sync", lease_timeout=LEASE)
    with caplog.at_level(logging.WARNING, logger="ps_worker.awaiting"):
        paused = _run_both(shards.addresses, pause_after=2, **kw)
    for (want, *_), (got, _, steps, recoveries) in zip(plain, paused, strict=True):
        assert steps == STEPS and not recoveries and want.keys() == got.keys()  # no rank evicted, none rejoined
        for key in want:
            assert torch.equal(want[key], got[key]), key  # bitwise: no push applied twice, none lost
    assert paused[1][1] >= 2, "rank 1's wait crossed several deadlines, each call made again"
    assert all(s.shard.version == STEPS for s in shards)
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        line.startswith("rank 1: waiting for round 2: ranks [0] are alive but have not pushed") for line in lines
    ), lines


def test_a_silent_rank_is_still_evicted_by_its_lease_and_the_wait_ends(start_cluster) -> None:
    shards = start_cluster(2, num_workers=2, mode="sync", lease_timeout=SHORT_LEASE)
    released = threading.Event()
    with futures.ThreadPoolExecutor(2) as pool:
        silent = pool.submit(_train, shards.addresses, 0, None, 2, released)
        try:
            _, reissued, steps, _ = pool.submit(_train, shards.addresses, 1).result(timeout=90)
        finally:
            released.set()
        assert silent.result(timeout=30)[2] == 2
    assert steps == STEPS and reissued >= 1
    assert all(s.shard.version == STEPS for s in shards)  # rounds 2.. closed with rank 1 alone
    status = shards[0].shard.status()
    assert status.workers[0].state.value == "evicted", status.workers[0]


def test_a_rank_alive_that_never_pushes_ends_the_wait_after_wait_timeout(start_cluster) -> None:
    shards = start_cluster(1, num_workers=2, mode="sync", lease_timeout=SHORT_LEASE)
    idle = _client(shards.addresses, 0)  # joined and heartbeating, never stepping
    try:
        idle.init(small_model(), SGD)
        with _client(shards.addresses, 1, wait_timeout=3.0) as client:
            model = small_model()
            client.init(model, SGD, init_timeout=30)
            opt = DistributedOptimizer(model, client)
            x, y = _data(1)
            F.cross_entropy(model(x), y).backward()
            start = time.monotonic()
            with pytest.raises(AwaitingRanksError) as caught:
                opt.step()
            waited = time.monotonic() - start
    finally:
        idle.close()
    err = caught.value
    assert isinstance(err, RoundTimeoutError) and err.ranks == [0]
    assert 3.0 <= waited < 3.0 + 4 * TIMEOUT, waited
    assert "gave up waiting for round 0 after" in str(err) and "ranks [0] are alive" in str(err), str(err)
    assert "wait_timeout 3 s" in str(err)


def test_an_ssp_read_waits_for_a_paused_rank_across_deadlines(start_cluster, caplog: pytest.LogCaptureFixture) -> None:
    shards = start_cluster(2, num_workers=2, mode="ssp", staleness=1, lease_timeout=LEASE)
    with caplog.at_level(logging.WARNING, logger="ps_worker.awaiting"):
        results = _run_both(shards.addresses, pause_after=1)
    assert [r[2] for r in results] == [STEPS, STEPS] and not results[1][3]
    assert results[1][1] >= 2
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("rank 1: waiting for clock ") and "ranks [0] are alive" in line for line in lines), lines
