"""The environment contract of a worker: the ``PS_*`` variables a user's training script reads.

``ps-launch train.py``, the compose file and the Kubernetes manifests start a script with these set;
:func:`init_from_env` (or ``PSClient.from_env``) reads them and returns a joined client. The names are
the ``ps-worker`` flags' twins (``--num-workers`` -> ``PS_NUM_WORKERS``, see ``ps_common.flags``), so a
script and ``ps-worker`` run from the same environment. Rank: ``ps-launch`` numbers its copies 0..N-1;
compose services ``worker-R`` set ``PS_RANK: "R"``; a Kubernetes StatefulSet sets it from the label
``apps.kubernetes.io/pod-index``. torchrun's ``RANK`` and ``WORLD_SIZE`` stand in for ``PS_RANK`` and
``PS_NUM_WORKERS`` when those are unset (:func:`rank_and_workers`). With no ``PS_SERVERS`` and no job of
more than one worker in the environment, :func:`init_from_env` runs a single-process job on a shard of its
own (:mod:`ps_worker.embedded`).

Like dmlc/ps-lite's ``docs/env.md``, every variable is in one table, :data:`CONTRACT`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ps_common import tracing
from ps_common.channels import parse_servers
from ps_common.dataconn import DATA_PATHS
from ps_common.errors import InvalidRequestError
from ps_common.flags import secret
from ps_common.optimizer_args import OPTIMIZER_NAMES

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
startup = logging.getLogger("ps_worker.startup")
"""Start-up moments at DEBUG level (``start-up: NAME ...``; ``bench/first_step.py`` reads them)."""


class Client(Protocol):
    """What this module needs of a client class's instances (:class:`~ps_worker.client.PSClient`)."""

    def init(self, model: torch.nn.Module, optimizer: Any = None) -> None: ...

    def close(self) -> None: ...


C = TypeVar("C", bound=Client)

WIRE_DTYPES = ("native", "bfloat16", "float16")
OPTIMIZERS = OPTIMIZER_NAMES


@dataclass(frozen=True)
class Variable:
    """One variable of the contract."""

    name: str
    default: str | None
    """None: required."""
    meaning: str


CONTRACT: tuple[Variable, ...] = (
    Variable("PS_SERVERS", None, "HOST:PORT of every shard, comma-separated, in shard-index order"),
    Variable("PS_RANK", None, "this worker's rank, 0..PS_NUM_WORKERS-1 (or torchrun's RANK)"),
    Variable("PS_NUM_WORKERS", None, "number of worker ranks of the job (or torchrun's WORLD_SIZE)"),
    Variable("PS_TOKEN", "", "bearer token of ParameterService (or PS_TOKEN_FILE)"),
    Variable("PS_TOKEN_FILE", "", "file holding the bearer token (a mounted Secret)"),
    Variable("PS_TLS_CA", "", "PEM CA of the shards' certificates: connect with TLS"),
    Variable("PS_TLS_CERT", "", "PEM client certificate for mutual TLS (with PS_TLS_KEY)"),
    Variable("PS_TLS_KEY", "", "PEM private key of PS_TLS_CERT"),
    Variable("PS_WIRE_DTYPE", "native", "gradients and weights on the wire: native, bfloat16 or float16"),
    Variable("PS_TOPK", "0", "fraction of each gradient partition pushed (error feedback); 0: dense"),
    Variable(
        "PS_DATA_PATH",
        "tcp",
        "PushPull's partitions and small PushPullOnce calls: tcp (the shards' data connections when offered) or grpc",
    ),
    Variable("PS_TIMEOUT", "60", "per-RPC deadline, seconds (bounds a call, not a slow peer)"),
    Variable(
        "PS_RETRY_DEADLINE", "120", "seconds to keep retrying an unreachable shard (a shard restarting under load)"
    ),
    Variable("PS_WAIT_TIMEOUT", "1800", "seconds a wait for other ranks alive may last (0: no bound)"),
    Variable("PS_INCARNATION", "", "restart counter of this rank (default: wall-clock microseconds)"),
    Variable("PS_STEPS", "300", "total optimizer steps of the job per rank (a resumed job counts from 0)"),
    Variable("PS_BATCH_SIZE", "32", "samples per step on this worker"),
    Variable("PS_OPTIMIZER", "sgd", f"server-side optimizer: {', '.join(OPTIMIZER_NAMES)}"),
    Variable("PS_LR", "0.1", "learning rate"),
    Variable("PS_MOMENTUM", "0.9", "momentum (sgd, rmsprop)"),
    Variable("PS_SEED", "0", "seed of model initialization and data shuffling (same on every rank)"),
    Variable("PS_TENSORBOARD", "", "directory of TensorBoard curves, one run per rank (DIR/rank-R); empty: none"),
    Variable("PS_TENSORBOARD_EVERY", "10", "steps between two TensorBoard points"),
)
"""Every variable: name, default (None: required) and meaning. The README's table is this one."""

