"""Command-line flags with ``PS_*`` environment twins, defined in one place for every command.

``--num-workers`` has the twin ``PS_NUM_WORKERS``; a flag on the command line wins over its twin,
and the twin wins over the default. ``--help`` shows each twin.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

from ps_common import modes

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    """``--num-workers`` -> ``PS_NUM_WORKERS``."""
    return "PS_" + flag.lstrip("-").upper().replace("-", "_")


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose :meth:`flag` adds an option with a ``PS_*`` twin.

    Args:
        environ: where twins are read (``os.environ`` by default; injected in tests).
    """

    def __init__(self, *args: Any, environ: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self.environ = os.environ if environ is None else environ
        self.twins: list[tuple[str, str, str]] = []  # (flag, env, help) for the README table

    def flag(
        self,
        name: str,
        *,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str,
        required: bool = False,
        choices: Any = None,
        switch: bool = False,
        env: str | None = None,
    ) -> None:
        """Add ``name`` with its twin. ``switch=True`` makes a boolean ``store_true`` flag whose
        twin takes 1/0, true/false, yes/no, on/off. ``env`` names the twin when :func:`env_name`'s
        would clash with another command's twin of a different meaning.

        Raises:
            SystemExit: through ``self.error`` when the twin's value does not parse.
        """
        env = env or env_name(name)
        raw = self.environ.get(env)
        if raw is not None:
            if switch:
                if raw.strip().lower() not in TRUE | FALSE:
                    self.error(f"{env}={raw!r} is not a boolean; use 1 or 0.")
                default = raw.strip().lower() in TRUE
            else:
                try:
                    default = type(raw)
                except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                    self.error(f"{env}={raw!r} is invalid for {name}: {exc}")
                if choices is not None and default not in choices:
                    self.error(f"{env}={raw!r} is invalid for {name}; choose from {', '.join(map(str, choices))}.")
            required = False
        self.twins.append((name, env, help))
        text = f"{help} [env {env}]"
        if switch:
            self.add_argument(name, action="store_true", default=bool(default), help=text)
        else:
            self.add_argument(name, type=type, default=default, required=required, choices=choices, help=text)


def secret_help(what: str, env: str) -> str:
    """The help of a flag that takes a secret inline: ``what`` it is, and that a command line is
    visible to every user of the machine, so ``env``_FILE or ``env`` (the environment) is better."""
    return (
        f"{what}. On the command line it is visible to every user of this machine (/proc/PID/cmdline, ps): "
        f"prefer {env}_FILE (a file, e.g. a mounted Secret) or {env} in the environment"
    )


def secret(value: str, path: str, flag: str) -> str:
    """A token given inline (``value``) or as a file (``path``, e.g. a mounted Kubernetes Secret;
    surrounding whitespace is stripped).

    Raises:
        ValueError: both given, or the file cannot be read or is empty.
    """
    if not path:
        return value
    if value:
        raise ValueError(f"Give {flag} or {flag}-file, not both.")
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ValueError(f"{flag}-file {path!r} cannot be read: {exc.strerror}.") from exc
    if not token:
        raise ValueError(f"{flag}-file {path!r} is empty.")
    return token


# Flags shared by ps-server and ps-launch (which forwards them); here, not in ps_server.config, so
# that ps-launch's parser imports no torch.


def mode_flags(p: FlagParser) -> None:
    """The consistency-model flags (one per row of :data:`ps_common.modes.PARAMETERS`), shared by
    ``ps-server`` and ``ps-launch`` (which forwards them with :func:`ps_common.modes.forward_flags`)."""
    for m in modes.PARAMETERS:
        if m.switch:
            p.flag(m.flag, switch=True, help=m.help)
        else:
            p.flag(m.flag, type=m.type, default=m.default, choices=m.choices, help=m.help)


def join_timeout_flag(p: FlagParser) -> None:
    """``--join-timeout`` (``PS_JOIN_TIMEOUT``), shared by ``ps-server`` and ``ps-launch`` (which forwards it)."""
    p.flag(
        "--join-timeout",
        type=float,
        default=300.0,
        help="seconds after the first worker's Join that ranks which never joined are waited for; then the "
        "rounds and reads that need them fail, naming them (0: wait forever)",
    )


def otel_flag(p: FlagParser) -> None:
    """``--otel-endpoint`` (``PS_OTEL_ENDPOINT``) of ``ps-server``, ``ps-worker`` and ``ps-launch`` (which
    passes it down); :mod:`ps_common.tracing`."""
    p.flag(
        "--otel-endpoint",
        default="",
        help="OTLP collector to send OpenTelemetry traces to (http://HOST:4317); empty: tracing off unless the "
        "OTEL_* variables turn it on (docs/operations.md#tracing-opentelemetry). Needs grpc-ps[otel]",
    )
