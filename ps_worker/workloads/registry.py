"""The built-in workloads by name, for ``ps-worker`` and ``ps-launch``: a model, its data and its evaluation."""

from __future__ import annotations

from collections.abc import Callable

from ps_worker.workloads.base import Workload
from ps_worker.workloads.charlm import CharLMWorkload
from ps_worker.workloads.ctr import CTRWorkload
from ps_worker.workloads.digits import DigitsWorkload
from ps_worker.workloads.linreg import LinRegWorkload

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "digits": DigitsWorkload,
    "linreg": LinRegWorkload,
    "charlm": CharLMWorkload,
    "ctr": CTRWorkload,
}

TAKES_CORPUS = frozenset({"charlm"})
"""Workloads whose constructor takes ``corpus`` (a text file; ``--corpus``)."""


def get_workload(name: str, corpus: str = "") -> Workload:
    """The workload called ``name``.

    Args:
        name: a key of :data:`WORKLOADS`.
        corpus: a text file for the workloads of :data:`TAKES_CORPUS`; "" for their default.

    Raises:
        ValueError: unknown name, listing the known ones, or a corpus for a workload that takes none.
    """
    if name not in WORKLOADS:
        raise ValueError(f"Unknown workload {name!r}; expected one of {', '.join(sorted(WORKLOADS))}.")
    if not corpus:
        return WORKLOADS[name]()
    if name not in TAKES_CORPUS:
        raise ValueError(f"--corpus applies to {', '.join(sorted(TAKES_CORPUS))} only, not to {name!r}.")
    return WORKLOADS[name](corpus=corpus)