DEFAULTS = {v.name: v.default for v in CONTRACT}
WHO_SETS = "ps-launch, the compose file and the k8s manifests set it for you"


class EnvError(ValueError):
    """A contract variable is missing or invalid; the message names it, its value and what to set."""


def _get(environ: Mapping[str, str], name: str) -> str:
    raw = environ.get(name)
    if raw is None or (DEFAULTS[name] is None and not raw.strip()):
        if DEFAULTS[name] is None:
            meaning = next(v.meaning for v in CONTRACT if v.name == name)
            raise EnvError(f"{name} is not set: set it to {meaning} ({WHO_SETS}).")
        return DEFAULTS[name] or ""
    return raw.strip()


def _number(environ: Mapping[str, str], name: str, kind: type, low: float | None = None) -> Any:
    raw = _get(environ, name)
    try:
        value = kind(raw)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise EnvError(f"{name}={raw!r} is not {noun}; set {name} to {noun}.") from None
    if low is not None and not value >= low:  # also refuses nan
        raise EnvError(f"{name}={raw!r} must be >= {low}.")
    return value


def _choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    raw = _get(environ, name)
    if raw not in choices:
        raise EnvError(f"{name}={raw!r} is invalid; choose from {', '.join(choices)}.")
    return raw


TORCHRUN_TWINS = {"PS_RANK": "RANK", "PS_NUM_WORKERS": "WORLD_SIZE"}
"""torchrun's variable read when a ``PS_*`` one is unset (``ps-launch`` sets both)."""


def _with_twin(environ: Mapping[str, str], name: str, low: int) -> int | None:
    """``name`` (``PS_RANK``, ``PS_NUM_WORKERS``), else its torchrun twin; None when neither is set.
    Both set and different: ``name`` wins, with a warning."""
    twin = TORCHRUN_TWINS[name]
    mine, theirs = (environ.get(n, "").strip() for n in (name, twin))
    if not mine and not theirs:
        return None
    used, raw = (name, mine) if mine else (twin, theirs)
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(f"{used}={raw!r} is not an integer; set {used} to an integer.") from None
    if value < low:
        raise EnvError(f"{used}={raw!r} must be >= {low}.")
    if mine and theirs and theirs != mine:
        log.warning("%s=%s and %s=%s disagree; using %s=%s", name, mine, twin, theirs, name, mine)
    return value


def rank_and_workers(environ: Mapping[str, str], required: bool = False) -> tuple[int, int] | None:
    """This process's ``(rank, num_workers)`` from ``PS_RANK``/``PS_NUM_WORKERS``, each falling back to
    torchrun's ``RANK``/``WORLD_SIZE`` when unset (``PS_*`` win when both are set; a disagreement is
    logged as a warning).

    Args:
        environ: the variables (``os.environ`` or a mapping).
        required: raise when neither the rank nor the worker count is set; otherwise return None then.

    Returns:
        ``(rank, num_workers)`` with ``0 <= rank < num_workers``; None when neither is set (and not required).

    Raises:
        EnvError: one of the two set without the other, either not an integer or out of range, or
            (``required``) neither set; the message names the variable, its value and its twin.
    """
    num_workers = _with_twin(environ, "PS_NUM_WORKERS", 1)
    rank = _with_twin(environ, "PS_RANK", 0)
    if rank is None or num_workers is None:
        if not required and rank is None and num_workers is None:
            return None
        missing = "PS_RANK" if rank is None else "PS_NUM_WORKERS"
        meaning = next(v.meaning for v in CONTRACT if v.name == missing)
        raise EnvError(f"{missing} is not set: set it to {meaning} ({WHO_SETS}).")
    if rank >= num_workers:
        raise EnvError(
            f"PS_RANK={rank} is outside 0..{num_workers - 1} (PS_NUM_WORKERS={num_workers}); "
            "give each worker its own rank below PS_NUM_WORKERS (or RANK below WORLD_SIZE)."
        )
    return rank, num_workers


def tensorboard_settings(environ: Mapping[str, str]) -> tuple[str, int]:
    """``(PS_TENSORBOARD, PS_TENSORBOARD_EVERY)``: the directory of TensorBoard curves ("" for none)
    and the steps between two points (:class:`ps_worker.tensorboard.TrainingLog`).

    Raises:
        EnvError: ``PS_TENSORBOARD_EVERY`` is not an integer >= 1.
    """
    return _get(environ, "PS_TENSORBOARD"), _number(environ, "PS_TENSORBOARD_EVERY", int, 1)


_ddp_warned: list[bool] = []


