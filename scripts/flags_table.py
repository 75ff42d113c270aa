"""Print the table of every command's flags and PS_* twins (from the parsers themselves);
``--write`` puts it in docs/flags.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ps_admin.cli import admin_parser
from ps_common.flags import FlagParser
from ps_launch.cli import launch_parser
from ps_server.config import server_parser
from ps_worker.workloads.cli import worker_parser


def parsers() -> dict[str, FlagParser]:
    """Every command's parser, read with an empty environment so defaults are the real ones."""
    return {
        "ps-server": server_parser({}),
        "ps-worker": worker_parser({}),
        "ps-launch": launch_parser({}),
        "ps-admin": admin_parser({}),
    }


def defaults_of(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Flag -> default, subcommands' flags included (``ps-admin top --interval``)."""
    found: dict[str, object] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= defaults_of(sub)
        elif action.option_strings:
            found[action.option_strings[0]] = action.default
    return found


def table() -> str:
    rows = ["| command | flag | environment twin | default | meaning |", "|---|---|---|---|---|"]
    for command, parser in parsers().items():
        defaults = defaults_of(parser)
        for flag, env, help_text in parser.twins:
            default = defaults.get(flag)
            shown = "—" if default in (None, "") else f"`{default}`"
            rows.append(f"| `{command}` | `{flag}` | `{env}` | {shown} | {help_text} |")
    return "\n".join(rows)


def write(page: Path) -> None:
    """Replace the table between the page's ``<!-- flags:begin -->`` and ``<!-- flags:end -->``."""
    text = page.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{table()}\n{END}{tail}")


BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
"""The page that holds the table."""

if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write(PAGE)
    else:
        print(table())
