"""RowPrefetcher over real gRPC: the next batch's embedding rows pulled while the current step runs
(ps_worker.tables.prefetch). Sync runs with and without it are bitwise equal, also with gradient
accumulation and with a prefetcher that names the wrong ids; every forward of a prefetched run
takes its rows from the prefetch; errors surface at the step or forward that needs them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ps_worker import DistributedOptimizer, PSClient, RowPrefetcher
from tests.integration.test_tables import OPTIMIZER, Model  # an nn.Embedding, an nn.EmbeddingBag, a head

RPC_TIMEOUT = 20.0
JOIN_TIMEOUT = 120.0
B = 8


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    """``n`` batches of rank ``rank``: ids [B] (Zipf-like: small ids repeat), bag ids [2B], offsets, targets."""
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(step * 100 + rank)
        ids = (torch.rand(B, generator=g) ** 3 * 1000).long()
        bag = (torch.rand(2 * B, generator=g) ** 3 * 500).long()
        out.append((ids, bag, torch.arange(0, 2 * B, 2), torch.randn(B, generator=g)))
    return out


Inputs = Callable[[Model], Callable[[Any], dict[Any, torch.Tensor]]]
RIGHT: Inputs = lambda m: lambda b: {m.emb: b[0], m.bag: b[1]}  # noqa: E731
WRONG: Inputs = lambda m: lambda b: {m.emb: b[0] + 1, "bag.weight": b[1]}  # noqa: E731


def train(
    addresses: list[str], workers: int, steps: int, inputs: Inputs | None, passes: int = 1, mode: str = "sync"
) -> dict[int, Any]:
    """``workers`` ranks (threads) train ``steps`` steps of ``passes`` batches; per rank: the final
    tables and head, and the prefetcher's hits and misses."""
    models = {}
    for r in range(workers):
        torch.manual_seed(0)
        models[r] = Model()
    out: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            m = models[rank]
            with PSClient(addresses, rank=rank, num_workers=workers, timeout=RPC_TIMEOUT) as c:
                c.init(m, dict(OPTIMIZER))
                opt = DistributedOptimizer(m, c, backward_passes_per_step=passes)
                loader: Any = batches(rank, steps * passes)
                if inputs is not None:
                    loader = RowPrefetcher(c, inputs(m)).wrap(loader)
                for i, (ids, bag, offsets, y) in enumerate(loader):
                    if i % passes == 0:
                        opt.zero_grad()
                    F.mse_loss(m(ids, bag, offsets), y).backward()
                    if i % passes == passes - 1:
                        opt.step()
                assert c.tables is not None
                out[rank] = (
                    c.pull_rows("emb.weight", torch.arange(1000)),
                    c.pull_rows("bag.weight", torch.arange(500)),
                    torch.cat([p.detach().flatten() for p in m.fc.parameters()]),
                    c.tables.ahead.hits,
                    c.tables.ahead.misses,
                    c.tables.calls["PullRows"],
                )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a rank did not finish in time"
    if errors:
        raise errors[0]
    return out


def same(a: dict[int, Any], b: dict[int, Any]) -> None:
    for r in a:
        for x, y in zip(a[r][:3], b[r][:3], strict=True):
            assert torch.equal(x, y)


def test_sync_with_prefetched_rows_is_bitwise_the_plain_run(start_cluster) -> None:
    steps = 6
    plain = train(start_cluster(num_shards=2, num_workers=2).addresses, 2, steps, None)
    fetched = train(start_cluster(num_shards=2, num_workers=2).addresses, 2, steps, RIGHT)
    same(plain, fetched)
    for r in fetched:
        hits, misses, pulls = fetched[r][3:]
        assert (hits, misses) == (2 * steps, 0)  # every forward of both tables took prefetched rows
        assert pulls - 2 * 2 <= steps * 2  # at most one PullRows per shard and step for both tables (+ final reads)
        assert plain[r][3:5] == (0, 0) and plain[r][5] > pulls  # one per module and shard owning any of its ids


def test_accumulation_and_wrong_ids_stay_exact(start_cluster, caplog) -> None:
    plain = train(start_cluster(num_shards=2, num_workers=2).addresses, 2, 3, None, passes=2)
    fetched = train(start_cluster(num_shards=2, num_workers=2).addresses, 2, 3, RIGHT, passes=2)
    same(plain, fetched)
    assert all(fetched[r][3:5] == (2 * 6, 0) for r in fetched)  # both micro-batches of a step prefetched
    with caplog.at_level(logging.WARNING, logger="ps_worker.tables.prefetch"):
        wrong = train(start_cluster(num_shards=2, num_workers=2).addresses, 2, 3, WRONG, passes=2)
    same(plain, wrong)
    assert all(wrong[r][3] == 6 and wrong[r][4] > 0 for r in wrong)  # the bag's rows hit, the emb's missed
    assert "are not the ids its forward looks up" in caplog.text


def test_async_prefetch_reads_after_its_own_push(start_cluster) -> None:
    out = train(start_cluster(num_shards=2, num_workers=1, mode="async").addresses, 1, 5, RIGHT)
    alone = train(start_cluster(num_shards=2, num_workers=1, mode="async").addresses, 1, 5, None)
    same(out, alone)  # one rank: the rows after its own push are all there is, prefetched or not
    assert out[0][3:5] == (10, 0)


def test_bad_prefetcher_input_is_refused(start_cluster) -> None:
    cluster = start_cluster(num_shards=2, num_workers=1, mode="async")
    torch.manual_seed(0)
    m = Model()
    with PSClient(cluster.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT) as c:
        with pytest.raises(RuntimeError, match="No embedding tables"):
            RowPrefetcher(c, RIGHT(m))
        c.init(m, dict(OPTIMIZER))
        with pytest.raises(KeyError, match="not a table of this client"):
            RowPrefetcher(c, lambda b: {m.fc: b[0]}).ids(batches(0, 1)[0])
        out_of_range = RowPrefetcher(c, lambda b: {m.emb: b[0] + 5000, m.bag: b[1]})
        ids, bag, offsets, _ = next(iter(out_of_range.wrap(batches(0, 2))))
        with pytest.raises(Exception, match="out of range|INVALID_ARGUMENT"):
            m(ids, bag, offsets)  # the prefetch's refusal is the forward's, not lost
        assert c.tables is not None and not c.tables.ahead.pending
