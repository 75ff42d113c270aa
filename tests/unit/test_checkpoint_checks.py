"""What a restore and ``ps-admin reshard`` check before they use a checkpoint set
(``ps_server.checkpoint.checks``, ``.dirlock``, ``ps_common.bounded_load``): every tensor against the
plan, refused by name; no reshard in place beside a running shard; ``--to`` bounded; a deflate bomb
refused before it inflates."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ps_common.bounded_load import check_zip, safetensors_header
from ps_common.errors import CheckpointError
from ps_server.checkpoint import dirlock
from ps_server.checkpoint.format import read
from ps_server.checkpoint.reshard import MAX_SHARDS, ReshardError, reshard_states
from ps_server.checkpoint.reshard_cli import main, reshard_directory
from ps_server.shard.state import load_state
from tests.helpers.checkpoint_sets import VERSION, job_states, write_set


def crafted(change) -> list[dict]:
    states = job_states(2)
    change(states)
    return states


def cut_short(states: list[dict]) -> None:
    states[1]["tensors"][2] = states[1]["tensors"][2][:-1]


def nan_value(states: list[dict]) -> None:
    states[1]["tensors"][0][3] = float("nan")


def other_dtype(states: list[dict]) -> None:
    states[0]["tensors"][1] = states[0]["tensors"][1].double()


def short_moment(states: list[dict]) -> None:
    entry = states[0]["optimizer_state"]["state"][0]
    entry["exp_avg"] = entry["exp_avg"][:-2]


def inf_moment(states: list[dict]) -> None:
    states[1]["optimizer_state"]["state"][1]["exp_avg_sq"][0] = float("inf")


def one_tensor_less(states: list[dict]) -> None:
    states[1]["tensors"].pop()


def no_mode(states: list[dict]) -> None:
    del states[1]["mode"]


def bad_member(states: list[dict]) -> None:
    states[0]["members"][0]["clock"] = "five"


def unknown_optimizer(states: list[dict]) -> None:
    states[0]["optimizer"]["name"] = "nope"


def other_groups(states: list[dict]) -> None:
    states[1]["optimizer_state"]["param_groups"] = []


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            cut_short,
            r"Shard 1's checkpoint: parameter 'fc.weight' elements \[\d+, \d+\) holds a tensor of shape \[63\]",
        ),
        (nan_value, r"Shard 1's checkpoint: parameter 'fc.weight' elements \[\d+, \d+\) holds NaN"),
        (other_dtype, r"Shard 0's checkpoint: parameter 'fc.weight' .* is torch.float64, but the parameter is"),
        (short_moment, r"Shard 0's checkpoint: the optimizer state 'exp_avg' of parameter 'fc.weight' .* 62 values"),
        (inf_moment, r"Shard 1's checkpoint: the optimizer state 'exp_avg_sq' .* NaN or infinite"),
        (one_tensor_less, r"Shard 1's checkpoint holds \d+ parameter tensors, but the plan gives it \d+ partitions"),
        (no_mode, r"Shard 1's checkpoint's mode is nothing; a shard writes a str"),
        (bad_member, r"Shard 0's checkpoint's members\[0\] lacks an int rank, incarnation, clock, pushes"),
        (unknown_optimizer, r"Shard 0's checkpoint's optimizer is refused: Unknown optimizer 'nope'"),
        (other_groups, r"Shard 1's checkpoint's optimizer state does not load \(loaded state dict has a different"),
    ],
)
def test_a_crafted_state_is_refused_by_name_by_reshard_and_by_restore(change, says) -> None:
    states = crafted(change)
    with pytest.raises(ReshardError, match=says):
        reshard_states(states, 3)
    if change is not no_mode:  # restore reads each shard's own state
        k = 0 if change in (other_dtype, short_moment, bad_member, unknown_optimizer) else 1
        with pytest.raises(CheckpointError, match=says):
            load_state(states[k], k, 2)


def test_a_valid_set_passes_every_check() -> None:
    states = job_states(2)
    for k, state in enumerate(states):
        load_state(state, k, 2)
    assert len(reshard_states(states, 3)) == 3


def test_a_crafted_table_is_refused_by_name() -> None:
    states = job_states(1)
    table = {
        "spec": {
            "name": "emb.weight",
            "num_rows": 10,
            "dim": 4,
            "seed": 0,
            "init_std": 0.01,
            "optimizer": "adagrad",
            "optimizer_kwargs": {"lr": 0.1},
        },
        "ids": torch.tensor([1, 3]),
        "values": torch.zeros(2, 4),
        "state": {"sum": torch.zeros(2, 4)},
        "step": 0,
    }
    states[0]["tables"] = {"version": 0, "tables": [table], "high_water": [], "hyperparameters": {}}
    load_state(states[0], 0, 1)  # as it is: valid
    for key, value, says in [
        ("spec", {"name": "emb.weight", "num_rows": 10, "dim": 4}, r"its spec is refused \(KeyError: 'optimizer'\)"),
        ("values", torch.zeros(2, 3), r"its rows are \[2, 3\] torch.float32, not float32 \[2, 4\]"),
        ("ids", torch.tensor([1, 10]), r"a row id is out of \[0, 10\)"),
        ("ids", torch.tensor([3, 3]), "a row id appears twice"),
        ("values", torch.full((2, 4), float("nan")), "its rows hold NaN"),
        ("state", {"sum": torch.zeros(1, 4)}, "its row-optimizer state 'sum' is not of 2 rows"),
    ]:
        bad = copy.deepcopy(states)
        bad[0]["tables"]["tables"][0][key] = value
        with pytest.raises(CheckpointError, match=f"table 'emb.weight': {says}"):
            load_state(bad[0], 0, 1)


def test_reshard_to_is_bounded_before_planning(tmp_path: Path) -> None:
    write_set(tmp_path, job_states(2))
    with pytest.raises(ReshardError, match=f"a plan holds at most {MAX_SHARDS}"):
        reshard_directory(tmp_path, 1_000_000_000, tmp_path / "out")
    with pytest.raises(
        ReshardError, match="this job holds 528 parameter elements and 0 table rows; give --to at most 528"
    ):
        reshard_directory(tmp_path, 600, tmp_path / "out")
    with pytest.raises(SystemExit) as usage:
        main(["--from", str(tmp_path), "--to", "1000000000"])
    assert usage.value.code == 2 and not (tmp_path / "out").exists()


def test_reshard_warns_of_newer_incomplete_versions_it_sets_aside(tmp_path: Path, caplog) -> None:
    write_set(tmp_path, job_states(2))
    write_set(tmp_path, job_states(2, version=9)[:1], version=9)  # shard 0 ran on alone
    with caplog.at_level(logging.WARNING, logger="ps_server.checkpoint.reshard_cli"):
        line = reshard_directory(tmp_path, 3, tmp_path / "out")
    assert f"resharded version {VERSION}" in line
    assert "newer versions with only some shards' files are set aside (v9: shards [0])" in caplog.text


def test_a_crafted_file_on_disk_is_one_line_and_exit_1(tmp_path: Path, capsys) -> None:
    write_set(tmp_path, crafted(cut_short))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["--from", str(tmp_path), "--to", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parameter 'fc.weight'" in err and "Traceback" not in err
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.endswith(".lock")}
    assert after == before  # nothing moved, nothing written (the shards' lock files are made, empty)


def test_reshard_in_place_refuses_while_a_shard_holds_the_directory(tmp_path: Path) -> None:
    write_set(tmp_path, job_states(2))
    lock = dirlock.hold(tmp_path, 1, wait=0)  # a shard of this process
    assert lock is not None
    with pytest.raises(
        ReshardError, match=r"Shard 1 is running on .* \(shard-1.lock is held by a shard of this process\)"
    ):
        reshard_directory(tmp_path, 3)
    lock.release()
    holder = subprocess.Popen(  # another process, as a running ps-server holds it
        [sys.executable, "-c", HOLDER, str(tmp_path / "shard-0.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ReshardError, match=rf"Shard 0 is running .* held by pid {holder.pid}\): stop every shard"):
            reshard_directory(tmp_path, 3)
        assert dirlock.hold(tmp_path, 0, wait=0) is None  # a second shard 0 does not get it either
    finally:
        holder.kill()  # kill -9 releases the lock
        holder.wait(timeout=10)
    assert "onto 3 shards in place" in reshard_directory(tmp_path, 3)


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(60)
"""


