"""No private member of another object is used in ps_server: ``X._name`` only where X is ``self`` or ``cls``.

A feature that needs a private member of another class is asking for a method on it (a shard's
lock is taken by the :class:`~ps_server.shard.shard.Shard` facade alone, never by a servicer).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ps_server"

ALLOWED = {
    # RowIndex.of, an alternate constructor, fills the index it just made with cls()
    ("ps_server/tables/row_index.py", "index._main_ids"),
    ("ps_server/tables/row_index.py", "index._main_slots"),
}


def private_accesses(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each ``X._name`` in ``source`` where X is not ``self``/``cls`` (dunders allowed)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_sees_private_members_of_others_only() -> None:
    source = "self._a\ncls._b\nx.__class__\nother._c\nself.shard._cond\nf()._d\n"
    assert private_accesses(source) == [(4, "other._c"), (5, "self.shard._cond"), (6, "f()._d")]


def test_ps_server_uses_no_private_member_of_another_object() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, expr in private_accesses(path.read_text(encoding="utf-8")):
            if (name, expr) not in ALLOWED:
                bad.append(f"{name}:{line}: {expr}")
    assert not bad, "private members used outside their owner (add a method to the owner):\n" + "\n".join(bad)
