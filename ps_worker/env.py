"""The environment contract of a worker: the ``PS_*`` variables a user's training script reads.

``ps-launch train.py``, the compose file and the Kubernetes manifests start a script with these set;
:func:`init_from_env` (or ``PSClient.from_env``) reads them and returns a joined client. The names are
the ``ps-worker`` flags' twins (``--num-workers`` -> ``PS_NUM_WORKERS``, see ``ps_common.flags``), so a
script and ``ps-worker`` run from the same environment. Rank: ``ps-launch`` numbers its copies 0..N-1;
compose services ``worker-R`` set ``PS_RANK: "R"``; a Kubernetes StatefulSet sets it from the label
``apps.kubernetes.io/pod-index``.

Like dmlc/ps-lite's ``docs/env.md``, every variable is in one table, :data:`CONTRACT`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ps_common.channels import parse_servers
from ps_common.dataconn import DATA_PATHS
from ps_common.flags import secret

if TYPE_CHECKING:
    import torch


class Client(Protocol):
    """What this module needs of a client class's instances (:class:`~ps_worker.client.PSClient`)."""

    def init(self, model: torch.nn.Module, optimizer: Mapping[str, Any] | None = None) -> None: ...

    def close(self) -> None: ...


C = TypeVar("C", bound=Client)

WIRE_DTYPES = ("native", "bfloat16", "float16")
OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop")


@dataclass(frozen=True)
class Variable:
    """One variable of the contract."""

    name: str
    default: str | None
    """None: required."""
    meaning: str


CONTRACT: tuple[Variable, ...] = (
    Variable("PS_SERVERS", None, "HOST:PORT of every shard, comma-separated, in shard-index order"),
    Variable("PS_RANK", None, "this worker's rank, 0..PS_NUM_WORKERS-1"),
    Variable("PS_NUM_WORKERS", None, "number of worker ranks of the job"),
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
    Variable("PS_TIMEOUT", "60", "per-RPC deadline, seconds (a sync pull waits this long)"),
    Variable("PS_RETRY_DEADLINE", "30", "seconds to keep retrying an unreachable shard"),
    Variable("PS_INCARNATION", "", "restart counter of this rank (default: wall-clock microseconds)"),
    Variable("PS_STEPS", "300", "total optimizer steps of the job per rank (a resumed job counts from 0)"),
    Variable("PS_BATCH_SIZE", "32", "samples per step on this worker"),
    Variable("PS_OPTIMIZER", "sgd", "server-side optimizer: sgd, adam, adamw, adagrad, rmsprop"),
    Variable("PS_LR", "0.1", "learning rate"),
    Variable("PS_MOMENTUM", "0.9", "momentum (sgd, rmsprop)"),
    Variable("PS_SEED", "0", "seed of model initialization and data shuffling (same on every rank)"),
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
    retry_deadline: float = 30.0
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
        import os

        environ = os.environ
    try:
        servers = tuple(parse_servers(_get(environ, "PS_SERVERS"), "PS_SERVERS"))
    except EnvError:
        raise
    except ValueError as exc:
        raise EnvError(str(exc)) from None
    num_workers = _number(environ, "PS_NUM_WORKERS", int, 1)
    rank = _number(environ, "PS_RANK", int, 0)
    if rank >= num_workers:
        raise EnvError(
            f"PS_RANK={rank} is outside 0..{num_workers - 1} (PS_NUM_WORKERS={num_workers}); "
            "give each worker its own rank below PS_NUM_WORKERS."
        )
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
    optimizer: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    client_class: type[C],
    **overrides: Any,
) -> C:
    """A client of the cluster the environment names, joined with ``model`` when one is given.

    Args:
        model: passed to ``PSClient.init`` (rank 0 writes its values; every rank then pulls them);
            None: the client is returned not yet joined.
        optimizer: the server-side optimizer spec; default: ``PS_OPTIMIZER``/``PS_LR``/``PS_MOMENTUM``.
        environ: where the contract is read (``os.environ`` by default).
        client_class: ``PSClient`` or a subclass (``PSClient.from_env`` and ``ps_worker.init_from_env``
            pass ``PSClient``).
        overrides: ``PSClient`` keyword arguments that win over the environment.

    Raises:
        EnvError: see :func:`read_env`.
        grpc.RpcError, TimeoutError: from ``PSClient.init``.
    """
    settings = read_env(environ)
    client = settings.client(client_class, **overrides)
    if model is not None:
        try:
            client.init(model, dict(optimizer) if optimizer is not None else settings.optimizer_spec())
        except BaseException:
            client.close()
            raise
    return client
