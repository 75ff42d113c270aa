"""The shard's settings: one frozen, validated dataclass built from flags and their PS_* twins
(the flags: :mod:`ps_server.flags`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ps_common import modes
from ps_common.channels import is_loopback
from ps_common.errors import InvalidRequestError
from ps_common.flags import secret
from ps_common.modes import DILOCO_OUTER_OPTIMIZER, MODES, ModeSettings
from ps_server.core.limits import DEFAULT_MAX_PARAMETER_BYTES, Limits
from ps_server.flags import STREAM_ROUNDS, server_parser
from ps_server.service.rank_tokens import RankTokens, load_rank_tokens
from ps_server.service.waiting_calls import FIRST_MESSAGE_SECONDS, rank_share
from ps_server.tables.table import DEFAULT_MAX_TABLE_BYTES, DEFAULT_MAX_TABLE_ROWS

MAX_STREAMS = 1024
"""Upper bound of ``--max-watch-streams`` and ``--max-public-streams``."""
STREAM_REFUSAL_THREADS = 4
"""Threads of the streams' pool beyond the admitted streams: they refuse extra streams at once."""
MAX_WAITING_CALLS = 65536
"""Upper bound of ``--max-waiting-calls``."""
WAIT_REFUSAL_THREADS = 4
"""Threads of the waiting calls' pool beyond the admitted calls: they refuse extra calls at once."""


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one shard process.

    Raises:
        InvalidRequestError: any value out of range, in a full sentence.
    """

    shard_index: int
    num_shards: int
    num_workers: int
    mode: str = "sync"
    host: str = "127.0.0.1"
    port: int = 50051
    reuse_port: bool = False
    """Bind ``port`` with SO_REUSEPORT (a port its launcher reserved with it); False: a port in use fails."""
    lease_timeout: float = 10.0
    token: str = ""
    admin_token: str = ""
    insecure: bool = False
    max_message_bytes: int = 16 * 1024 * 1024
    max_parameter_bytes: int = DEFAULT_MAX_PARAMETER_BYTES
    """Largest model an Init may declare, in bytes of all its parameters (every shard's share)."""
    max_workers_threads: int = 0
    # the mode parameters (ps_common.modes.PARAMETERS, in its order and with its defaults)
    sync_quorum: int = 0
    round_timeout: float = 0.0
    max_staleness: int = -1
    staleness_lr: str = ""
    staleness: int = 0
    moving_rate: float | None = None
    communication_period: int = 10
    easgd_sync: bool = False
    outer_optimizer: str = DILOCO_OUTER_OPTIMIZER
    fragments: int = 1
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    max_table_rows: int = DEFAULT_MAX_TABLE_ROWS
    """Most rows one shard holds per embedding table; a push needing more is refused (RESOURCE_EXHAUSTED)."""
    max_table_bytes: int = DEFAULT_MAX_TABLE_BYTES
    """Most bytes all embedding tables of one shard hold (rows, optimizer state, ids, index, capacity
    included); a push or declaration needing more is refused (RESOURCE_EXHAUSTED) before allocating."""
    durable_acks: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    join_timeout: float = 300.0
    cluster_id: str = ""
    """The job's id, the same on every shard (``--cluster-id``): membership records carry it, signed,
    and a shard follows only records of its own cluster. "": shard 0 draws one at its first start
    (kept in checkpoints) and the other shards pin the id of the first record they follow."""
    """Seconds after the first Join that ranks which never joined are waited for (0: forever)."""
    otel_endpoint: str = ""
    """``--otel-endpoint``: where the shard's traces go ("": off unless ``OTEL_*`` say; ps_common.tracing)."""
    metrics_port: int = -1
    """HTTP port of ``/metrics`` on ``host``; 0 picks a free port, -1 (the library default) serves none.
    ``ps-server`` defaults to 8000."""
    data_port: int = -1
    """TCP port of the data connections (PushPull's partitions beside gRPC) on ``host``; 0 picks a
    free port, -1 (the library default) serves none. ``ps-server`` defaults to 0. Never with TLS."""
    stream_rounds: str = "auto"
    """``--stream-rounds``: which sync rounds are streamed (:mod:`ps_server.shard.round_stream`)."""
    max_watch_streams: int = 16
    """Admin/WatchStatus streams (``ps-admin top``) open at once; one more is refused with
    RESOURCE_EXHAUSTED. Each holds a thread of the streams' pool, never one of the data plane's."""
    max_public_streams: int = 64
    """Streams of the services that need no token (Health/Watch, reflection) open at once; one more
    is refused with RESOURCE_EXHAUSTED."""
    max_waiting_calls: int = 0
    """ParameterService calls that may wait (Push, Pull, PushPull, PushPullOnce, Exchange, Init,
    InitTables, PullRows) running at once, in a pool of their own; one more is refused with
    RESOURCE_EXHAUSTED (``TOO_MANY_WAITS``, retried by workers). 0: 2 per worker plus 8
    (:attr:`waiting_calls`)."""
    data_frame_timeout: float = 0.0
    """Seconds a push frame parked on a data connection (complete and not taken, or partial) may
    wait without progress before it is released; 0: three lease timeouts (:attr:`frame_timeout`)."""
    max_parked_bytes: int = 0
    """Most bytes of push frames parked over all data connections at once; 0: two frames of this
    shard's partitions per rank of the cluster (a complete one and one being read)."""
    rank_tokens: RankTokens | None = field(default=None, repr=False)
    """Per-rank credentials (``--rank-tokens FILE``, :mod:`ps_server.service.rank_tokens`): a rank's token
    acts only as that rank; each rank gets its own share of waiting calls."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidRequestError(f"Unknown mode {self.mode!r}; expected one of {', '.join(MODES)}.")
        if self.num_shards < 1:
            raise InvalidRequestError(f"--num-shards must be >= 1, got {self.num_shards}.")
        if not 0 <= self.shard_index < self.num_shards:
            raise InvalidRequestError(
                f"--shard-index must be in 0..{self.num_shards - 1} for --num-shards {self.num_shards}, "
                f"got {self.shard_index}."
            )
        if not 1 <= self.num_workers <= 4096:
            raise InvalidRequestError(f"--num-workers must be in 1..4096, got {self.num_workers}.")
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"--port must be in 0..65535, got {self.port}.")
        if not -1 <= self.data_port <= 65535:
            raise InvalidRequestError(f"--data-port must be in -1..65535 (-1: off), got {self.data_port}.")
        if self.stream_rounds not in STREAM_ROUNDS:
            raise InvalidRequestError(
                f"--stream-rounds must be one of {', '.join(STREAM_ROUNDS)}, got {self.stream_rounds!r}."
            )
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidRequestError(f"--metrics-port must be in -1..65535 (-1: off), got {self.metrics_port}.")
        if not self.lease_timeout > 0:
            raise InvalidRequestError(f"--lease-timeout must be > 0 seconds, got {self.lease_timeout}.")
        if not 0 <= self.data_frame_timeout <= 86400:  # also refuses NaN
            raise InvalidRequestError(
                f"--data-frame-timeout must be in 0..86400 seconds (0: three lease timeouts), "
                f"got {self.data_frame_timeout}."
            )
        if self.max_parked_bytes < 0:
            raise InvalidRequestError(
                f"--max-parked-bytes must be >= 0 (0: two frames per rank), got {self.max_parked_bytes}."
            )
        if len(self.cluster_id) > 64 or not all(c.isascii() and (c.isalnum() or c in "-_.:") for c in self.cluster_id):
            raise InvalidRequestError(
                f"--cluster-id must be at most 64 letters, digits, '-', '_', '.' or ':' "
                f"(e.g. the job's name and start time), got {self.cluster_id[:80]!r}."
            )
        if not 0 <= self.join_timeout <= 86400:  # also refuses NaN
            raise InvalidRequestError(
                f"--join-timeout must be in 0..86400 seconds (0: wait forever), got {self.join_timeout}."
            )
        Limits(self.max_message_bytes, self.max_parameter_bytes)  # validates both bounds
        worker_credential = self.token or self.rank_tokens is not None
        if not is_loopback(self.host) and not (worker_credential and self.admin_token) and not self.insecure:
            raise InvalidRequestError(
                f"Refusing to serve on non-loopback address {self.host!r} without both PS_TOKEN and "
                "PS_ADMIN_TOKEN: set them (or --token/--rank-tokens and --admin-token), or pass --insecure on a "
                "trusted network."
            )
        named = (("--token (PS_TOKEN)", self.token), ("--admin-token (PS_ADMIN_TOKEN)", self.admin_token))
        if self.rank_tokens is not None:
            for flag, token in named:
                if token and self.rank_tokens.rank_of(token) is not None:
                    raise InvalidRequestError(
                        f"--rank-tokens gives rank {self.rank_tokens.rank_of(token)} the same token as {flag}; a "
                        "rank's token must be its own."
                    )
        for flag, token in (("--token (PS_TOKEN)", self.token), ("--admin-token (PS_ADMIN_TOKEN)", self.admin_token)):
            if token and not token.strip():
                raise InvalidRequestError(f"{flag} is only whitespace; give a real secret, or leave it empty.")
        if not is_loopback(self.host) and self.token and self.token == self.admin_token and not self.insecure:
            raise InvalidRequestError(
                f"Refusing to serve on non-loopback address {self.host!r} with PS_TOKEN equal to PS_ADMIN_TOKEN: "
                "every worker could then call Admin; give the admin token a different secret."
            )
        for flag, value in (
            ("--max-watch-streams", self.max_watch_streams),
            ("--max-public-streams", self.max_public_streams),
        ):
            if not 1 <= value <= MAX_STREAMS:
                raise InvalidRequestError(f"{flag} must be in 1..{MAX_STREAMS}, got {value}.")
        if not 0 <= self.max_waiting_calls <= MAX_WAITING_CALLS:
            raise InvalidRequestError(
                f"--max-waiting-calls must be in 0..{MAX_WAITING_CALLS} (0: 2 per worker plus 8), "
                f"got {self.max_waiting_calls}."
            )
        if self.max_table_rows < 0:
            raise InvalidRequestError(f"--max-table-rows must be >= 0, got {self.max_table_rows}.")
        if self.max_table_bytes < 0:
            raise InvalidRequestError(f"--max-table-bytes must be >= 0 (0: no tables), got {self.max_table_bytes}.")
        if self.checkpoint_every < 0 or self.checkpoint_keep < 1:
            raise InvalidRequestError(
                f"--checkpoint-every must be >= 0 (0: only on SIGTERM and Admin/Checkpoint) and --checkpoint-keep "
                f">= 1, got {self.checkpoint_every} and {self.checkpoint_keep}."
            )
        if self.checkpoint_every and not self.checkpoint_dir:
            raise InvalidRequestError("--checkpoint-every needs --checkpoint-dir, where checkpoints are written.")
        if self.durable_acks and not (self.checkpoint_dir and self.checkpoint_every == 1):
            raise InvalidRequestError(
                "--durable-acks needs --checkpoint-dir and --checkpoint-every 1: a push is answered once the "
                "version it makes is in a checkpoint on disk."
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidRequestError("--tls-cert and --tls-key go together: pass both, or neither for plaintext.")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidRequestError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too.")
        for flag, path in (
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-client-ca", self.tls_client_ca),
        ):
            if path and not os.access(path, os.R_OK):
                raise InvalidRequestError(f"{flag} {path!r} is not a readable file.")
        self.mode_settings()  # validates the mode parameters

    def mode_settings(self) -> ModeSettings:
        """The consistency model and its parameters.

        Raises:
            InvalidRequestError: a parameter out of range.
        """
        return ModeSettings(mode=self.mode, num_workers=self.num_workers, **modes.settings_of(self))

    @property
    def limits(self) -> Limits:
        """Bounds on what clients may declare and send (:class:`~ps_server.core.limits.Limits`).

        Raises:
            InvalidRequestError: a bound below 1 MiB.
        """
        return Limits(self.max_message_bytes, self.max_parameter_bytes)

    @property
    def threads(self) -> int:
        """The server's thread pool size: each worker holds at most two calls on a shard at once
        (its push or pull, and its heartbeat), plus 8 for Join/Init/Leave and Admin's unary calls.
        Long-lived streams and the calls that may wait never run in it (see :attr:`stream_threads`
        and :attr:`wait_threads`), so Health, Admin and Join always find a thread here. The data
        connections are capped at this many too."""
        return self.max_workers_threads or max(16, 2 * self.num_workers + 8)

    def warnings(self) -> list[str]:
        """What this configuration leaves open that an operator may not expect (logged at start)."""
        out = []
        if self.rank_tokens is not None:
            missing = [r for r in range(self.num_workers) if not self.rank_tokens.has(r)]
            if missing and not self.token:
                out.append(
                    f"--rank-tokens gives no token to rank(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                    "and --token is not set: those ranks cannot call this shard."
                )
        if (self.token or self.rank_tokens is not None) and not self.admin_token:
            out.append(
                "Worker tokens (--token or --rank-tokens) are set but --admin-token (PS_ADMIN_TOKEN) is not: Admin "
                "(status, config changes, resize, evict, checkpoint, export) takes calls without a token from anyone "
                f"who can reach {self.host}:{self.port}; set PS_ADMIN_TOKEN or PS_ADMIN_TOKEN_FILE."
            )
        return out

    @property
    def frame_timeout(self) -> float:
        """Seconds a parked push frame waits without progress before it is released."""
        return self.data_frame_timeout or 3 * self.lease_timeout

    @property
    def waiting_calls(self) -> int:
        """Waiting calls admitted at once (``--max-waiting-calls``, or 2 per worker plus 8): sync
        training holds one per worker on every shard (its PushPull or Pull waiting for the round),
        twice that leaves room for retries and tools (``ps-admin export``)."""
        return self.max_waiting_calls or 2 * self.num_workers + 8

    @property
    def rank_share(self) -> int:
        """Waiting calls each rank with its own token (``--rank-tokens``) may hold at once, beside
        :attr:`waiting_calls` (0 without rank tokens)."""
        return rank_share(self.waiting_calls, self.num_workers) if self.rank_tokens is not None else 0

    @property
    def first_message_seconds(self) -> float:
        """Most seconds a request stream (Init, Push, PushPull, Exchange) may take to send its first
        message before it is cancelled: min(10 s, the lease timeout)."""
        return min(FIRST_MESSAGE_SECONDS, self.lease_timeout)

    @property
    def wait_threads(self) -> int:
        """The waiting calls' pool size: one thread per admitted call (the shared cap, and each
        rank's share with ``--rank-tokens``), plus a few that answer refusals."""
        ranks = len(self.rank_tokens) if self.rank_tokens is not None else 0
        return self.waiting_calls + ranks * self.rank_share + WAIT_REFUSAL_THREADS

    @property
    def stream_threads(self) -> int:
        """The long-lived streams' pool size: every admitted stream has a thread (Health/Watch needs
        none, but counts in ``max_public_streams``), plus a few that answer refusals at once."""
        return self.max_watch_streams + self.max_public_streams + STREAM_REFUSAL_THREADS


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ServerConfig, str]:
    """Parse ``argv`` (and twins) into a validated config and the log level.

    Raises:
        SystemExit: bad flags, with a message on stderr.
    """
    parser = server_parser(environ)
    args = parser.parse_args(argv)
    try:
        token = secret(args.token, args.token_file, "--token")
        admin_token = secret(args.admin_token, args.admin_token_file, "--admin-token")
        rank_tokens = load_rank_tokens(args.rank_tokens) if args.rank_tokens else None
    except ValueError as exc:
        parser.error(str(exc))
    try:
        config = ServerConfig(
            shard_index=args.shard_index,
            num_shards=args.num_shards,
            num_workers=args.num_workers,
            mode=args.mode,
            host=args.host,
            port=args.port,
            reuse_port=args.reuse_port,
            lease_timeout=args.lease_timeout,
            join_timeout=args.join_timeout,
            cluster_id=args.cluster_id,
            token=token,
            admin_token=admin_token,
            insecure=args.insecure,
            max_message_bytes=args.max_message_bytes,
            max_parameter_bytes=args.max_parameter_bytes,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            checkpoint_keep=args.checkpoint_keep,
            max_table_rows=args.max_table_rows,
            max_table_bytes=args.max_table_bytes,
            durable_acks=args.durable_acks,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            metrics_port=args.metrics_port,
            otel_endpoint=args.otel_endpoint,
            data_port=args.data_port,
            stream_rounds=args.stream_rounds,
            max_watch_streams=args.max_watch_streams,
            max_public_streams=args.max_public_streams,
            max_waiting_calls=args.max_waiting_calls,
            data_frame_timeout=args.data_frame_timeout,
            max_parked_bytes=args.max_parked_bytes,
            rank_tokens=rank_tokens,
            **modes.settings_of(args),
        )
    except InvalidRequestError as exc:
        parser.error(str(exc))
    return config, args.log_level
