"""Fault injection for ``ps-launch --fault``: kill a worker or a shard at a step, optionally restart it.

Syntax (several faults separated by ``;``)::

    kill-worker:R@step=N[,restart]   SIGKILL worker rank R when it reports step N
    kill-shard:K@step=N[,restart]    SIGKILL shard K when rank 0 reports step N

A restarted worker gets a new incarnation, rejoins and resumes at the cluster's clock; a
restarted shard is started with the same command and port (and resumes from its newest
checkpoint when the cluster checkpoints).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"^kill-(?P<what>worker|shard):(?P<index>\d+)@step=(?P<step>\d+)(?P<restart>,restart)?$")


@dataclass(frozen=True)
class Fault:
    """Kill ``what`` ("worker" or "shard") number ``index`` at ``step``; restart it if ``restart``."""

    what: str
    index: int
    step: int
    restart: bool = False

    @property
    def name(self) -> str:
        """The launcher's name of the target process, e.g. ``worker-1``."""
        return f"{self.what}-{self.index}"

    def due(self, rank: int, step: int) -> bool:
        """True when ``rank`` reporting ``step`` triggers this fault."""
        watched = self.index if self.what == "worker" else 0
        return rank == watched and step >= self.step

    def __str__(self) -> str:
        return f"kill-{self.what}:{self.index}@step={self.step}{',restart' if self.restart else ''}"


def parse_resizes(text: str) -> list[tuple[int, int]]:
    """Parse ps-launch's ``--resize`` text, ``N@step=S[;N@step=S...]``, into (step, workers) pairs
    in step order.

    Raises:
        ValueError: a malformed spec, N < 1, or two resizes at one step, saying the syntax.
    """
    out = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        n, _, step = spec.partition("@step=")
        if not (n.isdigit() and step.isdigit()) or int(n) < 1:
            raise ValueError(f"--resize {spec!r}: expected N@step=S with N >= 1 workers and a step S, e.g. 4@step=100.")
        out.append((int(step), int(n)))
    steps = [s for s, _ in out]
    if len(set(steps)) != len(steps):
        raise ValueError(f"--resize: two resizes at one step ({text!r}).")
    return sorted(out)


def parse_faults(text: str, shards: int, workers: int) -> list[Fault]:
    """Parse ``--fault`` text.

    Raises:
        ValueError: a malformed spec or an index outside the cluster, saying the syntax.
    """
    faults = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(
                f"Bad --fault {part!r}; expected kill-worker:R@step=N[,restart] or kill-shard:K@step=N[,restart]."
            )
        fault = Fault(m["what"], int(m["index"]), int(m["step"]), bool(m["restart"]))
        limit = workers if fault.what == "worker" else shards
        if fault.index >= limit:
            raise ValueError(f"--fault {part!r} names {fault.name}, but there are only {limit} {fault.what}s.")
        faults.append(fault)
    return faults
