"""What a :class:`~ps_worker.client.PSClient` offers beyond the data calls: construction from the
environment contract and the full model out of every shard.

``PSClient.from_env(model)`` reads ``PS_SERVERS``, ``PS_RANK``, ``PS_NUM_WORKERS``, … (the table
:data:`ps_worker.env.CONTRACT`); ``client.state_dict()`` and ``client.pull_into(model)`` assemble
every parameter and buffer from all shards (:mod:`ps_worker.export`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ps_worker.client import PSClient


class ModelIO:
    """Mixin of :class:`~ps_worker.client.PSClient`: environment construction and model export."""

    @classmethod
    def from_env(
        cls, model: torch.nn.Module | None = None, optimizer: Mapping[str, Any] | None = None, **overrides: Any
    ) -> PSClient:
        """A client configured by the environment contract (:data:`ps_worker.env.CONTRACT`), joined
        and initialized with ``model`` when given (``optimizer``: default from ``PS_OPTIMIZER``,
        ``PS_LR``, ``PS_MOMENTUM``); ``overrides`` are constructor arguments that win.

        Raises:
            ps_worker.env.EnvError: a variable is missing or invalid (the message names it).
        """
        from ps_worker.env import init_from_env

        return init_from_env(model, optimizer, client_class=cls, **overrides)

    def state_dict(
        self, like: Mapping[str, torch.Tensor] | None = None, min_version: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the job as full CPU tensors, for ``torch.save`` and
        ``model.load_state_dict`` (see :func:`ps_worker.export.state_dict`).

        Raises:
            RuntimeError: not initialized yet. grpc.RpcError: a shard refused the pull.
        """
        from ps_worker.export import state_dict

        return state_dict(self, like, min_version)  # type: ignore[arg-type]

    def pull_into(self, model: torch.nn.Module, min_version: int | None = None) -> int:
        """Copy the shards' parameters and buffers into ``model`` in place; returns the version read
        (see :func:`ps_worker.export.pull_into`).

        Raises:
            KeyError, ValueError: ``model`` is another architecture. RuntimeError, grpc.RpcError: as
            :meth:`state_dict`.
        """
        from ps_worker.export import pull_into

        return pull_into(self, model, min_version)  # type: ignore[arg-type]
