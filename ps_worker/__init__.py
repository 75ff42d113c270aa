"""grpc-ps worker side: ``PSClient`` (push/pull to every shard), ``DistributedOptimizer`` and
``DistributedSampler`` (torch's, its rank from the client or environment), ``RowPrefetcher`` (embedding
rows of the next batch pulled while the current one trains).

Each is imported on first use, so the command-line tools parse their arguments before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ps_worker.client import PSClient, init_from_env
    from ps_worker.errors import RoundTimeoutError, ShardError, ShardUnreachableError
    from ps_worker.optimizer import DistributedOptimizer
    from ps_worker.sampler import DistributedSampler
    from ps_worker.tables.prefetch import RowPrefetcher

__all__ = [
    "PSClient",
    "DistributedOptimizer",
    "DistributedSampler",
    "RowPrefetcher",
    "RoundTimeoutError",
    "ShardError",
    "ShardUnreachableError",
    "init_from_env",
]

_ERRORS = ("RoundTimeoutError", "ShardError", "ShardUnreachableError")


def __getattr__(name: str) -> Any:
    if name == "PSClient":
        from ps_worker.client import PSClient

        return PSClient
    if name == "DistributedOptimizer":
        from ps_worker.optimizer import DistributedOptimizer

        return DistributedOptimizer
    if name == "DistributedSampler":
        from ps_worker.sampler import DistributedSampler

        return DistributedSampler
    if name == "RowPrefetcher":
        from ps_worker.tables.prefetch import RowPrefetcher

        return RowPrefetcher
    if name == "init_from_env":
        from ps_worker.client import init_from_env

        return init_from_env
    if name in _ERRORS or name[:1].isupper():  # the error classes of ps_worker.errors
        from ps_worker import errors

        if name in errors.__all__:
            return getattr(errors, name)
    raise AttributeError(f"module 'ps_worker' has no attribute {name!r}")
