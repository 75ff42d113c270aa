"""Built-in workloads for ``ps-worker`` and ``ps-launch``: a model, its data and its evaluation."""

from __future__ import annotations

from collections.abc import Callable

from ps_worker.workloads.base import Workload
from ps_worker.workloads.digits import DigitsWorkload
from ps_worker.workloads.linreg import LinRegWorkload

WORKLOADS: dict[str, Callable[[], Workload]] = {"digits": DigitsWorkload, "linreg": LinRegWorkload}


def get_workload(name: str) -> Workload:
    """The workload called ``name``.

    Raises:
        ValueError: unknown name, listing the known ones.
    """
    try:
        return WORKLOADS[name]()
    except KeyError:
        raise ValueError(f"Unknown workload {name!r}; expected one of {', '.join(sorted(WORKLOADS))}.") from None
