from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_SYNC: _ClassVar[Mode]
    MODE_ASYNC: _ClassVar[Mode]
    MODE_SSP: _ClassVar[Mode]
    MODE_EASGD: _ClassVar[Mode]
    MODE_DILOCO: _ClassVar[Mode]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_PENDING: _ClassVar[WorkerState]
    WORKER_STATE_LIVE: _ClassVar[WorkerState]
    WORKER_STATE_EVICTED: _ClassVar[WorkerState]
    WORKER_STATE_LEFT: _ClassVar[WorkerState]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_FLOAT64: Dtype
MODE_UNSPECIFIED: Mode
MODE_SYNC: Mode
MODE_ASYNC: Mode
MODE_SSP: Mode
MODE_EASGD: Mode
MODE_DILOCO: Mode
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_PENDING: WorkerState
WORKER_STATE_LIVE: WorkerState
WORKER_STATE_EVICTED: WorkerState
WORKER_STATE_LEFT: WorkerState

class Partition(_message.Message):
    __slots__ = ("key", "offset", "length", "dtype", "data", "indices")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    length: int
    dtype: Dtype
    data: bytes
    indices: bytes
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., data: _Optional[bytes] = ..., indices: _Optional[bytes] = ...) -> None: ...

class ParameterSpec(_message.Message):
    __slots__ = ("key", "shape", "dtype")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    key: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: Dtype
    def __init__(self, key: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[Dtype, str]] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "kwargs", "groups", "buffers")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kwargs: _containers.ScalarMap[str, float]
    groups: _containers.RepeatedCompositeFieldContainer[ParamGroup]
    buffers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., kwargs: _Optional[_Mapping[str, float]] = ..., groups: _Optional[_Iterable[_Union[ParamGroup, _Mapping]]] = ..., buffers: _Optional[_Iterable[str]] = ...) -> None: ...

