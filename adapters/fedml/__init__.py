"""Run fedplug experiments on FedML (https://github.com/FedML-AI/FedML), 0.9.6.

FedML pins numpy<2 and protobuf<4, which Flower cannot live with, so it has its own
environment: ``make fedml-venv`` builds ``.venv-fedml`` (and installs Open MPI when
missing). Then::

    .venv-fedml/bin/python -m fedplug.adapters.fedml run CONFIG --out DIR --workers 2

starts ``mpirun`` with FedML's cross-silo server on rank 0 and W worker ranks, all on
loopback. fedplug's sampler, loss transform and aggregator client side run in FedML's
``ClientTrainer`` (:class:`.fedml_components.FedplugClientTrainer`), fedplug's sampling,
grouping, aggregation and evaluation in its ``ServerAggregator``
(:class:`.fedml_components.FedplugServerAggregator`). Same seed, same numbers as
``fedplug run``; docs/fedml.md says what differs and why.

Modules: :mod:`.launcher` (``run_fedml``, the command line), :mod:`.rank` (each MPI
rank), :mod:`.fedml_components` (the two FedML subclasses), :mod:`.coordinator` (server
logic), :mod:`.worker` (client logic), :mod:`.protocol` (messages and schedule),
:mod:`.runtime` (FedML's config and dataset), :mod:`.guard` (loopback only),
:mod:`.deadlines` and :mod:`.server` (the server's bounded wait for the workers,
``train.failures.client_timeout_seconds``), :mod:`.drop_in`
(:class:`~.drop_in.FedplugAggregator`: fedplug's server side next to a user's own FedML
``ClientTrainer``). Only :mod:`.fedml_components`, :mod:`.server`, :mod:`.rank` and
:mod:`.drop_in` import FedML.
"""

from .launcher import FedMLRun, run_fedml

__all__ = ["FedMLRun", "run_fedml"]
