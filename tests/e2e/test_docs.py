"""The docs' recipes, run: every command in a fenced shell block of README.md, docs/operations.md and docs/faults.md.

Commands come from ``bash``/``sh`` blocks (one per line, ``\\`` continuations joined, ``#`` comments
dropped) and from ``$ ``-prompted lines of transcript blocks. Each is run, in document order, against
one real cluster (2 in-process shards for 2 workers, initialized by rank 0, with a checkpoint
directory): the docs' fixed addresses (``127.0.0.1:50051``, ``ps-0:50051``, …) are rewritten to the
cluster's ports, and ``ps-launch`` runs are capped at a few steps so the whole harness stays within
two minutes. A command that cannot run here is skipped by design, with its reason, from the table
:data:`SKIPPED`; a command that matches neither makes the test fail, so a new recipe is either run
or explicitly excused. Expected failures (a transcript that shows one) are in :data:`EXPECTED`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ps_server.config import ServerConfig
from ps_server.server import start_server
from ps_worker import PSClient
from tests.conftest import small_model

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/operations.md", "docs/faults.md")
BIN = Path(sys.executable).parent

SKIPPED: dict[str, str] = {
    r"^python3 -m venv\b": "creates a virtual environment: the harness runs inside the installed one",
    r"^\. \.venv/bin/activate$": "activates that environment: already active",
    r"^pip install\b": "installs packages (network): the environment under test is installed already",
    r"^bash \.ci/run$": "CI itself: installs from scratch and runs the whole suite, this file included",
    r"^bash \.ci/install-ops-tools\.sh\b": "installs Debian packages as root (network)",
    r"^python -m pytest( --ignore=tests/deploy)?$": "the whole suite, this file included: CI runs it",
    r"^pytest tests/": "test files that CI runs on their own",
    r"^python scripts/gen_proto\.py$": "rewrites ps_proto/ in the checkout; tests/test_proto.py regenerates it into "
    "a temporary directory and compares",
    r"^python scripts/flags_table\.py --write$": "rewrites docs/flags.md in the checkout; tests/test_readme.py "
    "checks it is current",
    r"^python scripts/render_watch\.py$": "rewrites docs/img/ from a 90 s job; test_grafana_dashboard.py and "
    "e2e/test_tensorboard.py draw both pictures from their own jobs",
    r"^docker\b|\bdocker compose\b": "needs a Docker daemon; tests/deploy checks the compose file and runs its "
    "commands as local processes",
    r"^kubectl\b": "needs a Kubernetes cluster; tests/deploy validates the manifests",
    r"^bash deploy/compose/reshard\.sh\b": "needs a Docker daemon and a stopped compose job's volumes: "
    "tests/deploy/test_compose_up.py runs it",
    r"^torchrun\b": "DDP itself, for comparison: tests/e2e/test_ddp_port.py runs it under torchrun and the port "
    "under ps-launch, in a temporary directory, and compares their weights bitwise",
    r"examples/ddp_tutorial/multigpu_grpc_ps\.py": "writes snapshot.pt into the working directory and resumes "
    "from it (the tutorial's habit): tests/e2e/test_ddp_port.py runs it under ps-launch in a temporary directory, "
    "tests/integration/test_single_process.py runs a script under plain python",
}
"""Pattern of a command -> why it is not run here."""

EXPECTED: dict[str, tuple[int, str]] = {
    "set --mode easgd": (1, "to easgd live: easgd and diloco workers run local optimizers"),
}
"""Command fragment -> (exit status, text in its output) where the docs show a refusal."""

STREAMING = ("ps.v1.Admin/WatchStatus",)
"""Commands that run until Ctrl-C: stopped after a few seconds, fine if they answered by then."""

LAUNCH_STEPS = 40
"""``ps-launch`` runs are capped at this many steps (the recipes, not the convergence, are under test)."""


@dataclass
class Command:
    doc: str
    line: int
    text: str
    shows: tuple[str, ...] = ()
    """Output the docs show for it (``# {"status": "SERVING"}`` after it, or ``#   name`` lines below it)."""


def commands(doc: str) -> list[Command]:
    """The shell commands of ``doc``'s fenced blocks, in order."""
    found = []
    lines = (ROOT / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        lang = fence.group(1)
        i += 1
        block = []
        while i < len(lines) and not lines[i].startswith("```"):
            block.append((i + 1, lines[i]))
            i += 1
        i += 1
        if lang in ("bash", "sh"):
            found += _shell_block(doc, block)
        elif lang == "" and any(text.startswith("$ ") for _, text in block):
            found += [Command(doc, n, text[2:].strip()) for n, text in block if text.startswith("$ ")]
    return found


def _shell_block(doc: str, block: list[tuple[int, str]]) -> list[Command]:
    out: list[Command] = []
    pending: tuple[int, str] | None = None
    for n, raw in block:
        text = raw.strip()
        shown = re.match(r"^#\s+(\{.*\}|[\w.]+)$", text)
        if pending is None and shown and out and "…" not in text:
            out[-1].shows += (shown.group(1),)
        if pending is None and (not text or text.startswith("#")):
            continue
        if pending is not None:
            n, text = pending[0], pending[1] + " " + text
            pending = None
        if text.endswith("\\"):
            pending = (n, text[:-1].rstrip())
            continue
        command = _strip_comment(text)
        trailing = re.match(r"^#\s*(\{.*\})$", text[len(command) :].strip())
        out.append(Command(doc, n, command, (trailing.group(1),) if trailing else ()))
    return out


def _strip_comment(text: str) -> str:
    """The command without a trailing ``# comment`` (a ``#`` after a space, outside quotes)."""
    quote = None
    for k, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or text[k - 1].isspace()):
            return text[:k].rstrip()
    return text


def parts(text: str) -> list[str]:
    """``a && b && c`` -> its commands (the quickstart chains installation and the run)."""
    return [p.strip() for p in re.split(r"\s&&\s", text) if p.strip()] if not text.startswith("(") else [text]


def skip_reason(part: str) -> str | None:
    return next((why for pattern, why in SKIPPED.items() if re.search(pattern, part)), None)


def test_every_documented_command_is_run_or_excused() -> None:
    """No recipe goes unchecked silently: each is run below, or skipped with a reason."""
    found = [c for doc in DOCS for c in commands(doc)]
    assert len(found) >= 30, found
    runnable = re.compile(r"^(ps-launch|ps-admin|ps-worker|grpcurl|buf|ruff|\(cd proto && buf lint\))\b|^\(cd ")
    for c in found:
        for part in parts(c.text):
            assert skip_reason(part) or runnable.match(part), f"{c.doc}:{c.line}: no verdict for {part!r}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 shards for 2 workers, initialized by rank 0 (incarnation 0, so a documented Join of rank 0 with
    incarnation 1 is a restart), with a checkpoint directory."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    shards = [
        start_server(
            ServerConfig(shard_index=k, num_shards=2, num_workers=2, port=0, checkpoint_dir=str(ckpt / f"shard-{k}"))
        )
        for k in range(2)
    ]
    addresses = [f"127.0.0.1:{s.port}" for s in shards]
    client = PSClient(addresses, rank=0, num_workers=2, incarnation=0, timeout=30.0)
    try:
        client.init(small_model(), {"name": "sgd", "lr": 0.1, "momentum": 0.9})
    finally:
        client.close()
    yield addresses
    for s in shards:
        s.stop(grace=0.5)