class ParamGroup(_message.Message):
    __slots__ = ("keys", "kwargs")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    kwargs: _containers.ScalarMap[str, float]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., kwargs: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GroupHyperparameters(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PlanInfo(_message.Message):
    __slots__ = ("specs", "num_shards", "partition_bytes", "digest")
    SPECS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    specs: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    num_shards: int
    partition_bytes: int
    digest: str
    def __init__(self, specs: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., num_shards: _Optional[int] = ..., partition_bytes: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class ClusterConfig(_message.Message):
    __slots__ = ("mode", "num_workers", "lease_timeout_seconds", "learning_rate", "sync_quorum", "round_timeout_seconds", "max_staleness", "staleness_lr", "staleness", "moving_rate", "communication_period", "easgd_sync", "outer_optimizer", "fragments")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    SYNC_QUORUM_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_LR_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    MOVING_RATE_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_PERIOD_FIELD_NUMBER: _ClassVar[int]
    EASGD_SYNC_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    num_workers: int
    lease_timeout_seconds: float
    learning_rate: float
    sync_quorum: int
    round_timeout_seconds: float
    max_staleness: int
    staleness_lr: str
    staleness: int
    moving_rate: float
    communication_period: int
    easgd_sync: bool
    outer_optimizer: str
    fragments: int
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., num_workers: _Optional[int] = ..., lease_timeout_seconds: _Optional[float] = ..., learning_rate: _Optional[float] = ..., sync_quorum: _Optional[int] = ..., round_timeout_seconds: _Optional[float] = ..., max_staleness: _Optional[int] = ..., staleness_lr: _Optional[str] = ..., staleness: _Optional[int] = ..., moving_rate: _Optional[float] = ..., communication_period: _Optional[int] = ..., easgd_sync: _Optional[bool] = ..., outer_optimizer: _Optional[str] = ..., fragments: _Optional[int] = ...) -> None: ...

class MembershipEpoch(_message.Message):
    __slots__ = ("epoch", "decided_at_version", "num_workers", "members", "config_changes", "reason", "resize_version", "previous_num_workers", "configured_num_workers", "signature", "cluster_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_CHANGES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESIZE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    decided_at_version: int
    num_workers: int
    members: _containers.RepeatedCompositeFieldContainer[EpochMember]
    config_changes: _containers.RepeatedCompositeFieldContainer[ConfigChange]
    reason: str
    resize_version: int
    previous_num_workers: int
    configured_num_workers: int
    signature: bytes
    cluster_id: str
    def __init__(self, epoch: _Optional[int] = ..., decided_at_version: _Optional[int] = ..., num_workers: _Optional[int] = ..., members: _Optional[_Iterable[_Union[EpochMember, _Mapping]]] = ..., config_changes: _Optional[_Iterable[_Union[ConfigChange, _Mapping]]] = ..., reason: _Optional[str] = ..., resize_version: _Optional[int] = ..., previous_num_workers: _Optional[int] = ..., configured_num_workers: _Optional[int] = ..., signature: _Optional[bytes] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class EpochMember(_message.Message):
    __slots__ = ("rank", "state", "incarnation", "since_version", "until_version")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNTIL_VERSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    state: WorkerState
    incarnation: int
    since_version: int
    until_version: int
    def __init__(self, rank: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., incarnation: _Optional[int] = ..., since_version: _Optional[int] = ..., until_version: _Optional[int] = ...) -> None: ...

class ConfigChange(_message.Message):
    __slots__ = ("version", "update", "epoch", "inner_step")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    version: int
    update: UpdateConfigRequest
    epoch: int
    inner_step: int
    def __init__(self, version: _Optional[int] = ..., update: _Optional[_Union[UpdateConfigRequest, _Mapping]] = ..., epoch: _Optional[int] = ..., inner_step: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("rank", "num_workers", "incarnation", "membership_epoch", "membership")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_workers: int
    incarnation: int
    membership_epoch: int
    membership: MembershipEpoch
    def __init__(self, rank: _Optional[int] = ..., num_workers: _Optional[int] = ..., incarnation: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "config", "initialized", "version", "plan_digest", "clock", "optimizer", "membership", "data_port", "session", "checkpointed_version")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    config: ClusterConfig
    initialized: bool
    version: int
    plan_digest: str
    clock: int
    optimizer: OptimizerSpec
    membership: MembershipEpoch
    data_port: int
    session: int
    checkpointed_version: int
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., config: _Optional[_Union[ClusterConfig, _Mapping]] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., plan_digest: _Optional[str] = ..., clock: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ..., data_port: _Optional[int] = ..., session: _Optional[int] = ..., checkpointed_version: _Optional[int] = ...) -> None: ...

class InitHeader(_message.Message):
    __slots__ = ("rank", "incarnation", "plan", "optimizer", "membership_epoch", "version")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    plan: PlanInfo
    optimizer: OptimizerSpec
    membership_epoch: int
    version: int
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., plan: _Optional[_Union[PlanInfo, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., membership_epoch: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("header", "partition")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    header: InitHeader
    partition: Partition
    def __init__(self, header: _Optional[_Union[InitHeader, _Mapping]] = ..., partition: _Optional[_Union[Partition, _Mapping]] = ...) -> None: ...

class InitResponse(_message.Message):
    __slots__ = ("applied", "version", "plan_digest")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    version: int
    plan_digest: str
    def __init__(self, applied: _Optional[bool] = ..., version: _Optional[int] = ..., plan_digest: _Optional[str] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("rank", "incarnation", "clock", "version", "plan_digest", "groups", "skip", "membership_epoch", "membership", "data_sequence", "session", "hold_for_clip", "sample_count", "traceparent")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    DATA_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HOLD_FOR_CLIP_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    clock: int
    version: int
    plan_digest: str
    groups: _containers.RepeatedCompositeFieldContainer[GroupHyperparameters]
    skip: bool
    membership_epoch: int
    membership: MembershipEpoch
    data_sequence: int
    session: int
    hold_for_clip: bool
    sample_count: int
    traceparent: str
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., clock: _Optional[int] = ..., version: _Optional[int] = ..., plan_digest: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[GroupHyperparameters, _Mapping]]] = ..., skip: _Optional[bool] = ..., membership_epoch: _Optional[int] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ..., data_sequence: _Optional[int] = ..., session: _Optional[int] = ..., hold_for_clip: _Optional[bool] = ..., sample_count: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "partition")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    partition: Partition
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., partition: _Optional[_Union[Partition, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "duplicate", "staleness", "dropped", "mode", "skipped", "membership_epoch", "membership", "clip", "checkpointed_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    duplicate: bool
    staleness: int
    dropped: bool
    mode: Mode
    skipped: bool
    membership_epoch: int
    membership: MembershipEpoch
    clip: ClipNorm
    checkpointed_version: int
    def __init__(self, version: _Optional[int] = ..., duplicate: _Optional[bool] = ..., staleness: _Optional[int] = ..., dropped: _Optional[bool] = ..., mode: _Optional[_Union[Mode, str]] = ..., skipped: _Optional[bool] = ..., membership_epoch: _Optional[int] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ..., clip: _Optional[_Union[ClipNorm, _Mapping]] = ..., checkpointed_version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "min_version", "plan_digest", "wire_dtype", "membership_epoch", "clip")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    min_version: int
    plan_digest: str
    wire_dtype: Dtype
    membership_epoch: int
    clip: ClipCoefficient
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., min_version: _Optional[int] = ..., plan_digest: _Optional[str] = ..., wire_dtype: _Optional[_Union[Dtype, str]] = ..., membership_epoch: _Optional[int] = ..., clip: _Optional[_Union[ClipCoefficient, _Mapping]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("version", "partition")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    version: int
    partition: Partition
    def __init__(self, version: _Optional[int] = ..., partition: _Optional[_Union[Partition, _Mapping]] = ...) -> None: ...

class ExchangeHeader(_message.Message):
    __slots__ = ("rank", "incarnation", "clock", "plan_digest", "membership_epoch", "session")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    clock: int
    plan_digest: str
    membership_epoch: int
    session: int
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., clock: _Optional[int] = ..., plan_digest: _Optional[str] = ..., membership_epoch: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("header", "partition")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    header: ExchangeHeader
    partition: Partition
    def __init__(self, header: _Optional[_Union[ExchangeHeader, _Mapping]] = ..., partition: _Optional[_Union[Partition, _Mapping]] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("version", "partition")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    version: int
    partition: Partition
    def __init__(self, version: _Optional[int] = ..., partition: _Optional[_Union[Partition, _Mapping]] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("header", "partitions", "wire_dtype")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    partitions: _containers.RepeatedCompositeFieldContainer[Partition]
    wire_dtype: Dtype
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., partitions: _Optional[_Iterable[_Union[Partition, _Mapping]]] = ..., wire_dtype: _Optional[_Union[Dtype, str]] = ...) -> None: ...

class PushPullResponse(_message.Message):
    __slots__ = ("version", "partitions", "push", "data_sequence")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    DATA_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    version: int
    partitions: _containers.RepeatedCompositeFieldContainer[Partition]
    push: PushResponse
    data_sequence: int
    def __init__(self, version: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[Partition, _Mapping]]] = ..., push: _Optional[_Union[PushResponse, _Mapping]] = ..., data_sequence: _Optional[int] = ...) -> None: ...

class PushPullOnceRequest(_message.Message):
    __slots__ = ("header", "partitions", "wire_dtype")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    partitions: _containers.RepeatedCompositeFieldContainer[Partition]
    wire_dtype: Dtype
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., partitions: _Optional[_Iterable[_Union[Partition, _Mapping]]] = ..., wire_dtype: _Optional[_Union[Dtype, str]] = ...) -> None: ...

class PushPullOnceResponse(_message.Message):
    __slots__ = ("version", "partitions", "push")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    version: int
    partitions: _containers.RepeatedCompositeFieldContainer[Partition]
    push: PushResponse
    def __init__(self, version: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[Partition, _Mapping]]] = ..., push: _Optional[_Union[PushResponse, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "membership_epoch", "membership")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    membership_epoch: int
    membership: MembershipEpoch
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("version", "state", "membership_epoch", "membership", "data_port", "checkpointed_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: WorkerState
    membership_epoch: int
    membership: MembershipEpoch
    data_port: int
    checkpointed_version: int
    def __init__(self, version: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., membership_epoch: _Optional[int] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ..., data_port: _Optional[int] = ..., checkpointed_version: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "membership_epoch", "membership", "session")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    membership_epoch: int
    membership: MembershipEpoch
    session: int
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ..., session: _Optional[int] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("version", "membership_epoch", "membership")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    version: int
    membership_epoch: int
    membership: MembershipEpoch
    def __init__(self, version: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "num_rows", "dim", "dtype", "seed", "init_std", "optimizer", "admit_after", "expire_after_rounds", "expire_after_seconds", "max_bytes", "on_full", "initializer", "init_low", "init_high")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INIT_STD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_AFTER_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    ON_FULL_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_LOW_FIELD_NUMBER: _ClassVar[int]
    INIT_HIGH_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    dim: int
    dtype: Dtype
    seed: int
    init_std: float
    optimizer: OptimizerSpec
    admit_after: int
    expire_after_rounds: int
    expire_after_seconds: float
    max_bytes: int
    on_full: str
    initializer: str
    init_low: float
    init_high: float
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., seed: _Optional[int] = ..., init_std: _Optional[float] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., admit_after: _Optional[int] = ..., expire_after_rounds: _Optional[int] = ..., expire_after_seconds: _Optional[float] = ..., max_bytes: _Optional[int] = ..., on_full: _Optional[str] = ..., initializer: _Optional[str] = ..., init_low: _Optional[float] = ..., init_high: _Optional[float] = ...) -> None: ...

class RowBlock(_message.Message):
    __slots__ = ("table", "ids", "dtype", "data")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    dtype: Dtype
    data: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class InitTablesRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "tables", "rows")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    rows: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., rows: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class InitTablesResponse(_message.Message):
    __slots__ = ("applied", "version", "clock", "tables")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    version: int
    clock: int
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    def __init__(self, applied: _Optional[bool] = ..., version: _Optional[int] = ..., clock: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "min_version", "blocks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    min_version: int
    blocks: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., min_version: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class PullRowsResponse(_message.Message):
    __slots__ = ("version", "blocks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    version: int
    blocks: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, version: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class PushRowsRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "clock", "blocks", "session", "hyperparameters")
    class HyperparametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMETERS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    clock: int
    blocks: _containers.RepeatedCompositeFieldContainer[RowBlock]
    session: int
    hyperparameters: _containers.ScalarMap[str, float]
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., clock: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ..., session: _Optional[int] = ..., hyperparameters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PushRowsResponse(_message.Message):
    __slots__ = ("version", "duplicate")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    version: int
    duplicate: bool
    def __init__(self, version: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class TableStatus(_message.Message):
    __slots__ = ("name", "num_rows", "dim", "rows", "bytes", "rows_pulled", "rows_pushed", "max_rows", "optimizer", "rows_admitted", "rows_evicted_expired", "rows_evicted_lru", "admit_after", "expire_after_rounds", "expire_after_seconds", "max_bytes", "on_full", "filter_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ROWS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ROWS_EVICTED_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ROWS_EVICTED_LRU_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_AFTER_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    ON_FULL_FIELD_NUMBER: _ClassVar[int]
    FILTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    dim: int
    rows: int
    bytes: int
    rows_pulled: int
    rows_pushed: int
    max_rows: int
    optimizer: str
    rows_admitted: int
    rows_evicted_expired: int
    rows_evicted_lru: int
    admit_after: int
    expire_after_rounds: int
    expire_after_seconds: float
    max_bytes: int
    on_full: str
    filter_bytes: int
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., dim: _Optional[int] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., rows_pulled: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., max_rows: _Optional[int] = ..., optimizer: _Optional[str] = ..., rows_admitted: _Optional[int] = ..., rows_evicted_expired: _Optional[int] = ..., rows_evicted_lru: _Optional[int] = ..., admit_after: _Optional[int] = ..., expire_after_rounds: _Optional[int] = ..., expire_after_seconds: _Optional[float] = ..., max_bytes: _Optional[int] = ..., on_full: _Optional[str] = ..., filter_bytes: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "incarnation", "clock", "state", "last_seen_seconds_ago", "pushes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    clock: int
    state: WorkerState
    last_seen_seconds_ago: float
    pushes: int
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., clock: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., last_seen_seconds_ago: _Optional[float] = ..., pushes: _Optional[int] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard_index", "num_shards", "config", "initialized", "version", "plan_digest", "num_partitions", "num_elements", "parameter_bytes", "optimizer", "workers", "received_bytes", "sent_bytes", "rejected_requests", "uptime_seconds", "round_ranks", "pending_mode", "max_clock_gap", "rejected_pushes", "staleness", "round_age_seconds", "round_waiting_for", "last_checkpoint_version", "restored_from_version", "checkpoint_failures", "last_checkpoint_error", "membership", "applied_changes", "membership_authority", "durable_acks", "tables", "tables_version")
    class RejectedPushesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_RANKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_GAP_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_ERROR_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_AUTHORITY_FIELD_NUMBER: _ClassVar[int]
    DURABLE_ACKS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    TABLES_VERSION_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    config: ClusterConfig
    initialized: bool
    version: int
    plan_digest: str
    num_partitions: int
    num_elements: int
    parameter_bytes: int
    optimizer: OptimizerSpec
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    received_bytes: int
    sent_bytes: int
    rejected_requests: int
    uptime_seconds: float
    round_ranks: _containers.RepeatedScalarFieldContainer[int]
    pending_mode: Mode
    max_clock_gap: int
    rejected_pushes: _containers.ScalarMap[str, int]
    staleness: StalenessSummary
    round_age_seconds: float
    round_waiting_for: _containers.RepeatedScalarFieldContainer[int]
    last_checkpoint_version: int
    restored_from_version: int
    checkpoint_failures: int
    last_checkpoint_error: str
    membership: MembershipEpoch
    applied_changes: _containers.RepeatedCompositeFieldContainer[ConfigChange]
    membership_authority: bool
    durable_acks: bool
    tables: _containers.RepeatedCompositeFieldContainer[TableStatus]
    tables_version: int
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., config: _Optional[_Union[ClusterConfig, _Mapping]] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., plan_digest: _Optional[str] = ..., num_partitions: _Optional[int] = ..., num_elements: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., received_bytes: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., rejected_requests: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., round_ranks: _Optional[_Iterable[int]] = ..., pending_mode: _Optional[_Union[Mode, str]] = ..., max_clock_gap: _Optional[int] = ..., rejected_pushes: _Optional[_Mapping[str, int]] = ..., staleness: _Optional[_Union[StalenessSummary, _Mapping]] = ..., round_age_seconds: _Optional[float] = ..., round_waiting_for: _Optional[_Iterable[int]] = ..., last_checkpoint_version: _Optional[int] = ..., restored_from_version: _Optional[int] = ..., checkpoint_failures: _Optional[int] = ..., last_checkpoint_error: _Optional[str] = ..., membership: _Optional[_Union[MembershipEpoch, _Mapping]] = ..., applied_changes: _Optional[_Iterable[_Union[ConfigChange, _Mapping]]] = ..., membership_authority: _Optional[bool] = ..., durable_acks: _Optional[bool] = ..., tables: _Optional[_Iterable[_Union[TableStatus, _Mapping]]] = ..., tables_version: _Optional[int] = ...) -> None: ...

class StalenessSummary(_message.Message):
    __slots__ = ("count", "p50", "p90", "p99", "max")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    count: int
    p50: float
    p90: float
    p99: float
    max: int
    def __init__(self, count: _Optional[int] = ..., p50: _Optional[float] = ..., p90: _Optional[float] = ..., p99: _Optional[float] = ..., max: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: ShardStatus
    def __init__(self, status: _Optional[_Union[ShardStatus, _Mapping]] = ...) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class WatchStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: ShardStatus
    def __init__(self, status: _Optional[_Union[ShardStatus, _Mapping]] = ...) -> None: ...

class UpdateConfigRequest(_message.Message):
    __slots__ = ("learning_rate", "mode", "sync_quorum", "round_timeout_seconds", "max_staleness", "staleness_lr", "staleness", "moving_rate", "communication_period", "at_version", "fragments")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SYNC_QUORUM_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_LR_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    MOVING_RATE_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_PERIOD_FIELD_NUMBER: _ClassVar[int]
    AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    mode: Mode
    sync_quorum: int
    round_timeout_seconds: float
    max_staleness: int
    staleness_lr: str
    staleness: int
    moving_rate: float
    communication_period: int
    at_version: int
    fragments: int
    def __init__(self, learning_rate: _Optional[float] = ..., mode: _Optional[_Union[Mode, str]] = ..., sync_quorum: _Optional[int] = ..., round_timeout_seconds: _Optional[float] = ..., max_staleness: _Optional[int] = ..., staleness_lr: _Optional[str] = ..., staleness: _Optional[int] = ..., moving_rate: _Optional[float] = ..., communication_period: _Optional[int] = ..., at_version: _Optional[int] = ..., fragments: _Optional[int] = ...) -> None: ...

class UpdateConfigResponse(_message.Message):
    __slots__ = ("config", "pending_mode", "at_version", "membership_epoch")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PENDING_MODE_FIELD_NUMBER: _ClassVar[int]
    AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    config: ClusterConfig
    pending_mode: Mode
    at_version: int
    membership_epoch: int
    def __init__(self, config: _Optional[_Union[ClusterConfig, _Mapping]] = ..., pending_mode: _Optional[_Union[Mode, str]] = ..., at_version: _Optional[int] = ..., membership_epoch: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("version", "path", "seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    seconds: float
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class EvictWorkerRequest(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class EvictWorkerResponse(_message.Message):
    __slots__ = ("previous_state", "version")
    PREVIOUS_STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    previous_state: WorkerState
    version: int
    def __init__(self, previous_state: _Optional[_Union[WorkerState, str]] = ..., version: _Optional[int] = ...) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("num_workers", "at_version")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    at_version: int
    def __init__(self, num_workers: _Optional[int] = ..., at_version: _Optional[int] = ...) -> None: ...

class ResizeResponse(_message.Message):
    __slots__ = ("previous_num_workers", "num_workers", "at_version", "membership_epoch")
    PREVIOUS_NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    previous_num_workers: int
    num_workers: int
    at_version: int
    membership_epoch: int
    def __init__(self, previous_num_workers: _Optional[int] = ..., num_workers: _Optional[int] = ..., at_version: _Optional[int] = ..., membership_epoch: _Optional[int] = ...) -> None: ...

class ExportParametersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportParametersResponse(_message.Message):
    __slots__ = ("version", "partition", "plan", "buffers", "shard_index", "tables", "tables_version", "rows")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    TABLES_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    version: int
    partition: Partition
    plan: PlanInfo
    buffers: _containers.RepeatedScalarFieldContainer[str]
    shard_index: int
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    tables_version: int
    rows: RowBlock
    def __init__(self, version: _Optional[int] = ..., partition: _Optional[_Union[Partition, _Mapping]] = ..., plan: _Optional[_Union[PlanInfo, _Mapping]] = ..., buffers: _Optional[_Iterable[str]] = ..., shard_index: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., tables_version: _Optional[int] = ..., rows: _Optional[_Union[RowBlock, _Mapping]] = ...) -> None: ...

class ClipNorm(_message.Message):
    __slots__ = ("round", "sum_squares")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SUM_SQUARES_FIELD_NUMBER: _ClassVar[int]
    round: int
    sum_squares: float
    def __init__(self, round: _Optional[int] = ..., sum_squares: _Optional[float] = ...) -> None: ...

class ClipCoefficient(_message.Message):
    __slots__ = ("round", "coefficient")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    round: int
    coefficient: float
    def __init__(self, round: _Optional[int] = ..., coefficient: _Optional[float] = ...) -> None: ...

class OptimizerStateValue(_message.Message):
    __slots__ = ("key", "offset", "name", "dtype", "scalar", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    name: str
    dtype: Dtype
    scalar: bool
    data: bytes
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., scalar: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...

class PullOptimizerStateRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "session", "plan_digest")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    session: int
    plan_digest: str
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., session: _Optional[int] = ..., plan_digest: _Optional[str] = ...) -> None: ...

class PullOptimizerStateResponse(_message.Message):
    __slots__ = ("version", "values")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    version: int
    values: _containers.RepeatedCompositeFieldContainer[OptimizerStateValue]
    def __init__(self, version: _Optional[int] = ..., values: _Optional[_Iterable[_Union[OptimizerStateValue, _Mapping]]] = ...) -> None: ...

class PushOptimizerStateRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "session", "plan_digest", "values")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    session: int
    plan_digest: str
    values: _containers.RepeatedCompositeFieldContainer[OptimizerStateValue]
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., session: _Optional[int] = ..., plan_digest: _Optional[str] = ..., values: _Optional[_Iterable[_Union[OptimizerStateValue, _Mapping]]] = ...) -> None: ...

class PushOptimizerStateResponse(_message.Message):
    __slots__ = ("stage", "partitions")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    partitions: int
    def __init__(self, stage: _Optional[int] = ..., partitions: _Optional[int] = ...) -> None: ...

class CommitOptimizerStateRequest(_message.Message):
    __slots__ = ("rank", "incarnation", "session", "stage")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    session: int
    stage: int
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., session: _Optional[int] = ..., stage: _Optional[int] = ...) -> None: ...

class CommitOptimizerStateResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
