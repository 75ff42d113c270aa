"""Built-in workloads for ``ps-worker`` and ``ps-launch``, and ``ps-worker`` itself (its flags and training loop).

Light on purpose: ``ps-launch --help`` and ``ps-worker --help`` import this package without torch;
the workloads themselves are in :mod:`ps_worker.workloads.registry`.
"""
