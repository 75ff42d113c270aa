"""Field numbers of the ps.v1 messages grpc-ps writes and reads by hand (:mod:`ps_common.frames`).

Each number is read from the generated descriptors (``ps_pb2.X.DESCRIPTOR.fields_by_name``), so a
renumbered field in ``proto/ps/v1/ps.proto`` moves these with it; ``tests/unit/test_fields.py``
checks that every message sharing a layout (partitions in one field, version in another) agrees.
"""

from __future__ import annotations

from typing import Any

from ps_proto.v1 import ps_pb2


def number(message: Any, field: str) -> int:
    """The field number of ``field`` in the generated ``message`` class.

    Raises:
        KeyError: ``message`` has no such field.
    """
    return int(message.DESCRIPTOR.fields_by_name[field].number)


# ps.v1.Partition
PARTITION_KEY = number(ps_pb2.Partition, "key")
PARTITION_OFFSET = number(ps_pb2.Partition, "offset")
PARTITION_LENGTH = number(ps_pb2.Partition, "length")
PARTITION_DTYPE = number(ps_pb2.Partition, "dtype")
PARTITION_DATA = number(ps_pb2.Partition, "data")
PARTITION_INDICES = number(ps_pb2.Partition, "indices")

# the messages that carry partitions (PushRequest, PullResponse, PushPullRequest, ExchangeResponse …)
PARTITIONS = number(ps_pb2.PushPullRequest, "partitions")
"""The partition(s) of every message that carries them."""
VERSION = number(ps_pb2.PushPullResponse, "version")
"""The shard version of every response that carries partitions."""
HEADER = number(ps_pb2.PushRequest, "header")
"""The header of a request stream's first message (Init, Push, Exchange, PushPull, PushPullOnce)."""

# PushPullRequest / PushPullOnceRequest
WIRE_DTYPE = number(ps_pb2.PushPullRequest, "wire_dtype")
"""The dtype the answer's values travel in."""

# PushPullResponse / PushPullOnceResponse
PUSH_ANSWER = number(ps_pb2.PushPullResponse, "push")
"""The push's answer (an embedded PushResponse)."""
DATA_SEQUENCE = number(ps_pb2.PushPullResponse, "data_sequence")
"""The data-connection frame a PushPull's partitions went on (PushPullResponse only)."""
