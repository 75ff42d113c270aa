"""Checkpoint store: atomic versioned files, keep-K pruning, corrupt files refused, optimizer state round trips,
failed writes named by their cause."""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ps_common.errors import CheckpointError
from ps_common.optimizer import OPTIMIZERS, OptimizerSpec
from ps_server.checkpoint import files as checkpoint_module
from ps_server.checkpoint.files import FORMAT, FORMAT_VERSION, CheckpointStore, digest, failure_reason
from tests.helpers.compare import assert_identical, bits

LOGGER = "ps_server.checkpoint.files"


def shard_state(version: int, seed: int = 0) -> dict[str, Any]:
    """A state shaped like a shard's: plan, partitions, an Adam optimizer after two steps, members."""
    g = torch.Generator().manual_seed(seed * 1000 + version)
    tensors = [torch.randn(n, generator=g) for n in (1000, 37, 1)]
    tensors[1][3] = float("nan")  # bitwise equality must hold for NaN payloads too
    spec = OptimizerSpec("adam", {"lr": 0.01, "beta1": 0.8, "amsgrad": 1})
    params = [t.clone() for t in tensors]
    opt = spec.build(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with torch.no_grad():
            opt.step()
    return {
        "plan": {
            "specs": [["fc1.weight", [25, 40], "float32"], ["fc1.bias", [37], "float32"], ["scale", [], "float32"]],
            "num_shards": 2,
            "partition_bytes": 4 * 2**20,
            "digest": "ab" * 32,
        },
        "tensors": tensors,
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "counts": torch.tensor([1, -2, 2**40], dtype=torch.int64),
        "optimizer": {"name": spec.name, "kwargs": dict(spec.kwargs)},
        "optimizer_state": opt.state_dict(),
        "members": [
            {"rank": 0, "incarnation": 3, "clock": version, "state": "live"},
            {"rank": 1, "incarnation": 0, "clock": version - 1, "state": "evicted", "note": None},
        ],
        "settings": {"mode": "sync", "sync_quorum": 0, "round_timeout": 2.5, "insecure": False},
    }


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", shard_index=0, keep=3)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# -- round trip and layout ---------------------------------------------------------------------


def test_round_trip_is_bitwise_and_file_is_named_by_version(store: CheckpointStore) -> None:
    state = shard_state(12)
    path = store.save(state, 12)
    assert path == store.directory / "shard-0-v000000000012.pt"
    assert names(store.directory) == ["shard-0-v000000000012.pt"]  # no temp file left
    version, loaded = store.load_latest()
    assert version == 12 and store.latest_version() == 12
    assert_identical(loaded, state)
    assert_identical(store.load(12), state)
    assert all(t.device.type == "cpu" for t in loaded["tensors"])


def test_on_disk_envelope_loads_with_weights_only_and_carries_its_digest(store: CheckpointStore) -> None:
    path = store.save({"w": torch.ones(3)}, 7)
    raw = torch.load(path, weights_only=True, map_location="cpu")
    assert list(raw) == ["format", "format_version", "shard_index", "version", "state", "sha256"]
    assert (raw["format"], raw["format_version"], raw["shard_index"], raw["version"]) == (FORMAT, FORMAT_VERSION, 0, 7)
    body = {k: raw[k] for k in ("format", "format_version", "shard_index", "version", "state")}
    assert raw["sha256"] == digest(body) and len(raw["sha256"]) == 64
    assert path.stat().st_mode & 0o077 == 0  # only the owner reads a model's weights


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"s": {1, 2}}, r"^state\['s'\] is a builtins.set; a checkpoint holds only tensors"),
        ({"m": [torch.nn.Linear(1, 1)]}, r"^state\['m'\]\[0\] is a torch.nn.modules.linear.Linear"),
        ({frozenset({1}): 1}, r"^a key of state\[frozenset\(\{1\}\)\] is a builtins.frozenset"),
    ],
)
def test_state_that_weights_only_cannot_load_is_refused_before_writing(
    store: CheckpointStore, state: dict, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        store.save(state, 1)
    assert not store.directory.exists() or names(store.directory) == []


@pytest.mark.parametrize("version", [-1, 1.0, True, "3"])
def test_bad_version_is_refused(store: CheckpointStore, version: object) -> None:
    with pytest.raises(ValueError, match="version must be an int >= 0"):
        store.save({}, version)  # type: ignore[arg-type]


def test_bad_store_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shard_index"):
        CheckpointStore(tmp_path, shard_index=-1)
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, shard_index=0, keep=0)


