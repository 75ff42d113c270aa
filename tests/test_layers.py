"""The package layering: ps_common is neutral, workers and the admin tool never import the server."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    """The contracts in pyproject.toml's [tool.importlinter] hold (import-linter reads every import)."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports is not installed; pip install -e '.[dev]' provides it (import-linter)")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


@pytest.mark.parametrize("module", ["ps_admin.cli", "ps_common", "ps_common.modes", "ps_common.channels"])
def test_importing_leaves_torch_unloaded(module: str) -> None:
    """ps-admin and the neutral package's light modules start without loading torch."""
    code = f"import sys, {module}; print('torch' in sys.modules, 'ps_server' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


PACKAGES = ("ps_common", "ps_server", "ps_worker", "ps_launch", "ps_admin")
MAX_MODULE_LINES = 420
"""A module a newcomer reads in one sitting (docs/architecture.md#1-packages): about 400 lines."""
DISPLAY_MODULES = frozenset({"ps_launch/summary.py", "ps_admin/view.py", "ps_admin/cli.py"})
"""Modules that print a mode for people; the only places a mode may be compared by name."""


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_import_cycle_between_modules() -> None:
    """No module imports, directly or through others, a module that imports it (grimp's graph of
    every import, type-only and function-local ones included)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph(*PACKAGES, "ps_proto")
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                cycles.append(f"{module} <-> {imported}")
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_is_over_the_size_a_newcomer_reads() -> None:
    """Every module of the library stays under :data:`MAX_MODULE_LINES` lines."""
    big = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def _names_a_mode(node: ast.expr) -> bool:
    """A mode's name written out: ``"sync"``, ``ps_pb2.MODE_SSP`` (not ``MODE_UNSPECIFIED``)."""
    if isinstance(node, ast.Constant):
        return node.value in ("sync", "async", "ssp", "easgd")
    return isinstance(node, ast.Attribute) and node.attr.startswith("MODE_") and node.attr != "MODE_UNSPECIFIED"


def _is_mode(node: ast.expr) -> bool:
    return (node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")) == "mode"


def test_modes_are_asked_of_their_policy_not_compared_by_name() -> None:
    """No ``mode == "sync"``-style test outside display code: what a mode does is a question to its
    consistency policy (server) or worker mode (docs/architecture.md#5-consistency). Comparing
    two modes (did it change?) and checking that a request named one are not dispatch and pass."""
    found = []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        if rel in DISPLAY_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops
            ):
                sides = (node.left, *node.comparators)
                if any(map(_is_mode, sides)) and any(map(_names_a_mode, sides)):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, "modes compared by name: " + ", ".join(found)
