"""Raw requests a test builds by hand (what PSClient would send), for refusals it must meet."""

from __future__ import annotations

import torch

from ps_proto.v1 import ps_pb2


def once_request(shard, rank: int, session: int, clock: int = 0) -> ps_pb2.PushPullOnceRequest:
    """A PushPullOnce to shard ``shard`` (a ``Shard``) stamped (rank, incarnation 1, clock) with
    ``session``: ones for every partition it owns."""
    plan = shard.plan
    parts = [
        ps_pb2.Partition(
            key=p.key,
            offset=p.offset,
            length=p.length,
            dtype=ps_pb2.DTYPE_FLOAT32,
            data=bytes(torch.ones(p.length).numpy()),
        )
        for p in plan.owned_by(shard.shard_index)
    ]
    header = ps_pb2.PushHeader(
        rank=rank, incarnation=1, clock=clock, version=shard.version, plan_digest=plan.digest, session=session
    )
    return ps_pb2.PushPullOnceRequest(header=header, partitions=parts)
