"""``ps-admin export``: the model held by every shard, as one model file (safetensors or torch.save).

Each shard streams its plan, its partitions and its embedding tables' rows
(``Admin/ExportParameters``, admin token, no rank: the workers may all have exited); the partitions
are laid back into full tensors of the plan's shapes, each table into its full ``[num_rows, dim]``
matrix (:mod:`ps_admin.model_file`), and written as a plain ``{key: tensor}`` file that
``model.load_state_dict`` of the model the workers train reads without grpc-ps installed.
torch is imported inside the command only: ``ps-admin`` stays torch-free at import.

One model, one version: each shard's answer is of one version, but while training runs the shards
may answer from different ones. The shards behind the newest are asked again until every shard
answered at the same version (:func:`fetch_consistent`; in sync mode a shard ahead cannot move on
until every shard reached its version and the workers stepped, so the ones behind catch up within a
round), for at most ``--consistency-deadline`` seconds; a model still mixed is not written (exit 1)
unless ``--allow-mixed``. The tables' version (``tables_version``) counts as well: a shard behind in
either is asked again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import IO, Any

import grpc

from ps_admin.client import CHANNEL_OPTIONS, error_line, metadata_of
from ps_admin.model_file import ModelFileError, check_target, format_of, save, table_tensors
from ps_common.channels import secure_or_plain
from ps_proto.v1 import ps_pb2, ps_pb2_grpc

INTEGER_BUFFER_SUFFIX = ".num_batches_tracked"
"""Buffers that travel as float64 but are int64 in torch (BatchNorm's step counter): written back
as int64 so the file's dtypes are those of ``model.state_dict()``."""


@dataclass
class ShardExport:
    """What one shard sent: its first message (plan, buffers, index) and its partitions, or the
    error of its call."""

    position: int
    address: str
    head: ps_pb2.ExportParametersResponse | None = None
    partitions: list[ps_pb2.Partition] = field(default_factory=list)
    rows: list[ps_pb2.RowBlock] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.head is not None and self.code is None

    def error_line(self) -> str:
        return error_line(self.address, self.code, self.details)


def fetch_shard(
    position: int, address: str, token: str, deadline: float, creds: grpc.ChannelCredentials | None = None
) -> ShardExport:
    """One shard's ExportParameters stream, read to its end within ``deadline`` seconds; a failed
    call is returned as a result (``code``, ``details``), never raised."""
    from ps_common.frames import MESSAGE_OVERHEAD_BYTES  # imports torch: only when exporting
    from ps_common.plan import MAX_PARTITION_BYTES

    result = ShardExport(position, address)
    # the largest partition a plan allows plus room for its fields (the shard's --max-message-bytes
    # bounds what it sends)
    options = (*CHANNEL_OPTIONS, ("grpc.max_receive_message_length", MAX_PARTITION_BYTES + MESSAGE_OVERHEAD_BYTES))
    with secure_or_plain(address, creds, options) as ch:
        try:
            call = ps_pb2_grpc.AdminStub(ch).ExportParameters(
                ps_pb2.ExportParametersRequest(), timeout=deadline, metadata=metadata_of(token)
            )
            for reply in call:
                if result.head is None:
                    result.head = reply
                elif reply.HasField("partition"):
                    result.partitions.append(reply.partition)
                elif reply.HasField("rows"):
                    result.rows.append(reply.rows)
        except grpc.RpcError as exc:
            result.code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            result.details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    if result.code is None and result.head is None:
        result.code, result.details = grpc.StatusCode.UNKNOWN, "the shard sent no message"
    return result


def fetch_all(
    addresses: Sequence[str], token: str, deadline: float, creds: grpc.ChannelCredentials | None = None
) -> list[ShardExport]:
    """Every shard's export, asked in parallel; one result per address, in order."""
    with futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(addresses)))) as pool:
        return list(pool.map(lambda k: fetch_shard(k, addresses[k], token, deadline, creds), range(len(addresses))))


