"""``python -m ps_server.host SPEC``: the shard host, which starts the shards of one machine for the
cost of one start-up (docs/architecture.md#start-up; measured in bench/README.md, "Time to first
step").

``ps-launch`` starts it for a fresh job's S shards. It imports once what every shard imports
(torch, grpcio, the server's modules) and ``torch._dynamo`` (which the first ``torch.optim``
constructor of a process imports: it builds a throw-away ``torch.optim.SGD``), then forks one
process per shard, prints ``shard K pid P`` for each on stdout and exits. Copy-on-write keeps the
imported modules shared; each shard saves the 1.5 s of CPU of ``import torch`` and the 1.3 s of
``torch._dynamo`` it would pay on its own.

Each child is a real ``ps-server``: its own PID, session, port, stdout (a pipe ps-launch reads),
stderr (its log) and checkpoint directory; it runs :func:`ps_server.cli.main` on its own command
line, the code ``ps-server ARGV`` runs. ps-launch is the children's subreaper
(``PR_SET_CHILD_SUBREAPER``): once the host exits they are ps-launch's own children, which it waits
for and whose exit status and CPU time it reads as any child's. A child first waits for that (its
parent becomes the launcher), then asks for SIGTERM at the launcher's death (``PR_SET_PDEATHSIG``,
as every ps-launch child); it exits at once if another process adopts it (the launcher is gone, or
stopped being the subreaper before the host exited).

Fork safety: no gRPC object (server, channel) exists before the fork, and the host forks only when
it runs a single thread (nothing started torch's intra-op pool or a gRPC thread; ps-launch sets
``OMP_NUM_THREADS``); otherwise it exits 3 before forking, and ps-launch starts plain ``ps-server``
processes instead.

SPEC: a JSON object ``{"launcher": PID, "shards": [{"argv": [...], "stdout": FD, "stderr": FD}, ...]}``,
the FDs inherited from the launcher (``pass_fds``); ``"warm": false`` leaves ``torch._dynamo`` to
each shard (the warm-up thread of :func:`ps_server.cli.main`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from ps_common.process_env import dump_stacks_on_signal, tune_malloc_at_start

PR_SET_PDEATHSIG = 1
ADOPTION_SECONDS = 30.0
"""How long a forked shard waits for the launcher to become its parent (the host exits within
milliseconds of its last fork) before it gives up and exits."""
NOT_FORKED = 3
"""The host's exit status when it did not fork: more than one thread runs."""


def prepare(warm: bool) -> None:
    """Import what every shard imports; with ``warm``, also ``torch._dynamo`` (a throw-away
    ``torch.optim.SGD``: no thread is started, ``OMP_NUM_THREADS`` or not)."""
    import ps_common.errors  # noqa: F401 - what ps_server.cli.main imports, once for every shard
    import ps_server.cli  # noqa: F401
    import ps_server.config  # noqa: F401
    import ps_server.server  # noqa: F401

    if warm:
        from ps_server.cli import warm_up

        warm_up()


def threads() -> int:
    """Threads of this process (``/proc/self/task``; 1 where it cannot be read)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: prepare, fork the shards of SPEC (``argv[0]``), print their PIDs.

    Returns:
        0 once every shard is forked; 2 for a bad SPEC; :data:`NOT_FORKED` when more than one
        thread runs (then nothing was forked).
    """
    if argv is None:
        tune_malloc_at_start()
        dump_stacks_on_signal()
        argv = sys.argv[1:]
    try:
        spec = json.loads(argv[0])
        launcher = int(spec["launcher"])
        shards = [(list(s["argv"]), int(s["stdout"]), int(s["stderr"])) for s in spec["shards"]]
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        print(f"ps-server host: bad spec ({exc!r}); usage: python -m ps_server.host SPEC", file=sys.stderr)
        return 2
    started = time.perf_counter()
    prepare(bool(spec.get("warm", True)))
    running = threads()
    if running != 1:
        print(f"ps-server host: {running} threads run; forking would copy none of them: not forking", file=sys.stderr)
        return NOT_FORKED
    print(f"ps-server host: ready in {time.perf_counter() - started:.2f} s; forking", file=sys.stderr, flush=True)
    inherited = {fd for _, out, err in shards for fd in (out, err)}
    for k, (shard_argv, out, err) in enumerate(shards):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the forked shard (covered by tests/e2e/test_launch.py)
            become_shard(shard_argv, out, err, inherited, launcher)
        print(f"shard {k} pid {pid}", flush=True)
    return 0


def become_shard(argv: list[str], out: int, err: int, inherited: set[int], launcher: int) -> NoReturn:
    """In a forked child: take ``out``/``err`` as stdout/stderr, close the other shards' ends, wait
    to be the launcher's child, then run ``ps-server ARGV`` and end with its exit status."""
    code: Any = 1
    host = os.getppid()
    try:
        os.setsid()
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in inherited - {0, 1, 2}:
            os.close(fd)
        deadline = time.monotonic() + ADOPTION_SECONDS
        while (parent := os.getppid()) != launcher:
            if parent != host or time.monotonic() > deadline:  # adopted by another: the launcher is gone
                print(f"ps-server: pid {launcher} did not become this shard's parent; exiting", file=sys.stderr)
                end(1)
            time.sleep(0.002)
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
        if os.getppid() != launcher:  # the launcher died before the request: nobody would stop this shard
            end(1)
        sys.argv = ["ps-server", *argv]
        from ps_server.cli import main as serve

        code = serve()  # ends the process itself once stopped; returns when the shard could not start
    except SystemExit as exc:  # a bad flag: argparse's exit status
        code = exc.code
    except BaseException:
        traceback.print_exc()
    end(code if isinstance(code, int) else 1)


def end(code: int) -> NoReturn:
    """End the forked shard now, without the host's finalization (ps_server.cli.exit_now)."""
    from ps_server.cli import exit_now

    exit_now(code)


if __name__ == "__main__":
    end(main())  # no finalization: the interpreter's last collections walk torch's objects
