"""grpc-ps worker side: ``PSClient`` (push/pull to every shard) and ``DistributedOptimizer``."""

from ps_worker.client import PSClient
from ps_worker.optimizer import DistributedOptimizer

__all__ = ["PSClient", "DistributedOptimizer"]
