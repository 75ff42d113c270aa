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

from ps_common import bounded_load
from ps_worker.tables.modules import is_table

log = logging.getLogger(__name__)


class ModelFileError(ValueError):
    """A model file that is not one of this model: one line, ``"PATH: why"``."""


def load_model_file(path: str, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The ``{key: tensor}`` of a model file: safetensors for ``.safetensors``, else
    ``torch.load(weights_only=True)`` on the CPU; what the file declares is checked first, so a
    crafted file allocates no more than the file and the model hold (``ps_common.bounded_load``).

    Args:
        path: the file. model: the model it is for (bounds what the file may declare; a
            safetensors file's keys, dtypes and shapes are checked against it before loading).

    Raises:
        FileNotFoundError: no such file. ModelFileError: not a model file (a torn or crafted
            archive, one declaring more than the file and the model hold, not a mapping of
            tensors), or safetensors missing for a .safetensors file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No model file {path}; give a file that ps-admin export or ps-launch --save wrote.")
    expected = sum(t.numel() * t.element_size() for t in model.state_dict().values()) if model is not None else 0
    if path.endswith(".safetensors"):
        try:
            from safetensors import SafetensorError
            from safetensors.torch import load_file
        except ImportError:
            missing = f"Reading {path} needs the safetensors package: pip install 'grpc-ps[safetensors]'."
            raise ModelFileError(missing) from None
        try:
            header = bounded_load.safetensors_header(path)
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}.") from None
        if model is not None:
            check_declared(path, model, {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()})
        try:
            return load_file(path)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise ModelFileError(f"{path}: does not load as safetensors ({_first_line(exc)}).") from None
    problem = bounded_load.check_zip(path, expected)
    if problem:
        raise ModelFileError(f"{path}: {problem}.")
    try:
        state: Any = bounded_load.torch_load(path)
    except MemoryError:
        raise ModelFileError(f"{path}: too large to load in this process's memory.") from None
    except Exception as exc:  # a torn archive, a bad pickle, a global weights_only refuses: all mean unusable
        raise ModelFileError(
            f"{path}: does not load with torch.load(weights_only=True) ({type(exc).__name__}: {_first_line(exc)})."
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ModelFileError(f"{path} is not a {{key: tensor}} model file (as ps-admin export writes).")
    return state


def check_declared(path: str, model: torch.nn.Module, declared: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Refuse a safetensors file whose dense keys, dtypes or shapes (``declared``: key -> (the
    safetensors dtype name, shape)) are not the model's, before any tensor is read.

    Raises:
        ModelFileError: names the first key that differs.
    """
    names = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    tables = table_names(model)
    for key, t in model.state_dict().items():
        if key in tables or key not in declared:
            continue  # a missing key is named by init_from, with every other
        dtype, shape = declared[key]
        if names.get(dtype, dtype) != t.dtype or shape != tuple(t.shape):
            raise ModelFileError(
                f"{path}: {key!r} is {dtype} {list(shape)}, but the model's is {t.dtype} {list(t.shape)}; start from "
                "a file of the same architecture."
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


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
        ModelFileError: as :func:`load_model_file`; the file lacks a dense key of the model or has
            one the model lacks (another architecture), a dense tensor of another dtype or shape,
            NaN or infinite values, a table's rows not float32 [n, dim] of the model's table, or a
            table given twice (matrix and ``.ids``/``.rows``). FileNotFoundError: no file.
    """
    state = load_model_file(path, model)
    modules = {f"{name}.weight" if name else "weight": m for name, m in model.named_modules() if is_table(m)}
    tables = set(modules)
    imported = [k for k in state if k in tables or k.rsplit(".", 1)[0] in tables]
    dense = {k: v for k, v in state.items() if k not in imported}
    own = {k: v for k, v in model.state_dict().items() if k not in tables}
    if set(dense) != set(own):
        missing, extra = sorted(set(own) - set(dense)), sorted(set(dense) - set(own))
        raise ModelFileError(
            f"{path} is not a model file of this model: it lacks {missing[:4]} and has {extra[:4]} that the "
            "model does not; start from a file of the same architecture."
        )
    for key, value in dense.items():
        want = own[key]
        if value.dtype != want.dtype or value.shape != want.shape:
            raise ModelFileError(
                f"{path}: {key!r} is {value.dtype} {list(value.shape)}, but the model's is {want.dtype} "
                f"{list(want.shape)}; start from a file of the same architecture."
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ModelFileError(f"{path}: {key!r} holds NaN or infinite values.")
    seeds = {}
    for table, m in modules.items():
        num_rows, dim = int(m.num_embeddings), int(m.embedding_dim)
        given = [k for k in (table, f"{table}.ids", f"{table}.rows") if k in state]
        if table in given and len(given) > 1:
            raise ModelFileError(f"{path}: table {table!r} is given twice (as a matrix and as {given[1]}); keep one.")
        if len(given) == 1 and table not in given:
            raise ModelFileError(f"{path}: table {table!r} has {given[0]} without its pair (.ids and .rows).")
        if table in given and state[table].dim() != 2:
            raise ModelFileError(f"{path}: table {table!r} is {list(state[table].shape)}, not [{num_rows}, {dim}].")
        found = table_rows(state, table)
        if found is None:
            continue
        ids, rows = found
        bad = rows.dtype != torch.float32 or tuple(rows.shape) != (ids.numel(), dim) or ids.dim() != 1
        if bad or (table in state and ids.numel() != num_rows) or state.get(f"{table}.ids", ids).is_floating_point():
            raise ModelFileError(
                f"{path}: table {table!r} holds rows {tuple(rows.shape)} {rows.dtype}, but the model's table is "
                f"[{num_rows}, {dim}] float32 (and .ids integers); start from a file of the same architecture."
            )
        if not bool(torch.isfinite(rows).all()):
            raise ModelFileError(f"{path}: table {table!r} holds NaN or infinite values.")
        seeds[table] = (m, ids, rows)
    model.load_state_dict(dense, strict=False)
    for m, ids, rows in seeds.values():
        object.__setattr__(m, "ps_seed_rows", (ids, rows))  # TableClient.seeds at client.init (rank 0 sends)
    if imported:
        log.info("%s: embedding table rows imported (%s), rank 0 seeds them at client.init", path, imported[:4])
    return imported
