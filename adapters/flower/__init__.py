"""Run fedplug algorithms on Flower (``pip install fedplug[flower]``, Flower 1.41 Message API).

- :class:`FedplugStrategy`: a Flower strategy built from a fedplug ``train`` config; its
  aggregator and grouper decide what goes to which node and how replies combine
  (FedGSP's chains included).
- :class:`FedplugTrainer`: the client side for a user's own ClientApp, model and data
  (IWDS, FedShift, FedProx, SCAFFOLD, FedNova client sides in a few lines; a loss
  transform's setup phase, FedDisk's, with :meth:`FedplugTrainer.setup_phase`).
- :mod:`.own_loop` (with :mod:`.round_sampler` and :mod:`.own_loop_common`): the client
  side as pieces of the user's own training loop:
  :class:`RoundSampler` (a sampler such as IWDS for their DataLoader), :class:`FedplugLoss`
  (their criterion plus the loss transform's and the aggregator's client side),
  :func:`with_sample_ids`, :func:`answer_class_counts`.
- :mod:`.setup_phase`: any loss transform's setup phase over ``train.<phase name>``
  messages (:func:`~.setup_phase.run_setup_phase`).
- :mod:`.apps`: a ready ``server_app`` / ``client_app`` pair that runs any fedplug
  experiment config, plus :func:`make_server_app` for ``run_simulation``.
- :class:`LoopbackGrid`: an in-process grid for tests and debugging.

See ``docs/flower.md``.
"""

from .apps import make_client_app, make_server_app, run_on_grid
from .local_data import with_sample_ids
from .loopback import LoopbackGrid
from .own_loop import FedplugLoss
from .own_loop_common import answer_class_counts
from .priors import ClassCounts, gather_class_counts
from .round_sampler import RoundSampler
from .strategy import FedplugStrategy, central_evaluation
from .trainer import FedplugTrainer

__all__ = [
    "ClassCounts",
    "FedplugLoss",
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
