"""The ``ps-server`` command's flags and their ``PS_*`` twins (:func:`server_parser`); the settings
they make are :class:`ps_server.config.ServerConfig`."""

from __future__ import annotations

from collections.abc import Mapping

from ps_common.flags import FlagParser, join_timeout_flag, mode_flags, otel_flag, secret_help
from ps_common.modes import MODES
from ps_server.core.limits import DEFAULT_MAX_PARAMETER_BYTES
from ps_server.tables.table import DEFAULT_MAX_TABLE_BYTES, DEFAULT_MAX_TABLE_ROWS

STREAM_ROUNDS = ("auto", "on", "off")
"""``--stream-rounds``: ``auto`` streams sync rounds of two or more ranks whose data connections
come from other hosts (on one machine a link is a memory copy, and the copy a streamed partition
needs is not paid back; with one rank there is nothing to overlap but its own upload), ``on``
every sync round whose pushes come on data connections, ``off`` none (:mod:`ps_server.shard.round_stream`)."""


def server_parser(environ: Mapping[str, str] | None = None) -> FlagParser:
    """The ``ps-server`` flags, each with its ``PS_*`` environment twin read from ``environ`` (None:
    ``os.environ``); ``scripts/flags_table.py`` writes README.md's flags table from them."""
    p = FlagParser(prog="ps-server", description="Run one shard of a grpc-ps parameter server.", environ=environ)
    p.flag("--shard-index", type=int, required=True, help="this shard's index, 0..num_shards-1")
    p.flag("--num-shards", type=int, required=True, help="number of shards in the cluster")
    p.flag("--num-workers", type=int, required=True, help="number of worker ranks in the cluster")
    p.flag("--mode", default="sync", choices=MODES, help="consistency model")
    p.flag("--host", default="127.0.0.1", help="address to bind; non-loopback needs tokens or --insecure")
    p.flag("--port", type=int, default=50051, help="gRPC port; 0 picks a free port and prints it")
    p.flag(
        "--reuse-port",
        switch=True,
        help="bind --port with SO_REUSEPORT, beside the socket of a launcher that holds the port reserved until "
        "this shard serves (ps-launch does, to start workers with the address while shards start); otherwise "
        "a second server on a port in use fails to start",
    )
    p.flag(
        "--metrics-port",
        type=int,
        default=8000,
        help="HTTP port of Prometheus /metrics on --host; 0 picks a free port and prints it, -1 turns it off",
    )
    p.flag(
        "--data-port",
        type=int,
        default=0,
        help="TCP port of the data connections, where PushPull's partitions (and a small model's whole "
        "PushPullOnce) travel beside gRPC without grpcio's copies; 0 picks a free port (Join tells workers), "
        "-1 turns them off. Off with TLS",
    )
    p.flag(
        "--stream-rounds",
        default="auto",
        choices=STREAM_ROUNDS,
        help="sync: step each partition of a round as soon as every rank's partition is in, and stream its new "
        "values back while later partitions still arrive (upload and download overlap on each link; the "
        "round stays all or nothing, bitwise the same). auto: rounds of 2 or more ranks connected from other "
        "hosts (not loopback); on: every round on data connections; off: answer once the round closed",
    )
    p.flag("--lease-timeout", type=float, default=10.0, help="seconds without a heartbeat before a rank is evicted")
    otel_flag(p)
    p.flag(
        "--data-frame-timeout",
        type=float,
        default=0.0,
        help="seconds a push frame parked on a data connection (complete and not taken by its PushPull, or "
        "partial) may wait without progress before it is released; 0: three lease timeouts",
    )
    p.flag(
        "--max-parked-bytes",
        type=int,
        default=0,
        help="most bytes of push frames parked over all data connections at once (a partition beyond closes "
        "its connection); 0: two frames of this shard's partitions per rank of the cluster",
    )
    join_timeout_flag(p)
    p.flag(
        "--cluster-id",
        default="",
        help="this job's id, the same on every shard (e.g. the job's name and start time): membership records "
        "carry it and a shard follows only its own cluster's, whatever admin token other jobs share; "
        "default: shard 0 draws one at its first start (kept in checkpoints) and the others follow the first "
        "record they see",
    )
    p.flag("--token", default="", help=secret_help("bearer token workers must send to ParameterService", "PS_TOKEN"))
    p.flag(
        "--admin-token",
        default="",
        help=secret_help(
            "bearer token operators must send to Admin; with --token but without it, Admin takes calls without a "
            "token (a WARNING says so; refused off loopback)",
            "PS_ADMIN_TOKEN",
        ),
    )
    p.flag("--token-file", default="", help="file holding the worker token (e.g. a mounted Secret)")
    p.flag(
        "--rank-tokens",
        default="",
        env="PS_RANK_TOKENS_FILE",
        help="file of per-rank tokens, one 'RANK TOKEN' line per rank (# comments): a ParameterService call or "
        "data connection with a rank's token acts only as that rank (others: PERMISSION_DENIED WRONG_RANK), "
        "--token then acts only as ranks without a token of their own, and each rank gets its own share of "
        "waiting calls. Workers send their rank's token as PS_TOKEN/PS_TOKEN_FILE",
    )
    p.flag("--admin-token-file", default="", help="file holding the admin token")
    p.flag("--insecure", switch=True, help="allow a non-loopback bind without tokens")
    p.flag("--checkpoint-dir", default="", help="directory of this shard's checkpoints; resume from the newest")
    p.flag(
        "--checkpoint-every",
        type=int,
        default=0,
        help="checkpoint every V versions (0: only on SIGTERM and Admin/Checkpoint)",
    )
    p.flag("--checkpoint-keep", type=int, default=3, help="checkpoints kept per shard")
    p.flag(
        "--max-table-rows",
        type=int,
        default=DEFAULT_MAX_TABLE_ROWS,
        help="rows one shard holds per embedding table; a push that would add more is refused (RESOURCE_EXHAUSTED)",
    )
    p.flag(
        "--max-table-bytes",
        type=int,
        default=DEFAULT_MAX_TABLE_BYTES,
        help="bytes all embedding tables of one shard hold (rows and optimizer state, capacity included); a push "
        "or InitTables needing more is refused before allocating (RESOURCE_EXHAUSTED)",
    )
    p.flag(
        "--durable-acks",
        switch=True,
        help="answer a push (PushPull, and async/ssp Push) only once the version it makes is in a checkpoint on "
        "disk, so a kill -9 of the shard loses nothing acknowledged (needs --checkpoint-every 1)",
    )
    p.flag("--tls-cert", default="", help="PEM certificate chain of this shard: serve TLS")
    p.flag("--tls-key", default="", help="PEM private key of --tls-cert")
    p.flag("--tls-client-ca", default="", help="PEM CA that client certificates must chain to (mutual TLS)")
    p.flag("--max-message-bytes", type=int, default=16 * 1024 * 1024, help="largest gRPC message accepted, bytes")
    p.flag(
        "--max-watch-streams",
        type=int,
        default=16,
        help="Admin/WatchStatus streams (ps-admin top) open at once; more are refused with RESOURCE_EXHAUSTED",
    )
    p.flag(
        "--max-public-streams",
        type=int,
        default=64,
        help="Health/Watch and reflection streams (no token needed) open at once; more are refused",
    )
    p.flag(
        "--max-waiting-calls",
        type=int,
        default=0,
        help="Push/Pull/PushPull/Exchange/Init/InitTables/PullRows calls that may wait, running at once in a "
        "pool of their own (Health, Admin and Join keep theirs); more are refused with RESOURCE_EXHAUSTED and "
        "retried by workers. 0: 2 per worker plus 8",
    )
    p.flag(
        "--max-parameter-bytes",
        type=int,
        default=DEFAULT_MAX_PARAMETER_BYTES,
        help="largest model an Init may declare: bytes of all its parameters over all shards",
    )
    mode_flags(p)
    p.flag("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level")
    return p