def test_shard_locks_of_one_process_are_shared_and_released_by_the_last_holder(tmp_path: Path) -> None:
    first, second = dirlock.hold(tmp_path, 0), dirlock.hold(tmp_path, 0)
    assert first is not None and second is not None
    first.release()
    first.release()  # once only
    with pytest.raises(CheckpointError, match="held by a shard of this process"):
        with dirlock.take_all(tmp_path, [0]):
            pass
    second.release()
    with dirlock.take_all(tmp_path, [0, 1]):
        assert (tmp_path / "shard-1.lock").exists()


def bomb(path: Path, size: int) -> None:
    plain = path.with_suffix(".plain")
    torch.save({"w": torch.zeros(size // 4)}, plain)
    with zipfile.ZipFile(plain) as z, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for info in z.infolist():
            out.writestr(info.filename, z.read(info.filename))
    plain.unlink()


def test_a_deflate_bomb_is_refused_before_it_inflates(tmp_path: Path) -> None:
    bomb(tmp_path / "shard-0-v000000000005.pt", 16 << 20)
    problem = check_zip(tmp_path / "shard-0-v000000000005.pt")
    assert problem is not None and "declares 16.8 MB uncompressed in" in problem
    state, why = read(tmp_path / "shard-0-v000000000005.pt", 0, 5)
    assert state == {} and why == problem
    assert check_zip(tmp_path / "shard-0-v000000000005.pt", expected_bytes=16 << 20) is None  # as big as the model
    torch.save({"w": torch.zeros(1 << 20)}, tmp_path / "plain.pt")  # torch.save stores: never refused
    assert check_zip(tmp_path / "plain.pt") is None


def test_a_safetensors_header_is_read_alone_and_checked(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3, 2, dtype=torch.float64)}, tmp_path / "m.safetensors")
    header = safetensors_header(tmp_path / "m.safetensors")
    assert header["w"]["dtype"] == "F64" and header["w"]["shape"] == [3, 2]
    (tmp_path / "junk.safetensors").write_bytes(os.urandom(64))
    with pytest.raises(ValueError, match="declares a header of .* not a safetensors file"):
        safetensors_header(tmp_path / "junk.safetensors")


def test_without_flock_a_shard_runs_unlocked_and_reshard_is_not_stopped(tmp_path: Path, monkeypatch) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(37, "No locks available")  # ENOLCK: a network file system without flock

    monkeypatch.setattr(dirlock.fcntl, "flock", no_locks)
    assert dirlock.hold(tmp_path, 0) is None
    with dirlock.take_all(tmp_path, [0, 1]):
        pass
