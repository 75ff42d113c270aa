"""The environment ps-launch gives its children: malloc tunables and threads, unless the user set them."""

from __future__ import annotations

import pytest

from ps_common.process_env import GLIBC_TUNABLES, available_cpus, launch_environment


def test_defaults_are_added_and_the_rest_is_kept() -> None:
    env = launch_environment({"PATH": "/bin"}, processes=4, cpus=16)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": GLIBC_TUNABLES, "OMP_NUM_THREADS": "4"}
    assert GLIBC_TUNABLES.split(":") == [
        "glibc.malloc.hugetlb=1",
        "glibc.malloc.mmap_max=0",
        "glibc.malloc.trim_threshold=4000000000",
        "glibc.malloc.arena_max=1",
    ]


@pytest.mark.parametrize(("processes", "cpus", "threads"), [(4, 2, "1"), (3, 8, "2"), (1, 1, "1"), (2, 3, "1")])
def test_threads_share_the_cpus_and_never_drop_below_one(processes: int, cpus: int, threads: str) -> None:
    assert launch_environment({}, processes, cpus)["OMP_NUM_THREADS"] == threads


def test_the_users_values_win_even_empty() -> None:
    mine = {"GLIBC_TUNABLES": "", "OMP_NUM_THREADS": "7"}
    assert launch_environment(mine, processes=2, cpus=64) == mine
    assert launch_environment({"OMP_NUM_THREADS": "7"}, 2, 64)["GLIBC_TUNABLES"] == GLIBC_TUNABLES


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        launch_environment({}, processes=0, cpus=2)
    assert available_cpus() >= 1
