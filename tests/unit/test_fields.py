"""ps_common.fields: the hand-written field numbers agree with the generated descriptors."""

from __future__ import annotations

import pytest

from ps_common import fields
from ps_proto.v1 import ps_pb2

CARRY_PARTITIONS = [
    (ps_pb2.InitRequest, "partition"),
    (ps_pb2.PushRequest, "partition"),
    (ps_pb2.PullResponse, "partition"),
    (ps_pb2.ExchangeRequest, "partition"),
    (ps_pb2.ExchangeResponse, "partition"),
    (ps_pb2.PushPullRequest, "partitions"),
    (ps_pb2.PushPullResponse, "partitions"),
    (ps_pb2.PushPullOnceRequest, "partitions"),
    (ps_pb2.PushPullOnceResponse, "partitions"),
]


@pytest.mark.parametrize(("message", "name"), CARRY_PARTITIONS)
def test_every_message_with_partitions_carries_them_in_one_field(message: type, name: str) -> None:
    assert fields.number(message, name) == fields.PARTITIONS


@pytest.mark.parametrize(
    "message", [ps_pb2.PullResponse, ps_pb2.ExchangeResponse, ps_pb2.PushPullResponse, ps_pb2.PushPullOnceResponse]
)
def test_every_response_with_partitions_carries_its_version_in_one_field(message: type) -> None:
    assert fields.number(message, "version") == fields.VERSION


@pytest.mark.parametrize(
    "message",
    [
        ps_pb2.InitRequest,
        ps_pb2.PushRequest,
        ps_pb2.ExchangeRequest,
        ps_pb2.PushPullRequest,
        ps_pb2.PushPullOnceRequest,
    ],
)
def test_every_request_stream_opens_with_its_header_in_one_field(message: type) -> None:
    assert fields.number(message, "header") == fields.HEADER


def test_push_pull_once_shares_push_pulls_fields() -> None:
    assert fields.number(ps_pb2.PushPullOnceRequest, "wire_dtype") == fields.WIRE_DTYPE
    assert fields.number(ps_pb2.PushPullOnceResponse, "push") == fields.PUSH_ANSWER


def test_the_numbers_are_the_protos() -> None:
    """ps.v1 is a published wire format: these numbers never change."""
    assert (fields.PARTITIONS, fields.VERSION, fields.HEADER, fields.WIRE_DTYPE) == (2, 1, 1, 3)
    assert (fields.PUSH_ANSWER, fields.DATA_SEQUENCE) == (3, 4)
    partition = (
        fields.PARTITION_KEY,
        fields.PARTITION_OFFSET,
        fields.PARTITION_LENGTH,
        fields.PARTITION_DTYPE,
        fields.PARTITION_DATA,
        fields.PARTITION_INDICES,
    )
    assert partition == (1, 2, 3, 4, 5, 6)


def test_an_unknown_field_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        fields.number(ps_pb2.Partition, "nope")