def warn_if_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """Log a WARNING, once per process, when ``model`` is (or holds) a ``DistributedDataParallel``: its
    gradients would be all-reduced by the process group and then pushed to the shards, paying twice
    for one average. A process group beside grpc-ps is for metrics and barriers; gradients go through
    the shards. Returns ``model``."""
    from torch.nn.parallel import DistributedDataParallel

    if not _ddp_warned and any(isinstance(m, DistributedDataParallel) for m in model.modules()):
        _ddp_warned.append(True)
        log.warning(
            "The model is wrapped in DistributedDataParallel: grpc-ps already averages the gradients on the "
            "shards, so DDP's all-reduce doubles the traffic for nothing. Pass the bare model (ddp.module); keep the "
            "process group for metrics and barriers (dist.all_reduce, dist.barrier)."
        )
    return model


def single_process(environ: Mapping[str, str]) -> bool:
    """True when ``environ`` names no cluster: no ``PS_SERVERS``, and no job of more than one worker
    (``PS_NUM_WORKERS``/``WORLD_SIZE`` unset or 1). :func:`init_from_env` then starts a shard in this
    process (:mod:`ps_worker.embedded`) instead of failing. Invalid rank variables: False (not alone).
    """
    if environ.get("PS_SERVERS", "").strip():
        return False
    try:
        found = rank_and_workers(environ)
    except EnvError:  # half set or invalid: read_env names PS_SERVERS first, then this
        return False
    return found is None or found[1] == 1


@dataclass(frozen=True)
class Settings:
    """The contract, read and checked (see :data:`CONTRACT` for each field's variable)."""

    servers: tuple[str, ...]
    rank: int
    num_workers: int
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    wire_dtype: str = "native"
    topk: float = 0.0
    data_path: str = "tcp"
    timeout: float = 60.0
    retry_deadline: float = 120.0
    wait_timeout: float = 1800.0
    incarnation: int | None = None
    steps: int = 300
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    seed: int = 0

    def optimizer_spec(self) -> dict[str, float | str]:
        """The server-side optimizer spec of ``PS_OPTIMIZER``, ``PS_LR``, ``PS_MOMENTUM`` (what rank 0
        sends at Init; the same as ``ps-worker``'s)."""
        from ps_worker.workloads.flags import optimizer_spec

        return optimizer_spec(self.optimizer, self.lr, self.momentum)

    def client(self, client_class: type[C], **overrides: Any) -> C:
        """A ``client_class`` (:class:`~ps_worker.client.PSClient` or a subclass) with these settings
        (``overrides``: its keyword arguments, which win), not yet joined: call ``init(model, ...)`` next."""
        kwargs: dict[str, Any] = {
            "incarnation": self.incarnation,
            "token": self.token or None,
            "timeout": self.timeout,
            "retry_deadline": self.retry_deadline,
            "wait_timeout": self.wait_timeout,
            "tls_ca": self.tls_ca or None,
            "tls_cert": self.tls_cert or None,
            "tls_key": self.tls_key or None,
            "wire_dtype": None if self.wire_dtype == "native" else self.wire_dtype,
            "topk": self.topk,
            "data_path": self.data_path,
        }
        kwargs |= overrides
        servers = kwargs.pop("servers", list(self.servers))
        rank = kwargs.pop("rank", self.rank)
        num_workers = kwargs.pop("num_workers", self.num_workers)
        return client_class(servers, rank, num_workers, **kwargs)


