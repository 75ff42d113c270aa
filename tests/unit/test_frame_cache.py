"""The service layer's cache of encoded reads: the bytes of ps_common.frames, built once per version."""

from __future__ import annotations

import pytest
import torch

from ps_common import frames
from ps_common.errors import InvalidRequestError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_server.service.frame_cache import FrameCache, encode_exchange
from ps_server.shard.shard import PushStamp, Shard
from tests.helpers.tensors import encode

PLAN = make_plan([ParameterSpec("a", (300,), "float32"), ParameterSpec("b", (5,), "float32")], 1, 1024)


def wire(x: float) -> list[WirePartition]:
    return [
        WirePartition(p.key, p.offset, p.length, "float32", encode(torch.full((p.length,), x)))
        for p in PLAN.owned_by(0)
    ]


@pytest.fixture
def shard() -> Shard:
    s = Shard(0, 1, ModeSettings("async", num_workers=1))
    s.join(0, 1, 1)
    s.init(PLAN.specs, 1, PLAN.partition_bytes, PLAN.digest, OptimizerSpec("sgd", {"lr": 1.0}), wire(1.0))
    return s


def test_a_pull_encodes_the_bytes_of_response_frames(shard: Shard) -> None:
    cache = FrameCache()
    for wire_dtype, packed in (("", False), ("float16", False), ("", True), ("bfloat16", True)):
        version, out = shard.pull(0, 1, 0, PLAN.digest, 1.0, wire_dtype, cache.encoder(wire_dtype, packed))
        assert shard.store is not None
        expected = frames.response_frames(
            0,
            [(p.key, p.offset, p.length) for p in shard.store.partitions],
            shard.store.tensors,
            torch.float16 if wire_dtype == "float16" else torch.bfloat16 if wire_dtype else None,
            cache.groups(PLAN, 0, wire_dtype) if packed else None,
        )
        assert version == 0 and out == expected


def test_one_copy_per_version_and_only_the_newest_kept(shard: Shard) -> None:
    cache = FrameCache()
    encoder = cache.encoder("", packed=True)
    first = shard.pull(0, 1, 0, PLAN.digest, 1.0, "", encoder)[1]
    assert shard.pull(0, 1, 0, PLAN.digest, 1.0, "", cache.encoder("", packed=True))[1] is first  # shared
    unpacked = shard.pull(0, 1, 0, PLAN.digest, 1.0, "", cache.encoder())[1]
    assert unpacked is not first and len(unpacked) > len(first)
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    second = shard.pull(0, 1, 0, PLAN.digest, 1.0, "", encoder)[1]
    assert second is not first and frames.read(second[0]).ints[1] == 1
    assert all(key[0] == 1 for key in cache._frames)  # version 0 is gone


def test_a_new_store_epoch_is_not_served_from_the_cache(shard: Shard) -> None:
    cache = FrameCache()
    before = shard.pull(0, 1, 0, PLAN.digest, 1.0, "", cache.encoder())[1]
    shard.restore(shard.export_state())  # same version, new store
    assert shard.pull(0, 1, 0, PLAN.digest, 1.0, "", cache.encoder())[1] is not before


def test_push_pull_once_needs_one_message(shard: Shard) -> None:
    cache = FrameCache()
    assert len(cache.groups(PLAN, 0, "")) == 2 and len(cache.groups(PLAN, 0, "float16")) == 1
    with pytest.raises(InvalidRequestError, match="call PushPull \\(a stream\\) instead of PushPullOnce"):
        shard.push_pull(
            PushStamp(0, 1, 0), 0, PLAN, wire(1.0), 1.0, cache.encoder("", True), "",
            check=lambda plan: cache.check_single(plan, 0, ""),
        )  # fmt: skip
    assert shard.version == 0  # refused before the push


def test_an_exchange_is_encoded_one_partition_per_message() -> None:
    s = Shard(0, 1, ModeSettings("easgd", num_workers=1, moving_rate=0.5))
    s.join(0, 1, 1)
    s.init(PLAN.specs, 1, PLAN.partition_bytes, PLAN.digest, OptimizerSpec("sgd", {"lr": 1.0}), wire(0.0))
    version, out = s.exchange(PushStamp(0, 1, 0), PLAN.digest, wire(2.0), 1.0, encode_exchange)
    assert version == 1 and len(out) == len(PLAN.owned_by(0))
    assert torch.equal(frames.view(frames.read(out[0]).partitions[0]), torch.ones(PLAN.owned_by(0)[0].length))
