"""Run fedplug experiments on FedML 0.9.6, in its own environment (``make fedml-venv``).

- :func:`run_fedml` (and ``python -m fedplug.adapters.fedml run CONFIG --out DIR``): a whole
  experiment under ``mpirun``, FedML's cross-silo server on rank 0 and W worker ranks;
  same seed, same numbers as ``fedplug run``.
- :class:`FedMLRun`: what :func:`run_fedml` returns (the ``RunResult``, folder, wall time).
- :class:`.drop_in.FedplugAggregator`: fedplug's server side next to a user's own FedML app.

Guide: docs/fedml.md; the modules: docs/fedml.md, 'Design notes: modules'.
"""

from .launcher import FedMLRun, run_fedml

__all__ = ["FedMLRun", "run_fedml"]
