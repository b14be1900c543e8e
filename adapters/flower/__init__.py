"""Run fedplug algorithms on Flower (``pip install fedplug[flower]``, Flower 1.41 Message API).

- :class:`FedplugStrategy`: a Flower strategy built from a fedplug ``train`` config
  (its ``start`` returns a :class:`FedplugResult`: Flower's ``Result`` plus the server's
  per-round counters).
- :class:`FedplugTrainer`: fedplug's client side for a user's own ClientApp, model and data.
- :class:`RoundSampler`, :class:`FedplugLoss`, :func:`with_sample_ids`,
  :func:`answer_class_counts`: the client side as pieces of the user's own training loop.
- :func:`make_server_app`, :func:`make_client_app`, :func:`run_on_grid`: ready apps that
  run any fedplug experiment config.
- :class:`ClassCounts`, :func:`gather_class_counts`, :func:`central_evaluation`: helpers
  for a user's own ServerApp; :class:`LoopbackGrid`: an in-process grid for tests.

Guide: docs/flower.md.
"""

from .apps import make_client_app, make_server_app, run_on_grid
from .local_data import with_sample_ids
from .loopback import LoopbackGrid
from .own_loop import FedplugLoss
from .own_loop_common import answer_class_counts
from .priors import ClassCounts, gather_class_counts
from .round_sampler import RoundSampler
from .round_records import FedplugResult
from .strategy import FedplugStrategy, central_evaluation
from .trainer import FedplugTrainer

__all__ = [
    "ClassCounts",
    "FedplugLoss",
    "FedplugResult",
    "FedplugStrategy",
    "FedplugTrainer",
    "LoopbackGrid",
    "RoundSampler",
    "answer_class_counts",
    "central_evaluation",
    "gather_class_counts",
    "make_client_app",
    "make_server_app",
    "run_on_grid",
    "with_sample_ids",
]
