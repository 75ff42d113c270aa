"""``DistributedSampler`` without a process group: torch's sampler, its rank and replicas from grpc-ps.

``torch.utils.data.DistributedSampler(dataset)`` asks the default process group for the world size
and rank, which a grpc-ps job does not create. :class:`DistributedSampler` is the same class (same
shuffle, seed, drop_last, padding and ``set_epoch``: torch's code, so the same indices for the same
``(num_replicas, rank)``); only its defaults come from the client or the environment::

    sampler = DistributedSampler(dataset)                   # PS_NUM_WORKERS/PS_RANK, else WORLD_SIZE/RANK
    sampler = DistributedSampler(dataset, client=client)    # the client's num_workers/rank
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch.utils.data

from ps_worker.env import rank_and_workers


def replicas(client: Any = None, environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(num_replicas, rank)`` of this process: ``client``'s ``num_workers``/``rank`` when given;
    else the environment's ``PS_NUM_WORKERS``/``PS_RANK``, each falling back to ``WORLD_SIZE``/``RANK``
    (:func:`ps_worker.env.rank_and_workers`); else, with no ``PS_SERVERS`` either, a single-process job
    (``(1, 0)``, as :meth:`PSClient.from_env <ps_worker.client.PSClient.from_env>` runs one).

    Raises:
        ps_worker.env.EnvError: the rank and worker count are half set, invalid, or missing while
            ``PS_SERVERS`` names a cluster.
    """
    if client is not None:
        return int(client.num_workers), int(client.rank)
    environ = os.environ if environ is None else environ
    found = rank_and_workers(environ, required=bool(environ.get("PS_SERVERS", "").strip()))
    if found is None:
        return 1, 0
    rank, num_workers = found
    return num_workers, rank


class DistributedSampler(torch.utils.data.DistributedSampler):
    """:class:`torch.utils.data.DistributedSampler` whose ``num_replicas`` and ``rank`` default to
    grpc-ps's (:func:`replicas`) instead of the default process group's.

    Args:
        dataset: a sized dataset.
        num_replicas: ranks the dataset is split over; None: the client's or environment's.
        rank: this rank, ``0 <= rank < num_replicas``; None: the client's or environment's.
        shuffle, seed, drop_last: as torch's (shuffled by ``seed + epoch``, same on every rank;
            the last samples padded by repetition, or dropped with ``drop_last``).
        client: a :class:`~ps_worker.client.PSClient` whose rank and worker count win over the
            environment. The split is fixed here: after a resize, build a new sampler.
        environ: where the variables are read (``os.environ`` by default).

    Raises:
        ps_worker.env.EnvError: see :func:`replicas`.
        ValueError: ``rank`` outside ``0..num_replicas-1`` (torch's check).
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        client: Any = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if num_replicas is None or rank is None:
            known_replicas, known_rank = replicas(client, environ)
            num_replicas = known_replicas if num_replicas is None else num_replicas
            rank = known_rank if rank is None else rank
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
