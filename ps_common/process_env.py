"""The environment grpc-ps processes run best with: glibc's malloc tuned for large messages, and intra-op threads.

One definition for ``ps-launch``, the benchmark and (checked by a test) the Docker images.
"""

from __future__ import annotations

import faulthandler
import os
import platform
import signal
import sys
from collections.abc import Mapping, Sequence

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


def tune_malloc_at_start(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> None:
    """Restart this process with :data:`GLIBC_TUNABLES` when its environment lacks the variable.

    glibc reads its tunables only when a program starts, so a ``ps-server`` or ``ps-worker`` that a
    user (or a container runtime, or a StatefulSet) starts without them would run its data path
    with the per-message mmap/munmap and page faults the tuning removes (measured 1.6x slower per
    100 MB step). The entry points call this first, before importing torch or grpcio: the process
    ``execve``s itself with the same interpreter, the same command line (``sys.orig_argv``) and
    the variable added, so it keeps its PID (signals, ``kubectl``, ``docker stop`` and the
    launcher's bookkeeping are unaffected) and runs exactly as under ``ps-launch``.

    Nothing happens when ``GLIBC_TUNABLES`` is already set (the user's own value is kept, and an
    empty one turns the tuning off), off Linux, or with a C library other than glibc.

    Args:
        environ: the environment to check, and to run again with the variable added (``os.environ``).
        argv: the command line to run again (``sys.orig_argv``).

    Raises:
        OSError: the interpreter could not be executed again (the caller's process is unchanged).
    """
    env = os.environ if environ is None else environ
    if "GLIBC_TUNABLES" in env or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return
    command = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, {**env, "GLIBC_TUNABLES": GLIBC_TUNABLES})


def dump_stacks_on_signal(signum: int = signal.SIGUSR1) -> None:
    """Make ``kill -USR1 PID`` write every thread's Python stack to this process's stderr (its log
    under ``ps-launch``, ``docker logs``, ``kubectl logs``); the process goes on running. For a
    shard or worker that seems stuck: what each thread is waiting on, with no debugger attached
    (:mod:`faulthandler`, which writes from the signal handler, so even a thread holding the GIL
    in C code gets its stack shown)."""
    faulthandler.register(signum, all_threads=True)
