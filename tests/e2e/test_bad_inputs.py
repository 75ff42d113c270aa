"""What a restart or a resume reads, as the commands see it (docs/faults.md): a reshard in place
beside a live shard, a crafted checkpoint, a malformed ``--init-from`` file. Each is one line on
stderr naming the file or the shard and the reason, a non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from tests.helpers.checkpoint_sets import job_states, write_set
from tests.helpers.processes import wait_for_listening

RESHARD = [sys.executable, "-m", "ps_admin.cli", "reshard"]
SERVER = [sys.executable, "-m", "ps_server.cli", "--num-workers", "1", "--port", "0", "--metrics-port", "-1"]


def one_line(out: subprocess.CompletedProcess[str], code: int, *says: str) -> str:
    err = out.stderr.strip()
    assert out.returncode == code, out.stderr[-2000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert all(s in err for s in says), err
    return err


def test_reshard_in_place_beside_a_running_shard_is_refused_until_it_dies(tmp_path: Path) -> None:
    write_set(tmp_path, job_states(2))
    shard = subprocess.Popen(  # shard 2 of a 3-shard job started early: nothing to resume, it holds its lock
        [*SERVER, "--shard-index", "2", "--num-shards", "3", "--checkpoint-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_listening(shard)
        before = sorted(p.name for p in tmp_path.glob("*.pt"))
        refused = subprocess.run(
            [*RESHARD, "--from", str(tmp_path), "--to", "3"], capture_output=True, text=True, timeout=120
        )
        one_line(refused, 1, "Shard 2 is running on", f"held by pid {shard.pid}", "stop every shard")
        assert sorted(p.name for p in tmp_path.glob("*.pt")) == before
        assert not any(p.name.startswith(("before-reshard", ".reshard")) for p in tmp_path.iterdir())
    finally:
        shard.send_signal(signal.SIGKILL)  # kill -9: the kernel drops its lock
        shard.wait(timeout=30)
    done = subprocess.run([*RESHARD, "--from", str(tmp_path), "--to", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "onto 3 shards in place" in done.stdout, done.stderr


def test_a_crafted_checkpoint_is_one_line_for_the_shard_and_for_reshard(tmp_path: Path) -> None:
    states = job_states(2)
    states[1]["tensors"][2] = states[1]["tensors"][2][:-1]  # valid digest, one element short
    write_set(tmp_path, states)
    reshard = subprocess.run(
        [*RESHARD, "--from", str(tmp_path), "--to", "3", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_line(reshard, 1, "Shard 1's checkpoint: parameter 'fc.weight' elements", "holds a tensor of shape [63]")
    assert not (tmp_path / "out").exists()
    shard = subprocess.run(
        [*SERVER, "--shard-index", "1", "--num-shards", "2", "--checkpoint-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # the shard logs (INFO) on stderr too; its refusal is its last line
    assert shard.returncode == 1 and "Traceback" not in shard.stderr, shard.stderr[-2000:]
    assert "ps-server: Shard 1's checkpoint: parameter 'fc.weight' elements" in shard.stderr.splitlines()[-1]


def test_a_bad_init_from_file_is_one_line_naming_the_file(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(4 << 20)}, tmp_path / "plain")
    with (
        zipfile.ZipFile(tmp_path / "plain") as z,
        zipfile.ZipFile(tmp_path / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as b,
    ):
        for info in z.infolist():
            b.writestr(info.filename, z.read(info.filename))
    (tmp_path / "random.pt").write_bytes(os.urandom(4096))
    # a pickle's protocol byte first: torch warns about it before it refuses the file (a random file does, at times)
    (tmp_path / "protocol.pt").write_bytes(b"\x80\x49" + os.urandom(4094))
    worker = [sys.executable, "-m", "ps_worker.workloads.cli", "digits", "--servers", "127.0.0.1:1", "--rank", "0"]
    unusable = "does not load with torch.load"
    cases = (("bomb.pt", "declares 16.8 MB uncompressed"), ("random.pt", unusable), ("protocol.pt", unusable))
    for name, says in cases:
        out = subprocess.run(
            [
                *worker,
                "--num-workers",
                "1",
                "--no-progress",
                "--metrics-port",
                "-1",
                "--init-from",
                str(tmp_path / name),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        one_line(out, 1, f"ps-worker rank 0: {tmp_path / name}: {says}")
