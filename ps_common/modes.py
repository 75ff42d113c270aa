"""The consistency model in force and its parameters (docs/architecture.md#5-consistency): one table, every place.

:data:`PARAMETERS` has one row per mode parameter with every name it goes by (its attribute, its
flag, its ``ps.v1`` field) and its unit, modes, help text, parse and validate rules, and whether
``Admin/UpdateConfig`` may change it. From the table come: the flags of ``ps-server`` and
``ps-launch`` (:func:`ps_common.flags.mode_flags`), the validation of :class:`ModeSettings`, the
settings a shard's config and flags give (:func:`settings_of`), the ``ClusterConfig`` fields
(:func:`config_fields`), UpdateConfig's changes (:data:`UPDATABLE`, :func:`changes_from_request`),
``ps-admin set``'s flags and request (:func:`set_request_fields`), ``ps-admin``'s settings lines
(:func:`parameters_text`, :func:`parameters_json`) and ``ps-launch``'s forwarding of the flags to
every ``ps-server`` (:func:`forward_flags`). ``tests/unit/test_modes.py`` checks that every
row reaches every place.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ps_common.errors import InvalidRequestError
from ps_common.optimizer_args import DILOCO_OUTER_OPTIMIZER, outer_optimizer_json
from ps_common.text import quote

MODES = ("async", "diloco", "easgd", "ssp", "sync")

LOCAL_OPTIMIZER_MODES = frozenset({"diloco", "easgd"})
"""Modes whose workers step a local optimizer and exchange with the shards every few steps (their
own training loop): a cluster cannot switch into, out of or between them live."""

STALENESS_LR_RULES = ("", "inverse")

MAX_COUNT = 2**31 - 1
"""Largest staleness bound and communication period, in clocks and steps. A negative number sent in
a uint32 field arrives as 2**32 - n: far above it, refused instead of read as a huge bound."""

UINT32_MAX = 2**32 - 1
"""Largest value of a uint32 field of ps.proto."""


# ---------------------------------------------------------------------------------------- parse and validate rules
def uint32(text: str) -> int:
    """An integer in 0..2**32-1, what a uint32 field of ps.proto holds (``ps-admin`` flags).

    Raises:
        argparse.ArgumentTypeError: out of range (``ValueError``: not an integer).
    """
    value = int(text)
    if not 0 <= value <= UINT32_MAX:
        raise argparse.ArgumentTypeError(f"{text} is out of range; give an integer from 0 to {UINT32_MAX}")
    return value


def _count(flag: str, low: int, unit: str) -> Callable[[int, int], None]:
    def check(value: int, num_workers: int) -> None:
        if not low <= value <= MAX_COUNT:
            wrapped = f" ({value - 2**32} sent as an unsigned 32-bit integer?)" if 2**31 <= value < 2**32 else ""
            raise InvalidRequestError(f"{flag} must be in {low}..{MAX_COUNT} {unit}, got {value}{wrapped}.")

    return check


def _check_sync_quorum(value: int, num_workers: int) -> None:
    if not 0 <= value <= num_workers:
        raise InvalidRequestError(f"--sync-quorum must be in 0..{num_workers} (0 = every live rank), got {value}.")


def _check_round_timeout(value: float, num_workers: int) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise InvalidRequestError(f"--round-timeout must be >= 0 seconds, got {value}.")


def _check_max_staleness(value: int, num_workers: int) -> None:
    if value < -1:
        raise InvalidRequestError(f"--max-staleness must be >= 0 (or -1 for no bound), got {value}.")


def _check_staleness_lr(value: str, num_workers: int) -> None:
    if value not in STALENESS_LR_RULES:
        raise InvalidRequestError(f"--staleness-lr must be 'inverse' or empty, got {quote(value)}.")


def _check_moving_rate(value: float | None, num_workers: int) -> None:
    if value is not None and not (0 < value <= 1):
        raise InvalidRequestError(f"--moving-rate must be in (0, 1], got {value}.")


def _check_outer_optimizer(value: str, num_workers: int) -> None:
    outer_optimizer_json(value)


def _any(value: Any, num_workers: int) -> None:
    """Every value is valid (a switch)."""


def seconds(value: float) -> str:
    """``0`` -> ``off``; ``2.5`` -> ``2.5s``."""
    return "off" if value <= 0 else f"{value:g}s"


# ---------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Parameter:
    """One mode parameter and every name it goes by.

    Attributes:
        name: attribute of :class:`ModeSettings` and ``ServerConfig``, and the ``dest`` of ``flag``.
        flag: the flag of ``ps-server``, ``ps-launch`` and ``ps-admin set`` (twin ``PS_<FLAG>``,
            ``PS_SET_<FLAG>`` for ``set``).
        field: the field of ``ps.v1.ClusterConfig`` (and of ``UpdateConfigRequest`` when
            ``updatable``); also the key of ``ps-admin status --json``'s ``mode_parameters``.
        unit: what the value counts ("" for a rule or a fraction).
        modes: the modes it applies to.
        help: help of ``ps-server`` and ``ps-launch`` (the README's flags table).
        check: ``check(value, num_workers)`` raises InvalidRequestError, in a full sentence.
        show: ``show(value, num_workers)``, the value for people (``ps-admin`` settings lines).
        type, default, choices, switch: how ``ps-server`` and ``ps-launch`` parse ``flag``.
        updatable: ``Admin/UpdateConfig`` (``ps-admin set``) may change it live.
        set_help, set_type, set_choices: ``ps-admin set``'s ``flag`` (its help gets ``set: ``).
        to_request: ``ps-admin set``'s value -> the UpdateConfigRequest field's.
        joiner: text put before :attr:`show`'s in a settings line after the mode's first parameter.
    """

    name: str
    flag: str
    field: str
    unit: str
    modes: tuple[str, ...]
    help: str
    check: Callable[[Any, int], None]
    show: Callable[[Any, int], str]
    type: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    updatable: bool = False
    set_help: str = ""
    set_type: Callable[[str], Any] = str
    set_choices: tuple[str, ...] | None = None
    to_request: Callable[[Any], Any] = lambda value: value
    joiner: str = ", "


# fmt: off
PARAMETERS: tuple[Parameter, ...] = (
    Parameter(
        "sync_quorum", "--sync-quorum", "sync_quorum", "ranks", ("sync",),
        "sync: apply a round after the first K pushes, drop late ones (0 = every live rank)",
        _check_sync_quorum,
        lambda v, n: f"quorum {'all' if v == 0 else f'{v} of {n}'}",
        type=int, default=0, updatable=True,
        set_help="(sync) apply a round after the first K pushes (0 = every live rank)", set_type=uint32,
    ),
    Parameter(
        "round_timeout", "--round-timeout", "round_timeout_seconds", "seconds", ("sync", "diloco"),
        "sync, diloco: seconds after which ranks missing from an open round are reported (0 = never)",
        _check_round_timeout,
        lambda v, n: f"round timeout {seconds(v)}",
        type=float, default=0.0, updatable=True,
        set_help="(sync) seconds until ranks missing from a round are reported (0 = never)", set_type=float,
    ),
    Parameter(
        "max_staleness", "--max-staleness", "max_staleness", "versions", ("async",),
        "async: refuse gradients more than S versions old with ABORTED (-1 = no bound)",
        _check_max_staleness,
        lambda v, n: f"max staleness {'none' if v < 0 else v}",
        type=int, default=-1, updatable=True,
        set_help="(async) refuse gradients more than S versions old (-1 = no bound)", set_type=int,
    ),
    Parameter(
        "staleness_lr", "--staleness-lr", "staleness_lr", "", ("async",),
        "async: 'inverse' scales the learning rate by 1/max(1, staleness)",
        _check_staleness_lr,
        lambda v, n: f"staleness lr {v or 'constant'}",
        default="", choices=STALENESS_LR_RULES, updatable=True,
        set_help="(async) 'inverse' scales the lr by 1/max(1, staleness); 'none' does not",
        set_choices=("inverse", "none"), to_request=lambda v: "" if v == "none" else v,
    ),
    Parameter(
        "staleness", "--staleness", "staleness", "clocks", ("ssp",),
        "ssp: the staleness bound s in clocks",
        _count("--staleness", 0, "clocks"),
        lambda v, n: f"staleness {v} clock{'' if v == 1 else 's'}",  # clocks (a rank's pushes), not versions
        type=int, default=0, updatable=True,
        set_help="(ssp) the staleness bound s in clocks", set_type=uint32,
    ),
    Parameter(
        "moving_rate", "--moving-rate", "moving_rate", "", ("easgd",),
        "easgd: moving rate alpha (default 0.9/num_workers)",
        _check_moving_rate,
        lambda v, n: f"moving rate {v:g}",
        type=float, default=None, updatable=True,
        set_help="(easgd) the moving rate alpha, in (0, 1]", set_type=float,
    ),
    Parameter(
        "communication_period", "--communication-period", "communication_period", "steps", ("easgd", "diloco"),
        "easgd: local steps tau between exchanges; diloco: inner steps H between outer rounds",
        _count("--communication-period", 1, "steps"),
        lambda v, n: f"period {v}",
        type=int, default=10, updatable=True,
        set_help="(easgd, diloco) local steps between exchanges (tau) or outer rounds (H)", set_type=uint32,
    ),
    Parameter(
        "easgd_sync", "--easgd-sync", "easgd_sync", "", ("easgd",),
        "easgd: apply one period's exchanges together in rank order",
        _any,
        lambda v, n: "(rounds)" if v else "(async)",
        default=False, switch=True, joiner=" ",
    ),
    Parameter(
        "outer_optimizer", "--outer-optimizer", "outer_optimizer", "", ("diloco",),
        "diloco: the shards' outer optimizer as JSON (FedAvg: '{\"name\": \"sgd\", \"lr\": 1.0}'); "
        "the workers' own optimizer takes the inner steps",
        _check_outer_optimizer,
        lambda v, n: f"outer {v}",
        default=DILOCO_OUTER_OPTIMIZER,
    ),
    Parameter(
        "fragments", "--fragments", "fragments", "fragments", ("diloco",),
        "diloco: Streaming DiLoCo's F: each outer round, every H/F inner steps, carries one of F fragments "
        "of the parameters in turn (1 = every round carries everything; 1 <= F <= H)",
        _count("--fragments", 1, "fragments"),
        lambda v, n: f"{v} fragment{'' if v == 1 else 's'}",
        type=int, default=1, updatable=True,
        set_help="(diloco) Streaming DiLoCo's fragments F, 1 <= F <= H", set_type=uint32,
    ),
)
# fmt: on
"""Every mode parameter, in the order of the flags, the checks and the settings lines."""

UPDATABLE: tuple[Parameter, ...] = tuple(p for p in PARAMETERS if p.updatable)
"""The parameters ``Admin/UpdateConfig`` changes live (besides the learning rate and the mode)."""

DEFAULT_MOVING_RATE_NUMERATOR = 0.9
"""EASGD's default moving rate is this over num_workers (Zhang et al. 2015, section 5: beta = 0.9)."""


# ---------------------------------------------------------------------------------------- settings in force
@dataclass(frozen=True)
class ModeSettings:
    """Mode and parameters of a cluster; the fields after ``num_workers`` are :data:`PARAMETERS`'s.

    Attributes:
        mode: one of :data:`MODES`.
        num_workers: ranks in the cluster (for defaults and bounds).
        sync_quorum: sync: close a round after the first K pushes; 0 means every live rank.
        round_timeout: sync: seconds after which missing ranks of an open round are reported; 0 = never.
        max_staleness: async: refuse gradients more than S versions old; -1 = no bound.
        staleness_lr: async: "inverse" scales the learning rate by 1/max(1, staleness).
        staleness: ssp: the bound s in clocks.
        moving_rate: easgd: alpha, in (0, 1]; None given at construction takes 0.9 / num_workers
            (Zhang et al. 2015, section 5), so the attribute always holds the rate in force.
        communication_period: easgd: tau, local steps between exchanges; diloco: H, inner steps
            between outer rounds.
        easgd_sync: easgd: apply one period's exchanges together in rank order.
        outer_optimizer: diloco: the outer optimizer's JSON spec (:func:`outer_optimizer_json`; "" given
            at construction takes DiLoCo's).
        fragments: diloco: F, the fragments outer rounds carry in turn (:mod:`ps_common.fragments`).

    Raises:
        InvalidRequestError: a value out of range, in a full sentence.
    """

    mode: str = "sync"
    num_workers: int = 1
    sync_quorum: int = 0
    round_timeout: float = 0.0
    max_staleness: int = -1
    staleness_lr: str = ""
    staleness: int = 0
    moving_rate: float = None  # type: ignore[assignment]  # None: 0.9 / num_workers, set in __post_init__
    communication_period: int = 10
    easgd_sync: bool = False
    outer_optimizer: str = DILOCO_OUTER_OPTIMIZER
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidRequestError(f"Unknown mode {quote(self.mode)}; expected one of {', '.join(MODES)}.")
        if not self.outer_optimizer:  # a ClusterConfig of a shard without diloco
            object.__setattr__(self, "outer_optimizer", DILOCO_OUTER_OPTIMIZER)
        for p in PARAMETERS:
            p.check(getattr(self, p.name), self.num_workers)
        if self.moving_rate is None:
            object.__setattr__(self, "moving_rate", DEFAULT_MOVING_RATE_NUMERATOR / self.num_workers)
        if self.mode == "diloco" and self.fragments > self.communication_period:
            raise InvalidRequestError(
                f"--fragments {self.fragments} is more than --communication-period {self.communication_period}: an "
                "outer round every H/F inner steps needs F <= H; give fewer fragments or a longer period."
            )

    def updated(self, **changes: Any) -> ModeSettings:
        """A copy with ``changes`` (attribute -> value) applied and validated.

        Raises:
            InvalidRequestError: an invalid value, or a switch into, out of or between easgd and
                diloco (workers run a different loop there; restart the cluster instead).
        """
        new = dataclasses.replace(self, **changes)
        if new.mode != self.mode and {new.mode, self.mode} & LOCAL_OPTIMIZER_MODES:
            raise InvalidRequestError(
                f"Cannot switch from {self.mode} to {new.mode} live: easgd and diloco workers run local "
                "optimizers in a loop of their own; restart the cluster with the new --mode."
            )
        return new


# ---------------------------------------------------------------------------------------- the places
def settings_of(source: Any) -> dict[str, Any]:
    """Every parameter of ``source`` (parsed flags, a ``ServerConfig``) by attribute name, to pass
    to :class:`ModeSettings` or ``ServerConfig``."""
    return {p.name: getattr(source, p.name) for p in PARAMETERS}


def config_fields(settings: ModeSettings) -> dict[str, Any]:
    """The ``ps.v1.ClusterConfig`` fields of ``settings``' parameters (the moving rate in force)."""
    return {p.field: getattr(settings, p.name) for p in PARAMETERS}


def changes_from_request(request: Any) -> dict[str, Any]:
    """The parameters an ``UpdateConfigRequest`` sets (fields left unset keep their value), by
    attribute name, for :meth:`ModeSettings.updated`."""
    return {p.name: getattr(request, p.field) for p in UPDATABLE if request.HasField(p.field)}


def request_fields(changes: dict[str, Any]) -> dict[str, Any]:
    """:meth:`ModeSettings.updated`'s changes (by attribute name) as ``UpdateConfigRequest`` fields."""
    by_name = {p.name: p for p in UPDATABLE}
    return {by_name[name].field: value for name, value in changes.items()}


def set_request_fields(args: Any) -> dict[str, Any]:
    """``ps-admin set``'s parsed flags -> UpdateConfigRequest fields, for the flags given (None: not given)."""
    return {p.field: p.to_request(getattr(args, p.name)) for p in UPDATABLE if getattr(args, p.name) is not None}


def forward_flags(args: Any) -> list[str]:
    """``ps-launch``'s parsed mode flags as ``ps-server`` arguments (a switch only when on, a
    parameter left to its default (None) not at all)."""
    argv: list[str] = []
    for p in PARAMETERS:
        value = getattr(args, p.name)
        if p.switch:
            argv += [p.flag] if value else []
        elif value is not None:
            argv += [p.flag, str(value)]
    return argv


def of_mode(mode: str) -> tuple[Parameter, ...]:
    """The parameters of ``mode``, in table order (none for an unknown mode)."""
    return tuple(p for p in PARAMETERS if mode in p.modes)


def parameters_json(config: Any, mode: str) -> dict[str, Any]:
    """The parameters of ``mode`` in a ``ClusterConfig``, by field name (``ps-admin status --json``)."""
    return {p.field: getattr(config, p.field) for p in of_mode(mode)}


def parameters_text(config: Any, mode: str) -> str:
    """The parameters of ``mode`` in a ``ClusterConfig`` for people: ``quorum all, round timeout off``
    (``?`` for an unknown mode)."""
    shown = [(p.joiner, p.show(getattr(config, p.field), config.num_workers)) for p in of_mode(mode)]
    return "".join(text if i == 0 else joiner + text for i, (joiner, text) in enumerate(shown)) or "?"


def settings_from_config(mode: str, config: Any) -> ModeSettings:
    """The settings a shard announced in a ``ps.v1.ClusterConfig`` (Join, each push's answer), read
    through :data:`PARAMETERS` (an unset moving rate means the default 0.9/num_workers; a period
    below 1 step is 1).

    Raises:
        InvalidRequestError: the shard sent values out of range.
    """
    values = {p.name: getattr(config, p.field) for p in PARAMETERS}
    values["moving_rate"] = values["moving_rate"] or None
    values["communication_period"] = max(1, values["communication_period"])
    values["fragments"] = max(1, values["fragments"])  # a shard that predates the field
    return ModeSettings(mode=mode, num_workers=max(1, config.num_workers, config.sync_quorum), **values)