def read_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Read and check the contract from ``environ`` (``os.environ`` by default).

    Raises:
        EnvError: a required variable (``PS_SERVERS``, ``PS_RANK``, ``PS_NUM_WORKERS``) is missing, or
            any variable is invalid (not a number, out of range, not a choice, an unreadable token
            file, a malformed address); the message names the variable and its value.
    """
    if environ is None:
        environ = os.environ
    try:
        servers = tuple(parse_servers(_get(environ, "PS_SERVERS"), "PS_SERVERS"))
    except EnvError:
        raise
    except ValueError as exc:
        raise EnvError(str(exc)) from None
    rank, num_workers = rank_and_workers(environ, required=True)
    try:
        token = secret(_get(environ, "PS_TOKEN"), _get(environ, "PS_TOKEN_FILE"), "PS_TOKEN")
    except ValueError as exc:
        raise EnvError(str(exc).replace("PS_TOKEN-file", "PS_TOKEN_FILE")) from None
    tls = {k: _get(environ, f"PS_TLS_{k.upper()}") for k in ("ca", "cert", "key")}
    if bool(tls["cert"]) != bool(tls["key"]):
        raise EnvError("PS_TLS_CERT and PS_TLS_KEY go together: set both for mutual TLS, or neither.")
    if tls["cert"] and not tls["ca"]:
        raise EnvError("PS_TLS_CERT needs PS_TLS_CA, the CA of the shards' certificates.")
    topk = _number(environ, "PS_TOPK", float, 0)
    if topk > 1:
        raise EnvError(f"PS_TOPK={topk:g} is not in [0, 1].")
    incarnation = _get(environ, "PS_INCARNATION")
    return Settings(
        servers=servers,
        rank=rank,
        num_workers=num_workers,
        token=token,
        tls_ca=tls["ca"],
        tls_cert=tls["cert"],
        tls_key=tls["key"],
        wire_dtype=_choice(environ, "PS_WIRE_DTYPE", WIRE_DTYPES),
        topk=topk,
        data_path=_choice(environ, "PS_DATA_PATH", DATA_PATHS),
        timeout=_number(environ, "PS_TIMEOUT", float, 0),
        retry_deadline=_number(environ, "PS_RETRY_DEADLINE", float, 0),
        wait_timeout=_number(environ, "PS_WAIT_TIMEOUT", float, 0),
        incarnation=_number(environ, "PS_INCARNATION", int, 0) if incarnation else None,
        steps=_number(environ, "PS_STEPS", int, 1),
        batch_size=_number(environ, "PS_BATCH_SIZE", int, 1),
        optimizer=_choice(environ, "PS_OPTIMIZER", OPTIMIZERS),
        lr=_number(environ, "PS_LR", float, 0),
        momentum=_number(environ, "PS_MOMENTUM", float, 0),
        seed=_number(environ, "PS_SEED", int),
    )


def init_from_env(
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    *,
    environ: Mapping[str, str] | None = None,
    client_class: type[C],
    **overrides: Any,
) -> C:
    """A client of the cluster the environment names, joined with ``model`` when one is given.

    Args:
        model: passed to ``PSClient.init`` (rank 0 writes its values; every rank then pulls them);
            None: the client is returned not yet joined.
        optimizer: a torch optimizer (or list) or a dict spec, as ``PSClient.init`` takes; default:
            ``PS_OPTIMIZER``/``PS_LR``/``PS_MOMENTUM`` (rank 0 says so on stderr when ``PS_OPTIMIZER``
            is unset too).
        environ: where the contract is read (``os.environ`` by default).
        client_class: ``PSClient`` or a subclass (``PSClient.from_env`` and ``ps_worker.init_from_env``
            pass ``PSClient``).
        overrides: ``PSClient`` keyword arguments that win over the environment.

    With no cluster in the environment (:func:`single_process`) and no ``servers`` override, the job is
    this process alone: a shard starts in it (:class:`ps_worker.embedded.EmbeddedShard`, said on stderr)
    and stops when the client closes, or at exit.

    Raises:
        EnvError: see :func:`read_env`; ``PS_MODE`` invalid for a single-process job.
        grpc.RpcError, TimeoutError: from ``PSClient.init``.
    """
    if environ is None:
        environ = os.environ
    startup.debug("start-up: from_env called")
    if not tracing.enabled():  # before a single-process job's shard: ps-launch --otel-endpoint sets PS_OTEL_ENDPOINT
        rank = (environ.get("PS_RANK") or environ.get("RANK") or "").strip()
        attributes = {"ps.rank": int(rank)} if rank.isdigit() else {}
        tracing.configure(environ.get("PS_OTEL_ENDPOINT", "").strip(), "ps-worker", attributes)
    shard = None
    if "servers" not in overrides and single_process(environ):
        from ps_worker.embedded import EmbeddedShard

        mode = environ.get("PS_MODE", "").strip() or "sync"  # ps-server's twin of --mode
        try:
            shard = EmbeddedShard.start(mode)
        except InvalidRequestError as exc:
            raise EnvError(f"PS_MODE={mode!r}: {exc}") from None
        environ = {**environ, **shard.environment()}
    try:
        settings = read_env(environ)
        client = settings.client(client_class, **overrides)
    except BaseException:
        if shard is not None:
            shard.stop()
        raise
    if shard is not None:
        shard.stop_with(client)
    if model is not None:
        if optimizer is None:
            optimizer = settings.optimizer_spec()
            if settings.rank == 0 and not environ.get("PS_OPTIMIZER", "").strip():
                log.warning(
                    "from_env(model) got no optimizer and PS_OPTIMIZER is unset: the shards run %s. Pass your own, "
                    "e.g. PSClient.from_env(model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4)), "
                    "or set PS_OPTIMIZER and PS_LR.",
                    " ".join(f"{k} {v}" for k, v in optimizer.items()),
                )
        try:
            client.init(model, dict(optimizer) if isinstance(optimizer, Mapping) else optimizer)
        except BaseException:
            client.close()
            raise
    return client
