"""Message sizes computed from the encoding rules equal protobuf's own ByteSize()."""

from __future__ import annotations

import random

import torch

from ps_common.wire import message_size
from ps_proto.v1 import ps_pb2
from tests.helpers.tensors import encode


def test_message_size_equals_bytesize() -> None:
    rng = random.Random(7)
    for _ in range(300):
        part = ps_pb2.Partition(
            key=rng.choice(["", "fc1.weight", "é" * rng.randint(0, 200)]),
            offset=rng.randint(0, 2**40) * rng.randint(0, 1),
            length=rng.randint(0, 2**20),
            dtype=rng.randint(0, 4),
            data=encode(torch.randn(rng.randint(0, 300))),
        )
        messages = [
            ps_pb2.PushRequest(partition=part),
            ps_pb2.PullResponse(version=rng.randint(0, 2**35), partition=part),
            ps_pb2.ExchangeResponse(version=rng.randint(0, 5), partition=part),
            ps_pb2.InitRequest(partition=part),
            ps_pb2.ExchangeRequest(partition=part),
            ps_pb2.PushRequest(header=ps_pb2.PushHeader(rank=3, plan_digest="ab")),
            ps_pb2.PullResponse(version=rng.randint(0, 9)),
            ps_pb2.GetStatusResponse(),
        ]
        for msg in messages:
            assert message_size(msg) == msg.ByteSize(), msg