def fetch_consistent(
    addresses: Sequence[str],
    token: str,
    deadline: float,
    creds: grpc.ChannelCredentials | None = None,
    within: float = 30.0,
    clock: Any = None,
) -> tuple[list[ShardExport], int]:
    """Every shard's export at one version if it can be had within ``within`` seconds: the shards
    that answered from a version older than the newest answer again (in parallel) until all
    versions are equal, a shard fails, or ``within`` passes.

    Args:
        deadline: seconds each shard's stream may take.
        within: seconds the asking again may take in all (the first round of answers is always
            asked for).
        clock: ``time.monotonic`` (injectable for tests).

    Returns:
        (one result per address in order, the number of rounds of asking); the results' versions
        may still differ when ``within`` passed (training moving each shard on its own: async,
        ssp, easgd).
    """
    import time

    now = clock or time.monotonic
    end = now() + within
    exports = fetch_all(addresses, token, deadline, creds)
    rounds = 1
    while all(e.ok for e in exports) and now() < end:
        versions = [(e.head.version, e.head.tables_version) for e in exports]  # type: ignore[union-attr]
        newest = tuple(max(v[i] for v in versions) for i in range(2))
        behind = [k for k, v in enumerate(versions) if v[0] < newest[0] or v[1] < newest[1]]
        if not behind:
            break
        again = fetch_all([addresses[k] for k in behind], token, deadline, creds)
        for k, e in zip(behind, again, strict=True):
            exports[k] = ShardExport(k, e.address, e.head, e.partitions, e.rows, e.code, e.details)
        rounds += 1
    return exports, rounds


class ExportError(ModelFileError):
    """The shards' answers do not make one model (another cluster listed, a partition missing)."""


def assemble(exports: Sequence[ShardExport]) -> tuple[dict[str, Any], list[int]]:
    """Full tensors of every plan key from the shards' partitions.

    Args:
        exports: one successful :class:`ShardExport` per shard, in shard-index order.

    Returns:
        (state_dict, versions): key -> CPU tensor of the plan's shape and dtype (float32, float16,
        bfloat16 or float64; ``*.num_batches_tracked`` buffers int64), in plan order, then each
        table's tensors (:func:`ps_admin.model_file.table_tensors`); and each shard's version.

    Raises:
        ExportError: the shards disagree on the plan, one is listed at the wrong position, or the
            partitions do not cover every element exactly once.
    """
    import torch  # lazily: ps-admin imports no torch until a model is exported

    from ps_common import errors
    from ps_common.codec import decode, dtype_from_proto, torch_dtype
    from ps_common.plan import plan_for_digest
    from ps_common.wire import specs_from_proto

    plan = exports[0].head.plan  # type: ignore[union-attr]
    for position, e in enumerate(exports):
        assert e.head is not None
        if e.head.plan.digest != plan.digest:
            raise ExportError(
                f"{e.address} holds another model (plan {e.head.plan.digest[:12]} vs {plan.digest[:12]}); "
                "list the shards of one cluster."
            )
        if [t.name for t in e.head.tables] != [t.name for t in exports[0].head.tables]:  # type: ignore[union-attr]
            raise ExportError(f"{e.address} holds other embedding tables than {exports[0].address}; export again.")
        if e.head.shard_index != position or plan.num_shards != len(exports):
            raise ExportError(
                f"{e.address} is shard {e.head.shard_index} of {plan.num_shards}, listed at position {position} "
                f"of {len(exports)}; list every shard in shard-index order."
            )
    specs = specs_from_proto(plan.specs)
    # each partition of the plan exactly once, from the shard that owns it, in the parameter's dtype
    dtypes = {s.key: s.dtype for s in plan.specs}
    layout = plan_for_digest(specs, plan.num_shards, plan.partition_bytes, plan.digest).partitions
    expected = {(p.key, p.offset, p.length, p.shard) for p in layout}
    got = [(p.key, p.offset, p.length, k) for k, e in enumerate(exports) for p in e.partitions if p.key in dtypes]
    wrong = {p.key for e in exports for p in e.partitions if p.dtype != dtypes.get(p.key)}
    if wrong or len(got) != len(expected) or set(got) != expected:
        keys = sorted(wrong | {key for key, *_ in expected.symmetric_difference(got)})
        raise ExportError(f"The shards' partitions do not cover {keys[:4]} exactly once; export again.")
    flats = {s.key: torch.empty(math.prod(s.shape), dtype=torch_dtype(s.dtype)) for s in specs}
    for e in exports:
        for p in e.partitions:
            try:
                flats[p.key][p.offset : p.offset + p.length] = decode(p.data, dtype_from_proto(p.dtype), p.length)
            except errors.InvalidRequestError as exc:
                raise ExportError(f"{e.address} sent a malformed partition of {p.key}: {exc}") from None
    buffers = set(exports[0].head.buffers)  # type: ignore[union-attr]
    state: dict[str, Any] = {}
    for s in plan.specs:
        t = flats[s.key].view(tuple(s.shape))
        if s.key in buffers and s.key.endswith(INTEGER_BUFFER_SUFFIX):
            t = t.to(torch.int64)
        state[s.key] = t
    rows: dict[str, list[tuple[bytes, bytes]]] = {}
    for e in exports:
        for block in e.rows:
            rows.setdefault(block.table, []).append((block.ids, block.data))
    state.update(table_tensors(exports[0].head.tables, rows))  # type: ignore[union-attr]
    return state, [e.head.version for e in exports]  # type: ignore[union-attr]


