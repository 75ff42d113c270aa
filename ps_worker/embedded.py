"""A single-process job's own shard: the real gRPC server of ``ps_server``, in threads of this process.

``python train.py`` with no ``PS_SERVERS`` (and no job of more than one worker in the environment)
runs as a job of one worker: :func:`ps_worker.env.init_from_env` starts an :class:`EmbeddedShard` on
``127.0.0.1`` (a free port), connects to it as rank 0 of 1, and the shard stops when the client
closes or at interpreter exit. The same script under ``ps-launch`` (or with ``PS_SERVERS`` set) joins
that cluster instead, unchanged. Training is the cluster's code path: the shard holds the weights and
runs the optimizer; the worker pushes gradients and pulls weights over loopback gRPC.

This is the one module of ``ps_worker`` that imports ``ps_server`` (lazily, when the shard starts):
the exception is declared in ``pyproject.toml``'s import-linter contract.
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Any

STOP_GRACE = 1.0
"""Seconds the shard's gRPC server gives calls still running when it stops."""


class EmbeddedShard:
    """One shard (index 0 of 1, one worker) serving from threads of this process.

    Use :meth:`start`; :meth:`stop` (idempotent, also registered with :mod:`atexit`) shuts it down.
    """

    def __init__(self, server: Any) -> None:
        self.server = server
        """The running :class:`ps_server.server.ShardServer`."""
        self._lock = threading.Lock()
        self._stopped = False

    @classmethod
    def start(cls, mode: str = "sync", out: Any = None) -> EmbeddedShard:
        """Start a shard on ``127.0.0.1`` (a free port), in ``mode`` (``ps_common.modes.MODES``), for one
        worker, and say so on ``out`` (stderr by default).

        Raises:
            ps_common.errors.InvalidRequestError: ``mode`` names no mode.
            RuntimeError: no port could be bound.
        """
        from ps_server.config import ServerConfig
        from ps_server.server import start_server

        config = ServerConfig(
            shard_index=0, num_shards=1, num_workers=1, mode=mode, host="127.0.0.1", port=0, metrics_port=-1
        )
        shard = cls(start_server(config))
        atexit.register(shard.stop)
        print(
            f"grpc-ps: PS_SERVERS is not set: running as a single-process job with an in-process shard on "
            f"{shard.address} ({mode}); launch with ps-launch for a cluster",
            file=out or sys.stderr,
            flush=True,
        )
        return shard

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` of the shard."""
        return str(self.server.address)

    def environment(self) -> dict[str, str]:
        """The contract variables of a job of this shard and one worker (rank 0)."""
        return {"PS_SERVERS": self.address, "PS_RANK": "0", "PS_NUM_WORKERS": "1"}

    def stop_with(self, client: Any) -> None:
        """Stop this shard when ``client`` (a :class:`~ps_worker.client.PSClient`) closes, after it left."""
        client.on_close.append(self.stop)

    def stop(self) -> None:
        """Stop the shard's server and join its threads (a few seconds at most). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.stop)
        self.server.stop(STOP_GRACE)
