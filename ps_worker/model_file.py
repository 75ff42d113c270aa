"""Start a model from a model file (``ps-admin export``, ``ps-launch --save``): ``ps-worker
--init-from PATH`` and scripts (docs/operations.md#start-a-job-from-a-model-file).

The file's dense parameters and buffers are loaded into the model **before** ``client.init``, so
rank 0 sends them to the shards as the job's initial values (the other ranks pull them). Embedding
tables are not imported: the shards' ``InitTables`` declares a table without rows, and every row of
a new job starts at its deterministic initial value (``ps_common.tables.initial_rows``); the file's
table keys (``emb.weight``, or ``emb.weight.ids``/``.rows``) are skipped, and the caller is told which.
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


def init_from(model: torch.nn.Module, path: str) -> list[str]:
    """Load the dense parameters and buffers of model file ``path`` into ``model`` (before
    ``client.init``); returns the file's table keys, which are skipped (tables start at their
    initial rows).

    Raises:
        ValueError: the file lacks a dense key of the model or has one the model lacks (another
            architecture); RuntimeError (torch): a shape differs. FileNotFoundError: no file.
    """
    state = load_model_file(path)
    tables = table_names(model)
    skipped = [k for k in state if k in tables or k.rsplit(".", 1)[0] in tables]
    dense = {k: v for k, v in state.items() if k not in skipped}
    expected = {k for k in model.state_dict() if k not in tables}
    if set(dense) != expected:
        missing, extra = sorted(expected - set(dense)), sorted(set(dense) - expected)
        raise ValueError(
            f"{path} is not a model file of this model: it lacks {missing[:4]} and has {extra[:4]} that the "
            "model does not; start from a file of the same architecture."
        )
    model.load_state_dict(dense, strict=False)
    if skipped:
        log.warning(
            "%s: embedding tables are not imported (%s); their rows start at their initial values", path, skipped[:4]
        )
    return skipped
