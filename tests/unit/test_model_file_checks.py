"""A model file for ``--init-from`` (``ps_worker.model_file``) is checked before anything of it
is used: bounded loading, one ``ModelFileError`` line naming the file and the reason for every
malformed file, never a traceback."""

from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from ps_worker.model_file import ModelFileError, init_from


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.fc = nn.Linear(4, 3)


def saved(tmp_path: Path, change=None, name: str = "m.pt") -> str:
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in Model().state_dict().items()}
    if change is not None:
        change(state)
    path = tmp_path / name
    if name.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, path)
    else:
        torch.save(state, path)
    return str(path)


def test_a_good_file_loads_and_seeds_its_table(tmp_path: Path) -> None:
    model = Model()
    assert init_from(model, saved(tmp_path)) == ["emb.weight"]
    assert model.emb.ps_seed_rows[1].shape == (20, 4)


def as_double(s: dict) -> None:
    s["fc.weight"] = s["fc.weight"].double()


def shorter(s: dict) -> None:
    s["fc.weight"] = s["fc.weight"][:2]


def with_nan(s: dict) -> None:
    s["fc.bias"][1] = float("nan")


def table_twice(s: dict) -> None:
    s["emb.weight.ids"], s["emb.weight.rows"] = torch.tensor([1]), torch.zeros(1, 4)


def ids_alone(s: dict) -> None:
    s["emb.weight.ids"] = torch.tensor([1])
    del s["emb.weight"]


def nan_rows(s: dict) -> None:
    s["emb.weight"][3, 0] = float("inf")


def scalar_table(s: dict) -> None:
    s["emb.weight"] = torch.tensor(1.0)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (as_double, r"'fc.weight' is torch.float64 \[3, 4\], but the model's is torch.float32 \[3, 4\]"),
        (shorter, r"'fc.weight' is torch.float32 \[2, 4\], but the model's is torch.float32 \[3, 4\]"),
        (with_nan, "'fc.bias' holds NaN or infinite values"),
        (table_twice, r"table 'emb.weight' is given twice \(as a matrix and as emb.weight.ids\)"),
        (ids_alone, r"table 'emb.weight' has emb.weight.ids without its pair"),
        (nan_rows, "table 'emb.weight' holds NaN or infinite values"),
        (scalar_table, r"table 'emb.weight' is \[\], not \[20, 4\]"),
    ],
)
def test_a_file_unlike_the_model_is_refused_by_name(tmp_path: Path, change, says) -> None:
    path = saved(tmp_path, change)
    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModelFileError, match=f"^{path}: {says}") as refused:
        init_from(model, path)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded


def test_a_broken_or_bombed_file_is_one_line(tmp_path: Path) -> None:
    good = Path(saved(tmp_path)).read_bytes()
    cases = {
        "empty.pt": b"",
        "random.pt": os.urandom(4096),
        "torn.pt": good[: len(good) // 2],
        "protocol.pt": b"\x80\x49" + os.urandom(4094),  # torch warns about the pickle protocol, then refuses
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with (
            warnings.catch_warnings(record=True) as warned,
            pytest.raises(ModelFileError, match=rf"^{tmp_path / name}: does not load with torch.load") as refused,
        ):
            warnings.simplefilter("always")
            init_from(Model(), str(tmp_path / name))
        assert "\n" not in str(refused.value)
        assert not warned, [str(w.message) for w in warned]  # the refusal is the one line
    torch.save({"w": torch.zeros(4 << 20)}, tmp_path / "plain")
    with (
        zipfile.ZipFile(tmp_path / "plain") as z,
        zipfile.ZipFile(tmp_path / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as b,
    ):
        for info in z.infolist():
            b.writestr(info.filename, z.read(info.filename))
    with pytest.raises(ModelFileError, match=r"bomb.pt: declares 16.8 MB uncompressed in .* refused before loading"):
        init_from(Model(), str(tmp_path / "bomb.pt"))


def test_a_safetensors_file_is_checked_from_its_header(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    path = saved(tmp_path, as_double, "m.safetensors")
    with pytest.raises(ModelFileError, match=r"'fc.weight' is F64 \[3, 4\], but the model's is torch.float32"):
        init_from(Model(), path)
    (tmp_path / "junk.safetensors").write_bytes(os.urandom(256))
    with pytest.raises(ModelFileError, match="junk.safetensors: declares a header of"):
        init_from(Model(), str(tmp_path / "junk.safetensors"))
    good = Path(saved(tmp_path, None, "good.safetensors")).read_bytes()
    (tmp_path / "torn.safetensors").write_bytes(good[: len(good) - 8])
    with pytest.raises(ModelFileError, match="torn.safetensors: does not load as safetensors"):
        init_from(Model(), str(tmp_path / "torn.safetensors"))