# -- pruning, other shards, temp files ------------------------------------------------------------


def test_keeps_the_newest_k(store: CheckpointStore) -> None:
    for v in range(1, 7):
        store.save({"v": torch.tensor(v)}, v)
        assert [c.version for c in store.checkpoints()] == list(range(max(1, v - 2), v + 1))
    assert names(store.directory) == [f"shard-0-v{v:012d}.pt" for v in (4, 5, 6)]


def test_keep_one_keeps_the_one_just_written(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, 0, keep=1)
    for v in (5, 9):
        store.save({}, v)
    assert [c.version for c in store.checkpoints()] == [9]


def test_higher_versions_of_an_abandoned_run_are_removed_with_a_warning(
    store: CheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    for v in (5, 6, 7):
        store.save({"v": v}, v)
    restarted = CheckpointStore(store.directory, 0, keep=3)  # this shard resumed from an older checkpoint
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        restarted.save({"v": 3}, 3)
    assert [c.version for c in restarted.checkpoints()] == [3]
    assert restarted.load_latest() == (3, {"v": 3})
    assert sum("abandoned" in r.getMessage() for r in caplog.records) == 3


def test_a_newer_checkpoint_this_store_wrote_is_kept_until_keep_newer_exist(
    store: CheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    """An out-of-order save (an older snapshot written after a newer one) never removes the newer
    checkpoint as "abandoned": only keep-pruning removes what this store wrote."""
    store.save({"v": 1}, 1)
    store.save({"v": 9}, 9)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store.save({"v": 4}, 4)
    assert [c.version for c in store.checkpoints()] == [1, 4, 9]
    assert not [r for r in caplog.records if "abandoned" in r.getMessage()]
    store.save({"v": 10}, 10)
    assert [c.version for c in store.checkpoints()] == [4, 9, 10]
    store.save({"v": 2}, 2)  # older than the 3 newest: pruned at once, the newer ones stay
    assert [c.version for c in store.checkpoints()] == [4, 9, 10]
    assert store.load_latest() == (10, {"v": 10})


def test_writers_killed_in_a_row_after_the_rename_leave_at_most_keep_plus_one(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer killed between its rename and its prune leaves keep + 1 checkpoints; the next writer,
    killed at the same point, still leaves keep + 1: a save first removes what it would prune anyway."""
    for v in (1, 2, 3, 4):
        store.save({"v": v}, v)
    assert [c.version for c in store.checkpoints()] == [2, 3, 4]
    monkeypatch.setattr(CheckpointStore, "_prune", lambda self, written: None)  # killed right after the rename
    for v in (5, 6, 7):
        CheckpointStore(store.directory, 0, keep=3).save({"v": v}, v)  # a restarted writer each time
        assert [c.version for c in store.checkpoints()] == [v - 3, v - 2, v - 1, v]


def test_other_shards_files_are_never_touched(tmp_path: Path) -> None:
    shard0, shard1, shard10 = (CheckpointStore(tmp_path, k, keep=1) for k in (0, 1, 10))
    shard1.save({"k": 1}, 100)
    shard10.save({"k": 10}, 200)
    foreign_temp = tmp_path / ".shard-1-v000000000101.pt.abc123.tmp"
    foreign_temp.write_bytes(b"torn")
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("mine")
    for v in range(1, 4):
        shard0.save({"k": 0}, v)
    assert names(tmp_path) == [
        ".shard-1-v000000000101.pt.abc123.tmp",
        "notes.txt",
        "shard-0-v000000000003.pt",
        "shard-1-v000000000100.pt",
        "shard-10-v000000000200.pt",
    ]
    assert shard1.load_latest() == (100, {"k": 1}) and shard10.load_latest() == (200, {"k": 10})
    assert [c.version for c in shard0.checkpoints()] == [3]


def test_leftover_temp_files_are_removed_on_open_and_on_save(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, 0)
    store.save({"v": 1}, 1)
    torn = tmp_path / ".shard-0-v000000000002.pt.k3j4h5.tmp"
    torn.write_bytes(store.path_for(1).read_bytes()[:100])
    CheckpointStore(tmp_path, 0)  # a restarted shard opens the directory
    assert names(tmp_path) == ["shard-0-v000000000001.pt"]
    torn.write_bytes(b"x" * 10)
    store.save({"v": 2}, 2)
    assert names(tmp_path) == ["shard-0-v000000000001.pt", "shard-0-v000000000002.pt"]


def test_files_not_named_by_the_store_are_ignored(store: CheckpointStore) -> None:
    store.save({"v": 1}, 1)
    shutil.copy(store.path_for(1), store.directory / "shard-0-v2.pt")  # not the store's spelling
    shutil.copy(store.path_for(1), store.directory / "shard-0-v000000000003.pt.bak")
    assert [c.version for c in store.checkpoints()] == [1]


def test_empty_or_missing_directory_has_no_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "missing", 0)
    assert store.load_latest() is None and store.latest_version() is None and store.checkpoints() == []
    assert not (tmp_path / "missing").exists()  # reading creates nothing


# -- corrupt and mismatched files ----------------------------------------------------------------


def two_versions(store: CheckpointStore) -> tuple[dict[str, Any], Path]:
    """Save versions 1 and 2; return version 1's state and version 2's path."""
    state1 = shard_state(1)
    store.save(state1, 1)
    return state1, store.save(shard_state(2), 2)


def falls_back(
    store: CheckpointStore, state1: dict[str, Any], caplog: pytest.LogCaptureFixture, bad: Path, to: int = 1
) -> str:
    """load_latest() returns version ``to`` with ``state1`` and warns once, about ``bad``; returns the warning."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        version, state = store.load_latest()
    assert version == to
    assert_identical(state, state1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(bad) in warnings[0], warnings
    return warnings[0]


def test_truncated_newest_falls_back_with_a_warning(store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    state1, path2 = two_versions(store)
    whole = path2.read_bytes()
    cuts = sorted({*range(0, len(whole), max(1, len(whole) // 40)), len(whole) - 1, len(whole) - 22, len(whole) // 2})
    for cut in cuts:  # a torn write of any length never loads
        path2.write_bytes(whole[:cut])
        assert "does not load" in falls_back(store, state1, caplog, path2), cut
    with pytest.raises(CheckpointError, match="does not load"):
        store.load(2)


def test_flipped_byte_in_tensor_data_fails_the_digest(store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    state1 = shard_state(1)
    store.save(state1, 1)
    marker = torch.full((64,), 1234.5)
    path2 = store.save({"marker": marker}, 2)
    data = bytearray(path2.read_bytes())
    at = bytes(data).find(bits(marker).numpy().tobytes())
    assert at > 0
    data[at + 100] ^= 0x01
    path2.write_bytes(bytes(data))
    assert "sha256" in falls_back(store, state1, caplog, path2)


def test_any_single_flipped_byte_never_loads_wrong(store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    state1, path2 = two_versions(store)
    state2 = store.load(2)
    whole = path2.read_bytes()
    outcomes = {"refused": 0, "harmless": 0}
    for at in range(0, len(whole), max(1, len(whole) // 120)):
        data = bytearray(whole)
        data[at] ^= 0xFF
        path2.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            version, state = store.load_latest()
        # A flip in bytes nobody reads (zip timestamps, padding) may load: then it must load exactly right.
        assert_identical(state, state2 if version == 2 else state1, f"flip at byte {at}")
        outcomes["harmless" if version == 2 else "refused"] += 1
    assert outcomes["refused"] > outcomes["harmless"], outcomes


def test_version_inside_must_match_the_file_name(store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    _, path2 = two_versions(store)
    bad = store.path_for(9)
    shutil.copy(path2, bad)  # a file renamed by hand
    assert "holds version 2 but its file name says 9" in falls_back(store, store.load(2), caplog, bad, to=2)
    with pytest.raises(CheckpointError, match="holds version 2 but its file name says 9"):
        store.load(9)


def test_another_shards_file_under_this_shards_name_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, 0)
    state1 = shard_state(1)
    store.save(state1, 1)
    CheckpointStore(tmp_path / "other", 1).save({"k": 1}, 2)
    bad = store.path_for(2)
    shutil.copy(tmp_path / "other" / "shard-1-v000000000002.pt", bad)
    assert "belongs to shard 1, not shard 0" in falls_back(store, state1, caplog, bad)


class Payload:
    """A class ``torch.load(weights_only=True)`` must refuse to rebuild."""

    def __reduce__(self) -> tuple:
        return (print, ("executed",))


def test_a_file_with_pickled_code_is_refused(store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    state1 = shard_state(1)
    store.save(state1, 1)
    bad = store.path_for(2)
    torch.save({"format": FORMAT, "format_version": 1, "shard_index": 0, "version": 2, "state": {"x": Payload()}}, bad)
    assert "weights_only" in falls_back(store, state1, caplog, bad)


def test_a_torch_file_of_another_kind_is_refused(store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    state1 = shard_state(1)
    store.save(state1, 1)
    bad = store.path_for(2)
    torch.save({"model": torch.ones(2)}, bad)
    assert f"is not a {FORMAT} file" in falls_back(store, state1, caplog, bad)


def test_checkpoints_that_all_fail_raise_instead_of_starting_over(store: CheckpointStore) -> None:
    for v in (1, 2):
        store.save({"v": v}, v)
        store.path_for(v).write_bytes(b"")
    with pytest.raises(CheckpointError, match="None of the 2 checkpoints of shard 0 .* is valid"):
        store.load_latest()


def test_load_of_a_missing_version_names_the_ones_there(store: CheckpointStore) -> None:
    store.save({}, 4)
    with pytest.raises(CheckpointError, match=r"no checkpoint at version 5 .*\(versions there: 4\)"):
        store.load(5)


# -- unwritable directories ------------------------------------------------------------------------


@pytest.mark.parametrize(("under", "reason"), [("file/ckpt", "Not a directory"), ("file", "File exists")])
def test_a_directory_that_is_or_lies_under_a_file_is_a_clear_error(tmp_path: Path, under: str, reason: str) -> None:
    (tmp_path / "file").write_text("")
    store = CheckpointStore(tmp_path / under, 0)
    expected = rf"^Cannot create checkpoint directory {tmp_path / under}: {reason}; make it a directory writable by"
    for call in (lambda: store.save({"w": torch.ones(1)}, 1), store.ensure_writable):
        with pytest.raises(CheckpointError, match=expected):
            call()


def unprivileged(call: Callable[[], object], timeout: float = 30.0) -> str:
    """Run ``call`` in a forked child as uid/gid 65534 (root ignores permission bits, so a test run
    as root checks this way); returns ``"TypeName: message"`` of what it raised, or ``"no error"``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            try:
                call()
                outcome = "no error"
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            os.write(write_end, outcome.encode()[:60000])
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the unprivileged child did not finish within {timeout} s")
        time.sleep(0.01)
    with os.fdopen(read_end, "rb") as f:
        return f.read().decode()


def test_a_read_only_directory_is_a_clear_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", 0)
    store.save({"v": 1}, 1)
    store.directory.chmod(0o555)
    try:
        expected = r"CheckpointError: Cannot (write|create) .*: Permission denied; make it a directory writable"
        if os.geteuid() == 0:
            outcomes = [unprivileged(lambda: store.save({"v": 2}, 2)), unprivileged(store.ensure_writable)]
        else:
            outcomes = []
            for call in (lambda: store.save({"v": 2}, 2), store.ensure_writable):
                with pytest.raises(CheckpointError) as info:
                    call()
                outcomes.append(f"CheckpointError: {info.value}")
        for outcome in outcomes:
            assert re.match(expected, outcome), outcome
        assert store.load_latest() == (1, {"v": 1})
        assert names(store.directory) == ["shard-0-v000000000001.pt"]
    finally:
        store.directory.chmod(0o755)


def test_ensure_writable_creates_the_directory_and_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "a" / "b", 0)
    store.ensure_writable()
    assert names(tmp_path / "a" / "b") == []


def test_a_failed_write_leaves_no_temp_file(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.save({"v": 1}, 1)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device; free some space"):
        store.save({"v": 2}, 2)
    assert names(store.directory) == ["shard-0-v000000000001.pt"]


def test_concurrent_saves_from_threads_all_land(store: CheckpointStore) -> None:
    errors: list[BaseException] = []

    def save(v: int) -> None:
        try:
            store.save({"v": torch.full((1000,), float(v))}, v)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(v,)) for v in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(store.checkpoints()) <= 3 and not [n for n in names(store.directory) if n.endswith(".tmp")]
    version, state = store.load_latest()
    assert torch.equal(state["v"], torch.full((1000,), float(version)))


def test_a_second_store_on_the_same_shard_does_not_break_a_save_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path, 0)
    written, release = threading.Event(), threading.Event()
    real_save = torch.save

    def save_then_hold(obj: object, f: Any) -> None:
        real_save(obj, f)
        written.set()
        assert release.wait(10)

    monkeypatch.setattr(torch, "save", save_then_hold)
    errors: list[BaseException] = []

    def save() -> None:
        try:
            store.save({"v": 1}, 1)
        except BaseException as exc:
            errors.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    assert written.wait(10), "the save did not reach its temp file"
    opener = threading.Thread(target=CheckpointStore, args=(tmp_path, 0))  # would remove the temp file
    opener.start()
    opener.join(0.5)  # give it the chance to; it must wait for the save instead
    assert opener.is_alive()
    release.set()
    saver.join(10)
    opener.join(10)
    assert not saver.is_alive() and not opener.is_alive() and not errors, errors
    assert store.load_latest() == (1, {"v": 1})


# -- optimizer state ---------------------------------------------------------------------------------

OPTIMIZER_KWARGS = {
    "sgd": {"lr": 0.1, "momentum": 0.9, "nesterov": 1, "weight_decay": 0.01},
    "adam": {"lr": 0.01, "amsgrad": 1},
    "adamw": {"lr": 0.01, "weight_decay": 0.1},
    "adagrad": {"lr": 0.1, "lr_decay": 0.01},
    "rmsprop": {"lr": 0.01, "momentum": 0.9, "centered": 1},
    "adadelta": {"lr": 1.0, "rho": 0.8, "weight_decay": 0.01},
    "adamax": {"lr": 0.01, "beta1": 0.8},
    "nadam": {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": 1},
    "radam": {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": 1},
    "asgd": {"lr": 0.01, "t0": 1},
    "rprop": {"lr": 0.01, "eta_minus": 0.4, "step_size_max": 1.0},
}


def step(opt: torch.optim.Optimizer, params: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    with torch.no_grad():
        opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_round_trips_through_weights_only(store: CheckpointStore, name: str) -> None:
    assert set(OPTIMIZER_KWARGS) == set(OPTIMIZERS)
    spec = OptimizerSpec(name, OPTIMIZER_KWARGS[name])
    g = torch.Generator().manual_seed(7)
    params = [torch.randn(n, generator=g) for n in (5, 17, 3)]
    opt = spec.build(params)
    step(opt, params, 1)
    step(opt, params, 2)
    store.save({"tensors": params, "optimizer": {"name": name}, "optimizer_state": opt.state_dict()}, 2)

    _, loaded = store.load_latest()
    fresh = [torch.zeros(n) for n in (5, 17, 3)]
    for f, t in zip(fresh, loaded["tensors"], strict=True):
        f.copy_(t)
    resumed = spec.build(fresh)
    resumed.load_state_dict(loaded["optimizer_state"])
    assert_identical(resumed.state_dict(), opt.state_dict())

    step(opt, params, 3)
    step(resumed, fresh, 3)
    for p, f in zip(params, fresh, strict=True):
        assert torch.equal(bits(p), bits(f))
    assert_identical(resumed.state_dict(), opt.state_dict())


# -- failed writes: the cause by name ------------------------------------------------------------


class FillingFile(io.RawIOBase):
    """A file on a disk with ``room`` bytes free: a write past it fails with ENOSPC, as the kernel's."""

    def __init__(self, raw: io.FileIO, room: int) -> None:
        self._raw, self._room = raw, room

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._raw.write(data)

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()
        super().close()


def fill_disk(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Make checkpoint file writes fail with ENOSPC: an OSError injected at the file-write layer once
    4 KiB are written (the header fits, the tensor data does not: torch then raises its "unexpected
    pos N vs M" with the OSError as context, and the file closes cleanly), or the kernel's /dev/full."""
    if how == "injected":
        real_fdopen = os.fdopen
        monkeypatch.setattr(
            os, "fdopen", lambda fd, mode: io.BufferedWriter(FillingFile(real_fdopen(fd, mode, buffering=0), 4096))
        )
        return
    if not Path("/dev/full").is_char_device():
        pytest.skip("/dev/full is not available here")
    real_mkstemp = tempfile.mkstemp

    def mkstemp(**kw: Any) -> tuple[int, str]:
        fd, name = real_mkstemp(**kw)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(checkpoint_module, "tempfile", SimpleNamespace(mkstemp=mkstemp))


@pytest.mark.parametrize("how", ["injected", "dev_full"])
def test_a_full_disk_says_no_space_left_on_device(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """torch reports a failed write as "unexpected pos N vs M"; the error names the OSError behind it."""
    store.save({"v": torch.ones(10)}, 1)
    fill_disk(monkeypatch, how)
    with pytest.raises(CheckpointError) as info:
        store.save({"v": torch.ones(100_000)}, 2)
    message = str(info.value)
    assert "No space left on device; free some space or pass another --checkpoint-dir" in message, message
    assert "unexpected pos" not in message
    assert failure_reason(info.value) == "no_space"
    monkeypatch.undo()
    assert names(store.directory) == ["shard-0-v000000000001.pt"]
    assert store.load_latest()[0] == 1
