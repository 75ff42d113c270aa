"""EASGD's Exchange with every shard (``docs/architecture.md#5-consistency``): send the parameters x,
receive d = alpha (x - center), set x -= d in place (:meth:`ps_worker.client.PSClient.exchange`)."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from ps_common import tracing
from ps_worker.transport.calls import ShardCalls


def exchange(path: ShardCalls, params: Mapping[str, torch.Tensor]) -> int:
    """EASGD's exchange with every shard: see :meth:`ps_worker.client.PSClient.exchange`."""
    t, s, codec = path.transport, path.session, path.require_codec()
    flats = path.staging.stage(codec.plan, params)
    diffs: dict[str, torch.Tensor] = {spec.key: torch.zeros_like(flats[spec.key]) for spec in codec.plan.specs}

    def one(k: int) -> tuple[int, int, int]:
        msgs = codec.exchange_messages(k, s.rank, s.incarnation, s.exchanges, flats, s.relayed(k)[0], s.sessions[k])

        def attempt() -> tuple[int, int, int]:
            replies = t.exchange_calls[k](iter(msgs), timeout=t.timeout, metadata=t.call_metadata())
            version, received, _ = codec.decode(k, replies, diffs, t.servers[k], t.received)
            return version, sum(len(m) for m in msgs), received

        return s.with_recovery(k, attempt, f"Exchange {t.servers[k]}")

    start = time.perf_counter()
    with tracing.span("exchange", rank=s.rank, shards=t.num_shards):
        results = t.each_shard(one)
    path.observe("push_pull_duration", start)
    s.exchanges += 1
    s.pushed_bytes += sum(r[1] for r in results)
    s.pulled_bytes += sum(r[2] for r in results)
    with torch.no_grad():
        for key, p in params.items():
            p.sub_(diffs[key].view(p.shape).to(p.device, non_blocking=True))
    s.versions = [r[0] for r in results]
    s.version = min(s.versions)
    return s.version
