"""Streaming DiLoCo's fragments (docs/architecture.md#5-consistency): which parameters an outer round carries.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication",
arXiv:2501.18512, section 2.2) splits the model into F fragments and synchronizes one fragment at a
time. Here the split is a pure function of the plan, so that workers and shards agree on it without
saying it: walking the plan's specs (parameters, then buffers, in declaration order), each goes
whole to the fragment holding the fewest bytes so far (ties: the lowest index) — the plan's own
least-loaded rule (:mod:`ps_common.plan`) applied to fragments, so every outer round moves about
1/F of the model's bytes. On a stack of equal layers it interleaves the layers across fragments
much as the paper's *strided* pattern does (its Figure 3: strided layer groups train better than
sequential blocks), and every tensor and its outer-optimizer state belong to one fragment. Outer
round ``t`` (the version it starts from) carries fragment ``t mod F``, so the shards know a round's
fragment from its clock. ``F = 1`` is plain DiLoCo: every round carries everything.
"""

from __future__ import annotations

from typing import Any

from ps_common.codec import itemsize
from ps_common.errors import InvalidRequestError
from ps_common.plan import Plan


def fragments_in_force(settings: Any) -> int:
    """F of a cluster's :class:`~ps_common.modes.ModeSettings`: its ``fragments`` in diloco, 1 in
    every other mode (their rounds carry everything)."""
    return max(1, settings.fragments) if settings.mode == "diloco" else 1


def assignment(plan: Plan, fragments: int) -> dict[str, int]:
    """key -> its fragment: each spec in plan order goes to the fragment with the fewest bytes so far
    (ties: the lowest index); all 0 when ``fragments`` <= 1."""
    loads = [0] * max(1, fragments)
    out: dict[str, int] = {}
    for s in plan.specs:
        f = loads.index(min(loads))
        out[s.key] = f
        loads[f] += s.numel * itemsize(s.dtype)
    return out


def fragment_keys(plan: Plan, fragments: int, fragment: int) -> frozenset[str]:
    """The keys of fragment ``fragment`` of ``fragments`` (:func:`assignment`; every key when ``fragments`` <= 1)."""
    return frozenset(k for k, f in assignment(plan, fragments).items() if f == fragment)


def round_fragment(round_: int, fragments: int) -> int:
    """The fragment outer round ``round_`` carries: ``round_ mod fragments``."""
    return round_ % max(1, fragments)


def owned_slots(plan: Plan, shard: int, fragments: int, round_: int) -> tuple[int, ...] | None:
    """Shard ``shard``'s partitions (indices into ``plan.owned_by(shard)``, ascending) that outer
    round ``round_`` carries; None when rounds carry everything (``fragments`` <= 1). A shard may own
    none of a fragment: ``()`` (it still takes part in the round, so versions stay in lock-step)."""
    if fragments <= 1:
        return None
    keys = fragment_keys(plan, fragments, round_fragment(round_, fragments))
    return tuple(i for i, p in enumerate(plan.owned_by(shard)) if p.key in keys)


def check_fragments(plan: Plan, fragments: int) -> None:
    """Raises InvalidRequestError when the plan has fewer parameters than ``fragments`` (a fragment
    would be empty everywhere)."""
    if fragments > len(plan.specs):
        raise InvalidRequestError(
            f"--fragments {fragments} is more than the model's {len(plan.specs)} parameters and buffers; "
            f"give at most {len(plan.specs)} (each fragment holds at least one parameter)."
        )