class ShardsFailed(ModelFileError):
    """Shards that did not answer an export: one ``error_line`` each, and a summary."""

    def __init__(self, lines: list[str], summary: str) -> None:
        super().__init__("; ".join([*lines, summary + "; nothing written."]))
        self.lines, self.summary = lines, summary


def write_model(
    addresses: Sequence[str],
    token: str,
    out: str,
    fmt: str | None = None,
    creds: grpc.ChannelCredentials | None = None,
    deadline: float = 300.0,
    within: float = 30.0,
    allow_mixed: bool = False,
    warn: Any = None,
) -> str:
    """Export the shards' model to ``out`` (format ``fmt``, or its suffix's) and return the line that
    says what was written. The path and format are checked before any shard is asked.

    Args:
        warn: called with a warning line (``--allow-mixed`` wrote a mixed model); None: none.

    Raises:
        ModelFileError: a shard failed (its error lines in the message), the answers do not make
            one model, the versions stayed mixed (without ``allow_mixed``), or the file cannot be
            written; nothing is written then.
    """
    fmt = format_of(out, fmt)
    check_target(out, fmt)
    exports, rounds = fetch_consistent(addresses, token, deadline, creds, within)
    failed = [e for e in exports if not e.ok]
    if failed:
        raise ShardsFailed([e.error_line() for e in failed], f"{len(failed)} of {len(exports)} shards did not answer")
    versions = [e.head.version for e in exports]  # type: ignore[union-attr]
    tables = [e.head.tables_version for e in exports]  # type: ignore[union-attr]
    mixed = len(set(versions)) > 1 or len(set(tables)) > 1
    if mixed and not allow_mixed:
        raise ModelFileError(
            f"the shards were at different versions {versions} (tables {tables}) after {rounds} reads in "
            f"{within:g} s (training moving each shard on its own: async, ssp or easgd?); nothing written. "
            "Export once training ended (or in sync mode, where the shards move together), or pass "
            "--allow-mixed to write each shard's part of its own version."
        )
    state, versions = assemble(exports)
    try:
        save(state, out, fmt)
    except OSError as exc:
        raise ModelFileError(f"cannot write {out}: {exc.strerror or exc}; nothing written.") from None
    if mixed and warn is not None:
        warn(
            f"--allow-mixed: the shards were at different versions {versions} (tables {tables}); "
            "each shard's part is of its own version."
        )
    numel = sum(t.numel() for t in state.values())
    return f"wrote {out}: {len(state)} tensors, {numel} elements, version {max(versions)} ({fmt})"


def cmd_export(args: Any, out: IO[str], err: IO[str]) -> int:
    """``ps-admin export --out PATH``: exit 0 when the file is written, 1 when a shard failed, the
    answers do not make one model, (without ``--allow-mixed``) the shards could not be read at one
    version within ``--consistency-deadline`` seconds, or the file cannot be written (a bad suffix or
    format, a missing directory or package)."""
    try:
        line = write_model(
            args.servers,
            args.admin_token,
            args.out,
            args.format or None,
            args.creds,
            args.deadline,
            args.consistency_deadline,
            args.allow_mixed,
            warn=lambda text: print(f"ps-admin: export: {text}", file=err),
        )
    except ShardsFailed as exc:
        print("\n".join(exc.lines), file=err)
        print(f"ps-admin: export: {exc.summary}; nothing written.", file=err)
        return 1
    except ModelFileError as exc:
        print(f"ps-admin: export: {exc}", file=err)
        return 1
    print(line, file=out)
    return 0


def add_export_parser(sub: Any, environ: Mapping[str, str]) -> None:
    """The ``export`` subcommand on ``ps-admin``'s subparsers (flags without PS_* twins)."""
    export = sub.add_parser("export", help="write the shards' model and tables as one model file", environ=environ)
    export.add_argument("--out", required=True, help="export: the file to write: .safetensors or .pt (torch.save)")
    export.add_argument("--format", default="", choices=("", "safetensors", "pt"), help="export: default: the suffix's")
    export.add_argument(
        "--deadline", type=seconds, default=300.0, help="export: seconds each shard's stream may take in all"
    )
    export.add_argument(
        "--consistency-deadline",
        type=seconds,
        default=30.0,
        help="export: seconds to spend asking the shards behind again until every shard answered at one "
        "version (training running); after that the export fails unless --allow-mixed",
    )
    export.add_argument(
        "--allow-mixed",
        action="store_true",
        help="export: write the model even when the shards answered from different versions (each shard's "
        "part of its own version; a warning on stderr)",
    )


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text} is not > 0")
    return value
