"""Where diloco's outer rounds fall in inner steps (docs/architecture.md#5-consistency), on both sides.

Outer round ``v`` (the version it starts from) takes ``H // F`` inner steps, with the H
(``--communication-period``) and F (``--fragments``) in force at ``v``: the cluster's settings, or
the newest live change (``ps-admin set``) scheduled at a version ``<= v`` — a change sets absolute
values, so the changes a membership record carries, applied in order over any settings, give the
values in force. Positions are counted, never recomputed from today's H: when shard 0 schedules a
change it stamps it with the inner step its version starts at (``ConfigChange.inner_step``), and
the inner step of round ``v`` is then that of the newest change at or before ``v`` plus
``(v - its version) * H // F`` — so a rank that restarts after H changed resumes at the inner step
the other ranks are at, and the ranks end together, on one model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def in_force(settings: Any, changes: Sequence[Any], version: int, field: str) -> int:
    """``field`` (``communication_period`` or ``fragments``) in force at ``version``, >= 1.

    Args:
        settings: a :class:`~ps_common.modes.ModeSettings` (the shards' settings when the worker
            joined, or a shard's own).
        changes: ``ps.v1.ConfigChange``s in the order they were scheduled (a membership record's).
        version: the outer round asked about.
    """
    value = getattr(settings, field)
    for change in changes:
        if change.version <= version and change.update.HasField(field):
            value = getattr(change.update, field)
    return max(1, int(value))


def round_steps(settings: Any, changes: Sequence[Any], version: int) -> int:
    """Inner steps of outer round ``version``: ``H // F`` in force then (F is 1 outside diloco), >= 1."""
    fragments = in_force(settings, changes, version, "fragments") if settings.mode == "diloco" else 1
    return max(1, in_force(settings, changes, version, "communication_period") // fragments)


def inner_step(settings: Any, changes: Sequence[Any], version: int) -> int:
    """The inner step at which outer round ``version`` starts: counted from the newest change at or
    before it that carries ``inner_step`` (from round 0 when none does), each stretch between
    changes at its own ``H // F``."""
    origin, step = 0, 0
    for change in changes:
        if change.version <= version and change.HasField("inner_step") and change.version >= origin:
            origin, step = int(change.version), int(change.inner_step)
    bounds = sorted({int(c.version) for c in changes if origin < c.version <= version} | {version})
    for end in bounds:
        step += (end - origin) * round_steps(settings, changes, origin)
        origin = end
    return step
