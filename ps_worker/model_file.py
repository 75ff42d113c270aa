"""Start a model from a model file (``ps-admin export``, ``ps-launch --save``): ``ps-worker
--init-from PATH`` and scripts (docs/operations.md#start-a-job-from-a-model-file).

The file's dense parameters and buffers are loaded into the model **before** ``client.init``, so
rank 0 sends them to the shards as the job's initial values (the other ranks pull them). Its
embedding tables are imported too: each table's rows (``emb.weight`` [num_rows, dim], or
``emb.weight.ids``/``.rows`` for a hashed table) are kept on the table's module, and rank 0's
``client.init`` seeds them on the shards (InitTables' rows, ``ps_worker.tables.seed``) before its
dense Init; rows equal to their deterministic initial value (``ps_common.tables.initial_rows``)
need not travel. Other ranks ignore them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ps_worker.tables.modules import is_table

log = logging.getLogger(__name__)


def load_model_file(path: str) -> dict[str, torch.Tensor]:
    """The ``{key: tensor}`` of a model file: safetensors for ``.safetensors``, else
    ``torch.load(weights_only=True)`` on the CPU.

    Raises:
        FileNotFoundError: no such file. ValueError: not a mapping of tensors, or safetensors
            missing for a .safetensors file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No model file {path}; give a file that ps-admin export or ps-launch --save wrote.")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            missing = f"Reading {path} needs the safetensors package: pip install 'grpc-ps[safetensors]'."
            raise ValueError(missing) from None
        return load_file(path)
    state: Any = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a {{key: tensor}} model file (as ps-admin export writes).")
    return state


def table_names(model: torch.nn.Module) -> set[str]:
    """Names of the model's embedding tables (``emb.weight``): its sparse embeddings and
    ``ShardedEmbedding`` modules, before or after ``client.init``."""
    return {f"{name}.weight" if name else "weight" for name, m in model.named_modules() if is_table(m)}


def table_rows(state: dict[str, torch.Tensor], table: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids int64 [n], rows float32 [n, dim]) of ``table`` in a model file's ``state``: the full
    matrix (ids 0..num_rows-1) or the ``.ids``/``.rows`` pair; None when the file has neither."""
    if table in state:
        rows = state[table]
        return torch.arange(rows.shape[0], dtype=torch.int64), rows
    if f"{table}.ids" in state and f"{table}.rows" in state:
        return state[f"{table}.ids"].to(torch.int64), state[f"{table}.rows"]
    return None


def init_from(model: torch.nn.Module, path: str) -> list[str]:
    """Load model file ``path`` into ``model`` (before ``client.init``): its dense parameters and
    buffers at once, its tables' rows kept on their modules for rank 0's ``client.init`` to seed
    (``TableClient.seeds``). Returns the file's table keys (imported).

    Raises:
        ValueError: the file lacks a dense key of the model or has one the model lacks (another
            architecture), or a table's rows are not float32 [n, dim] of the model's table.
            RuntimeError (torch): a dense shape differs. FileNotFoundError: no file.
    """
    state = load_model_file(path)
    modules = {f"{name}.weight" if name else "weight": m for name, m in model.named_modules() if is_table(m)}
    tables = set(modules)
    imported = [k for k in state if k in tables or k.rsplit(".", 1)[0] in tables]
    dense = {k: v for k, v in state.items() if k not in imported}
    expected = {k for k in model.state_dict() if k not in tables}
    if set(dense) != expected:
        missing, extra = sorted(expected - set(dense)), sorted(set(dense) - expected)
        raise ValueError(
            f"{path} is not a model file of this model: it lacks {missing[:4]} and has {extra[:4]} that the "
            "model does not; start from a file of the same architecture."
        )
    seeds = {}
    for table, m in modules.items():
        found = table_rows(state, table)
        if found is None:
            continue
        ids, rows = found
        num_rows, dim = int(m.num_embeddings), int(m.embedding_dim)
        bad = rows.dtype != torch.float32 or tuple(rows.shape) != (ids.numel(), dim) or ids.dim() != 1
        if bad or (table in state and ids.numel() != num_rows):
            raise ValueError(
                f"{path}: table {table!r} holds rows {tuple(rows.shape)} {rows.dtype}, but the model's table is "
                f"[{num_rows}, {dim}] float32; start from a file of the same architecture."
            )
        seeds[table] = (m, ids, rows)
    model.load_state_dict(dense, strict=False)
    for m, ids, rows in seeds.values():
        object.__setattr__(m, "ps_seed_rows", (ids, rows))  # TableClient.seeds at client.init (rank 0 sends)
    if imported:
        log.info("%s: embedding table rows imported (%s), rank 0 seeds them at client.init", path, imported[:4])
    return imported
