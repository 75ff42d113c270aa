"""The flags table (docs/flags.md) is generated from the parsers and must not drift from them; the
README's quickstart keeps its two commands."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_flags_table_is_current() -> None:
    module = load_script("flags_table")
    page = (ROOT / "docs" / "flags.md").read_text()
    current = page.split("<!-- flags:begin -->\n", 1)[1].split("\n<!-- flags:end -->", 1)[0]
    assert current == module.table(), "regenerate the table with `python scripts/flags_table.py --write`"


def test_quickstart_has_the_two_commands() -> None:
    quickstart = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "ps-launch --shards 2 --workers 2 --mode sync digits" in quickstart
    assert "bash .ci/run" in quickstart