def localize(part: str, addresses: list[str]) -> str:
    """The docs' fixed addresses -> the cluster's; ``ps-launch`` capped at :data:`LAUNCH_STEPS` steps."""
    for k, address in enumerate(addresses):
        for doc_address in (f"127.0.0.1:{50051 + k}", f"ps-{k}:50051"):
            part = part.replace(doc_address, address)
    if part.startswith("ps-launch"):
        part = re.sub(r"--steps \d+", "", part).replace("ps-launch", f"ps-launch --steps {LAUNCH_STEPS}", 1)
    return part


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def run(command: str, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run ``command`` in a shell of its own; (exit status, output), or (None, output so far) when it
    ran past ``timeout`` seconds (then it and its children are killed)."""
    proc = subprocess.Popen(
        command,
        shell=True,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        return None, out


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_documented_commands_work(doc, cluster, tmp_path) -> None:
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PS_ADMIN_TOKEN": "docs-admin-token",  # the shards take no token: a header sent anyway is ignored
        "TMPDIR": str(tmp_path),
    }
    ran, skipped, failures = [], [], []
    start = time.monotonic()
    for c in commands(doc):
        for part in parts(c.text):
            why = skip_reason(part)
            if why:
                skipped.append(f"{c.doc}:{c.line}: {part} -- {why}")
                continue
            command = localize(part, cluster)
            expected = next((v for k, v in EXPECTED.items() if k in part), (0, ""))
            streaming = any(s in part for s in STREAMING)
            code, text = run(command, env, 4 if streaming else 120)
            if code is None:
                if not streaming:
                    failures.append(f"{c.doc}:{c.line}: {command}: timed out")
                    continue
                assert text, f"{command} printed nothing before it was stopped"
                code = 0
            ran.append(command)
            missing = [shown for shown in c.shows if _squeeze(shown) not in _squeeze(text)]
            if missing:
                failures.append(f"{c.doc}:{c.line}: {command}: the docs show {missing}, it printed:\n{text[-1500:]}")
            if code != expected[0] or expected[1] not in text:
                failures.append(f"{c.doc}:{c.line}: {command}: exit {code} (expected {expected[0]}):\n{text[-1500:]}")
    print(
        f"{doc}: ran {len(ran)} commands in {time.monotonic() - start:.0f} s; skipped by design:", *skipped, sep="\n  "
    )
    assert not failures, "\n\n".join(failures)
    assert ran
