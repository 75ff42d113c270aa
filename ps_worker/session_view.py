"""The session's state as attributes of the object that holds it (``PSClient.clock``, ``.version``...)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Generic, TypeVar

from ps_common.modes import ModeSettings
from ps_proto.v1 import ps_pb2

if TYPE_CHECKING:
    from ps_common.optimizer import OptimizerSpec
    from ps_worker.consistency import WorkerMode
    from ps_worker.session import Session

V = TypeVar("V")


class _SessionField(Generic[V]):
    """An attribute of a :class:`SessionView` that is its session's (read and written there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, view: SessionView | None, owner: type | None = None) -> V:
        if view is None:
            return self  # type: ignore[return-value]
        return getattr(view.session, self.name)

    def __set__(self, view: SessionView, value: V) -> None:
        setattr(view.session, self.name, value)


class SessionView:
    """The session's state as attributes of the object that holds it (``PSClient``): reads, and for
    tests and tools writes, go to ``self.session``."""

    session: Session
    mode: _SessionField[str] = _SessionField()
    num_workers: _SessionField[int] = _SessionField()
    """The cluster's worker count: the one given, until shard 0 resizes the job."""
    config: _SessionField[ps_pb2.ClusterConfig] = _SessionField()
    settings: _SessionField[ModeSettings | None] = _SessionField()
    lease_timeout: _SessionField[float] = _SessionField()
    incarnation: _SessionField[int] = _SessionField()
    clock: _SessionField[int] = _SessionField()
    exchanges: _SessionField[int] = _SessionField()
    version: _SessionField[int] = _SessionField()
    versions: _SessionField[list[int]] = _SessionField()
    pushed_bytes: _SessionField[int] = _SessionField()
    pulled_bytes: _SessionField[int] = _SessionField()
    staleness: _SessionField[Counter[int]] = _SessionField()
    recoveries: _SessionField[Counter[str]] = _SessionField()
    refused_pushes: _SessionField[int] = _SessionField()
    dropped_pushes: _SessionField[int] = _SessionField()
    last_step_skipped: _SessionField[bool] = _SessionField()

    @property
    def worker_mode(self) -> WorkerMode:
        """What a step does in the cluster's mode (:mod:`ps_worker.consistency`)."""
        return self.session.worker

    @property
    def optimizer_spec(self) -> OptimizerSpec | None:
        """The server optimizer's spec in force (rank 0's, as the shards hold it), once initialized."""
        return self.session.optimizer
