"""What shards, workers and the admin tool share: the plan, the dtype table, frames, proto
conversions, errors with their reasons, mode settings, optimizer specs, channels, flags and the
process environment.

Layering (checked by import-linter contracts in ``pyproject.toml``): ``ps_common`` imports nothing
of ``ps_server``, ``ps_worker`` or ``ps_admin``; ``ps_worker`` and ``ps_admin`` import nothing of
``ps_server``. Importing this package imports no torch; its modules that need torch import it
themselves.
"""
