"""The wire contract: buf lint clean, generated code committed and up to date."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    gen = load_script("gen_proto")
    gen.generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "ps_proto").rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(ROOT) for p in (ROOT / "ps_proto").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == committed
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"regenerate with `python scripts/gen_proto.py`: {stale}"


def test_buf_lint_is_clean() -> None:
    buf = shutil.which("buf")
    if buf is None:
        pytest.fail("buf is not installed; `pip install -e .[dev]` provides it (buf-bin)")
    out = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_tensors_travel_as_bytes_never_repeated_float() -> None:
    lines = (ROOT / "proto" / "ps" / "v1" / "ps.proto").read_text().splitlines()
    text = "\n".join(line.split("//")[0] for line in lines)
    assert "repeated float" not in text and "repeated double" not in text
    assert "bytes data = 5;" in text
