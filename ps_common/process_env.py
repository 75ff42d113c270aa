"""The environment grpc-ps processes run best with: glibc's malloc tuned for large messages, and intra-op threads.

One definition for ``ps-launch``, the benchmark and (checked by a test) the Docker images.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

GLIBC_TUNABLES = ":".join(
    (
        "glibc.malloc.hugetlb=1",
        "glibc.malloc.mmap_max=0",
        "glibc.malloc.trim_threshold=4000000000",
        "glibc.malloc.arena_max=1",
    )
)
"""malloc settings for processes that move multi-MiB messages: large blocks come from the heap (no
mmap/munmap and fresh page faults per message), transparent huge pages, no trimming, one arena.
Measured 1.4-6x faster on multi-MiB partitions; freed memory stays with the process. glibc reads
the variable only when a program starts, so it must be in a child's environment before exec."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def launch_environment(base: Mapping[str, str], processes: int, cpus: int) -> dict[str, str]:
    """The environment of ``processes`` grpc-ps processes that share ``cpus`` CPUs: ``base`` plus
    ``GLIBC_TUNABLES`` and ``OMP_NUM_THREADS=max(1, cpus // processes)`` where ``base`` lacks them.

    A variable present in ``base`` (the user's own, even empty) is kept as it is: an empty
    ``GLIBC_TUNABLES`` turns the malloc tuning off.

    Args:
        base: the environment to start from (the launcher's own).
        processes: how many processes will share the CPUs, >= 1.
        cpus: CPUs available to them, >= 1.

    Raises:
        ValueError: ``processes`` or ``cpus`` below 1.
    """
    if processes < 1 or cpus < 1:
        raise ValueError(f"processes and cpus must be >= 1, got processes={processes}, cpus={cpus}.")
    env = dict(base)
    env.setdefault("GLIBC_TUNABLES", GLIBC_TUNABLES)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // processes)))
    return env
