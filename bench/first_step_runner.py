"""Runs a training script as its launcher would, and writes the moments of this rank's start-up.

``bench/first_step.py`` launches ``torchrun ... first_step_runner.py SCRIPT ARGS`` and
``ps-launch ... first_step_runner.py SCRIPT ARGS`` instead of the script itself, so the example
scripts stay exactly as their users run them: this runner executes ``SCRIPT`` in this process
(:func:`runpy.run_path` as ``__main__``, ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS``
would set them) and records, as wall-clock seconds since the epoch (``time.time()``; every rank
runs on this machine, so they compare with the launcher's clock):

- ``process``: when the kernel started this process (``/proc/self/stat`` field 22, 10 ms ticks);
- ``interpreter``: this file's first line ran (the interpreter and ``site`` are up);
- ``torch``: ``import torch`` done (the script imports it anyway; importing it here moves the cost,
  it does not add to it);
- ``init_process_group``: torch.distributed's ``init_process_group`` returned (torchrun's join);
- ``ps_worker.*``: the client's own start-up lines (DEBUG lines of the ``ps_worker.startup`` logger,
  ``start-up: NAME ...``): ``from_env`` (called), ``joined`` (every shard answered Join),
  ``initialized`` (the model's values pulled: the client is ready for the first step);
- ``first_step``: the first ``optimizer.step()`` of the process returned (a global
  ``torch.optim`` post-step hook: after DDP's all-reduce and SGD, or after grpc-ps's push and the
  pull of the round's weights);
- ``exit``: the script returned.

They go to ``$FIRST_STEP_DIR/rank-$RANK.json`` (one JSON object) when the script returns or fails,
and ``first_step`` also at once (a rank that hangs later still has it). Without ``FIRST_STEP_DIR``
the runner only runs the script.

    FIRST_STEP_DIR=/tmp/x torchrun --standalone --nproc_per_node=2 bench/first_step_runner.py \\
        examples/ddp_tutorial/multigpu_torchrun.py 3 1 --batch_size 32
"""

import time

STARTED = time.time()

import json  # noqa: E402 - the clock above is read first
import logging  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

PREFIX = "start-up: "
"""How ``ps_worker``'s start-up debug lines begin; the word after it names the moment."""


def process_started() -> float | None:
    """Wall-clock start of this process: its ``/proc/self/stat`` starttime (clock ticks since boot)
    against ``CLOCK_BOOTTIME`` now, to 10 ms; None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


class Marks:
    """This rank's moments, written to ``path`` (JSON) by :meth:`save`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.times: dict[str, Any] = {"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid()}
        self.times["process"] = process_started()
        self.times["interpreter"] = STARTED

    def mark(self, name: str, when: float | None = None) -> None:
        self.times.setdefault(name, time.time() if when is None else when)

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.times, f)
        os.replace(tmp, self.path)


class StartupLines(logging.Handler):
    """Takes ``ps_worker.startup``'s ``start-up: NAME ...`` DEBUG lines as moments (the record's own time)."""

    def __init__(self, marks: Marks) -> None:
        super().__init__(logging.DEBUG)
        self.marks = marks

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(PREFIX):
            name = message[len(PREFIX) :].split(" ", 1)[0].rstrip(":")
            self.marks.mark(f"ps_worker.{name}", record.created)


def instrument(marks: Marks) -> None:
    """Hooks on torch and ps_worker that record the moments (nothing else changes)."""
    import torch
    import torch.distributed
    from torch.optim.optimizer import register_optimizer_step_post_hook

    marks.mark("torch")
    first = torch.distributed.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = first(*args, **kwargs)
        marks.mark("init_process_group")
        return result

    torch.distributed.init_process_group = init_process_group  # the script imports it after this

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if "first_step" not in marks.times:
            marks.mark("first_step")
            marks.save()

    register_optimizer_step_post_hook(after_step)
    logger = logging.getLogger("ps_worker.startup")
    logger.addHandler(StartupLines(marks))
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # the script's own logging configuration never shows these lines


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: first_step_runner.py SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    where = os.environ.get("FIRST_STEP_DIR", "")
    marks = Marks(os.path.join(where, f"rank-{os.environ.get('RANK', '0')}.json")) if where else None
    if marks is not None:
        instrument(marks)
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if marks is not None:
            marks.mark("exit")
            marks.save()


if __name__ == "__main__":
    main()
