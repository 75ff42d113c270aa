"""The worker images' entry point: run the user's training script or module, or a built-in workload.

``docker run grpc-ps-worker ARGS...`` runs ``python -m ps_worker.entrypoint ARGS...``, which
replaces itself (``exec``, so signals and the exit status are the program's own) with:

=========================================  =============================================
arguments after the image / environment    runs
=========================================  =============================================
``train.py [args]`` (any ``*.py``)          ``python train.py [args]``
``-m pkg.mod [args]``                       ``python -m pkg.mod [args]``
``[args]`` with ``PS_MODULE=pkg.mod``       ``python -m pkg.mod [args]``
``[args]`` with ``PS_SCRIPT=/path/x.py``    ``python /path/x.py [args]``
anything else (``digits``, flags, none)     ``ps-worker [args]`` (``PS_WORKLOAD``, as before)
=========================================  =============================================

Arguments win over the environment, as flags win over their ``PS_*`` twins. The environment is
passed on: the script reads the contract (``PS_SERVERS``, ``PS_RANK``, ``PS_NUM_WORKERS``,
``PS_TOKEN``, ...) that compose and the k8s manifests set for ``ps-worker``, plus torchrun's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` where unset (:func:`torchrun_variables`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

USAGE = (
    "usage: grpc-ps-worker [SCRIPT.py [ARGS...] | -m MODULE [ARGS...] | WORKLOAD [ps-worker flags...]]\n"
    "  or set PS_SCRIPT=/path/train.py or PS_MODULE=pkg.mod; with neither, ps-worker runs (PS_WORKLOAD)."
)


class UsageError(ValueError):
    """The arguments name no program to run (``-m`` without a module, an empty ``PS_SCRIPT``...)."""


def resolve(argv: Sequence[str], environ: Mapping[str, str], python: str = sys.executable) -> list[str]:
    """The command line the container runs, from the arguments after the image and the environment.

    Args:
        argv: the arguments after the image name (``sys.argv[1:]``).
        environ: where ``PS_SCRIPT`` and ``PS_MODULE`` are read.
        python: the interpreter that runs a script or module (this one: grpc-ps is installed in it).

    Returns:
        The argv to ``exec``: ``[python, script, *args]``, ``[python, "-m", module, *args]`` or
        ``["ps-worker", *args]``.

    Raises:
        UsageError: ``-m`` without a module, or both ``PS_SCRIPT`` and ``PS_MODULE`` set.
    """
    args = list(argv)
    if args[:1] == ["-m"]:
        if len(args) < 2 or not args[1] or args[1].startswith("-"):
            raise UsageError("-m needs a module name, e.g. -m mypackage.train")
        return [python, "-m", args[1], *args[2:]]
    if args and args[0].endswith(".py") and not args[0].startswith("-"):
        return [python, args[0], *args[1:]]
    script, module = environ.get("PS_SCRIPT", "").strip(), environ.get("PS_MODULE", "").strip()
    if script and module:
        raise UsageError(f"PS_SCRIPT={script} and PS_MODULE={module} are both set; set one of them.")
    if module:
        return [python, "-m", module, *args]
    if script:
        return [python, script, *args]
    return ["ps-worker", *args]


def torchrun_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables that ``environ`` lacks, from ``PS_RANK``/``PS_NUM_WORKERS`` (one worker
    per container: ``LOCAL_RANK`` 0 of ``LOCAL_WORLD_SIZE`` 1); none when those are unset."""
    rank, workers = environ.get("PS_RANK", "").strip(), environ.get("PS_NUM_WORKERS", "").strip()
    if not rank or not workers:
        return {}
    twins = {"RANK": rank, "WORLD_SIZE": workers, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    return {k: v for k, v in twins.items() if k not in environ}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``exec`` what :func:`resolve` says; returns only on a usage error (exit 2) or
    when the program cannot be started (exit 127)."""
    try:
        command = resolve(sys.argv[1:] if argv is None else argv, os.environ)
    except UsageError as exc:
        print(f"grpc-ps-worker: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    if command[0] != "ps-worker" and command[1] != "-m" and not os.path.isfile(command[1]):
        print(
            f"grpc-ps-worker: no script {command[1]!r} in the image (COPY it in, or mount it)\n{USAGE}", file=sys.stderr
        )
        return 2
    os.environ.update(torchrun_variables(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"grpc-ps-worker: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
