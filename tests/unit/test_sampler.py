"""ps_worker.DistributedSampler: torch's sampler, its rank and replicas from the client or environment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.utils.data

from ps_worker import DistributedSampler
from ps_worker.env import EnvError

DATASET = list(range(23))  # not a multiple of the replicas: padding and drop_last matter


def torch_indices(num_replicas: int, rank: int, epoch: int = 0, **kwargs) -> list[int]:
    sampler = torch.utils.data.DistributedSampler(DATASET, num_replicas=num_replicas, rank=rank, **kwargs)
    sampler.set_epoch(epoch)
    return list(sampler)


def indices(sampler: DistributedSampler, epoch: int = 0) -> list[int]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize(
    "environ",
    [
        {"PS_NUM_WORKERS": "3", "PS_RANK": "{rank}"},
        {"WORLD_SIZE": "3", "RANK": "{rank}"},
        {"PS_SERVERS": "127.0.0.1:1", "PS_NUM_WORKERS": "3", "RANK": "{rank}"},
    ],
)
@pytest.mark.parametrize("kwargs", [{}, {"shuffle": False}, {"drop_last": True, "seed": 7}])
def test_the_environment_s_rank_gives_torch_s_indices(environ: dict, kwargs: dict) -> None:
    for rank in range(3):
        env = {k: v.format(rank=rank) for k, v in environ.items()}
        sampler = DistributedSampler(DATASET, environ=env, **kwargs)
        assert (sampler.num_replicas, sampler.rank) == (3, rank)
        assert isinstance(sampler, torch.utils.data.DistributedSampler)
        for epoch in (0, 1, 5):
            assert indices(sampler, epoch) == torch_indices(3, rank, epoch, **kwargs)
            assert len(sampler) == len(torch_indices(3, rank, epoch, **kwargs))


def test_the_client_s_rank_wins_over_the_environment() -> None:
    client = SimpleNamespace(rank=1, num_workers=2)
    sampler = DistributedSampler(DATASET, client=client, environ={"RANK": "0", "WORLD_SIZE": "4"})
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert indices(sampler, 3) == torch_indices(2, 1, 3)


def test_explicit_arguments_win_over_client_and_environment() -> None:
    client = SimpleNamespace(rank=1, num_workers=2)
    sampler = DistributedSampler(DATASET, num_replicas=4, rank=3, client=client, environ={})
    assert indices(sampler) == torch_indices(4, 3)
    sampler = DistributedSampler(DATASET, rank=0, client=client)  # the other one from the client
    assert (sampler.num_replicas, sampler.rank) == (2, 0)


def test_no_cluster_in_the_environment_is_a_single_process_job() -> None:
    """As PSClient.from_env runs one: every index, in torch's order for one replica."""
    sampler = DistributedSampler(DATASET, environ={})
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert indices(sampler, 2) == torch_indices(1, 0, 2) and sorted(sampler) == DATASET


def test_it_reads_os_environ_by_default(monkeypatch) -> None:
    for name in ("PS_SERVERS", "PS_RANK", "PS_NUM_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert indices(DistributedSampler(DATASET)) == torch_indices(4, 2)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PS_SERVERS": "127.0.0.1:1"}, "PS_RANK is not set"),  # a cluster, and no rank known
        ({"WORLD_SIZE": "2"}, "PS_RANK is not set"),
        ({"RANK": "1"}, "PS_NUM_WORKERS is not set"),
        ({"RANK": "4", "WORLD_SIZE": "2"}, "PS_RANK=4 is outside 0..1"),
        ({"PS_RANK": "one", "PS_NUM_WORKERS": "2"}, "PS_RANK='one' is not an integer"),
    ],
)
def test_an_unknown_or_invalid_rank_is_an_error_naming_the_variable(environ: dict, message: str) -> None:
    with pytest.raises(EnvError, match=message):
        DistributedSampler(DATASET, environ=environ)


def test_torch_s_own_check_of_an_explicit_rank_holds() -> None:
    with pytest.raises(ValueError, match="Invalid rank"):
        DistributedSampler(DATASET, num_replicas=2, rank=2)
