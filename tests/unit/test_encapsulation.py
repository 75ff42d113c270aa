"""No private member of another object is used in the library: ``X._name`` only where X is ``self`` or ``cls``.

A feature that needs a private member of another class is asking for a method on it (a shard's
lock is taken by the :class:`~ps_server.shard.shard.Shard` facade alone, never by a servicer).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ps_server", "ps_worker", "ps_common", "ps_launch", "ps_admin")

ALLOWED = {
    # RowIndex.of, an alternate constructor, fills the index it just made with cls()
    ("ps_server/tables/row_index.py", "index._main_ids"),
    ("ps_server/tables/row_index.py", "index._main_slots"),
    # torch and the standard library, where they offer no public way:
    # a round skipped for another rank's overflow marks this rank's GradScaler state as overflowed too
    ("ps_worker/optimizer.py", "self.grad_scaler._per_optimizer_states"),
    # a sparse embedding's weight leaves the module's parameters (the shards hold it)
    ("ps_worker/tables/modules.py", "m._parameters"),
    # a table's module.state_dict() gathers its rows, and load_state_dict() refuses them: torch's public
    # state-dict hooks do not see keep_vars (a keep_vars state_dict must not pull the whole table)
    ("ps_worker/tables/state.py", "module._save_to_state_dict"),
    ("ps_worker/tables/state.py", "module._load_from_state_dict"),
    # a step of DistributedOptimizer counts as the wrapped torch optimizer's for its lr schedulers
    ("ps_worker/optim_wrap.py", "o._opt_called"),
    # ps-worker exits without the interpreter's teardown racing gRPC's threads
    ("ps_worker/workloads/cli.py", "os._exit"),
    # ps-server, stopped and checkpointed, exits without the interpreter's final garbage collections
    ("ps_server/cli.py", "os._exit"),
    # which of ps-launch's own flags take a value, to split its argv from the script's
    ("ps_launch/target.py", "parser._option_string_actions"),
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


def test_the_library_uses_no_private_member_of_another_object() -> None:
    bad = []
    for path in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, expr in private_accesses(path.read_text(encoding="utf-8")):
            if (name, expr) not in ALLOWED:
                bad.append(f"{name}:{line}: {expr}")
    assert not bad, "private members used outside their owner (add a method to the owner):\n" + "\n".join(bad)
