"""``ps-server``: run one shard until SIGTERM or Ctrl-C."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from ps_common import tracing
from ps_common.process_env import dump_stacks_on_signal, tune_malloc_at_start


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Prints ``ps-server: metrics on http://HOST:PORT/metrics`` (unless
    ``--metrics-port -1``), then ``ps-server: shard K/S listening on HOST:PORT`` once serving.

    Started without ``GLIBC_TUNABLES`` in its environment (``argv`` None: this process's own command
    line), the process first restarts itself with grpc-ps's malloc tuning
    (:func:`ps_common.process_env.tune_malloc_at_start`: same PID, same command line), so a plain
    ``ps-server`` is as fast as one started by ``ps-launch``; once stopped it also ends the process
    itself (:func:`exit_now`) instead of returning.

    Returns:
        0 after a clean stop; 1 when the shard could not start, or when the final checkpoint
        written at SIGTERM/SIGINT failed (the message says why and which checkpoint is the newest).
    """
    if argv is None:
        tune_malloc_at_start()
        dump_stacks_on_signal()
    # imported after the restart above: torch and grpcio take a second to load
    from ps_common.errors import CheckpointError
    from ps_server.config import config_from_args
    from ps_server.server import start_server

    config, log_level = config_from_args(argv)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # before the server starts: its interceptor has a tracing stage only when tracing is on
        tracing.configure(config.otel_endpoint, "ps-server", {"ps.shard_index": config.shard_index})
        running = start_server(config)
    except (RuntimeError, CheckpointError) as exc:  # TracingUnavailableError: pip install 'grpc-ps[otel]'
        print(f"ps-server: {exc}", file=sys.stderr)
        return 1
    restored = running.shard.restored_from_version
    if restored is not None:
        print(f"ps-server: shard {config.shard_index} resumed from its checkpoint at version {restored}", flush=True)
    if running.metrics_url:
        print(f"ps-server: metrics on {running.metrics_url}", flush=True)
    print(f"ps-server: shard {config.shard_index}/{config.num_shards} listening on {running.address}", flush=True)
    threading.Thread(target=warm_up, name="warm-up", daemon=True).start()
    done = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        logging.getLogger("ps_server").info("signal %d: shutting down", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    running.stop()
    tracing.shutdown()  # the spans still queued go out before the process ends
    failed = running.checkpointer.final_error if running.checkpointer is not None else None
    code = 1 if failed else 0
    if failed:
        newest = running.shard.last_checkpoint_version
        kept = f"the newest checkpoint written was version {newest}" if newest is not None else "none was written"
        print(
            f"ps-server: final checkpoint of shard {config.shard_index} at version {running.shard.version} failed "
            f"({kept}): {failed}",
            file=sys.stderr,
            flush=True,
        )
    if argv is None:  # this process is the shard's: stopped and written, it ends now
        exit_now(code)
    return code


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` once stdout, stderr and the logs are flushed, skipping the
    interpreter's finalization: its last garbage collections walk every object torch and grpcio made
    (1-3 s of CPU, measured with ``py-spy dump --native`` in ``gc_collect_main``), after the shard has
    stopped serving and written its final checkpoint, while ``ps-launch`` waits for it to exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def warm_up() -> None:
    """Build a throw-away ``torch.optim.SGD`` while the workers start: the first optimizer a process
    builds imports ``torch._dynamo`` (torch.optim's constructors are wrapped in ``_disable_dynamo``,
    which imports it on first use: about 1 s on a quiet core), and the first Init builds the shard's
    optimizer on the path of every worker's first step (``bench/first_step.py``'s breakdown)."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


if __name__ == "__main__":
    sys.exit(main())
