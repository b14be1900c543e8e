"""The hooks a fedplug plugin can implement.

Every hook follows one shape, borrowed from simonw/llm's ``register_models(register)``:
the core calls the hook once, at start-up, with a ``register`` callback, and the plugin
calls ``register(name, config_class, factory)`` for each component it provides. The
experiment config then picks components by ``name``; the core looks them up in the
registry. We chose this over "a hook that every plugin answers every round" because an
experiment uses exactly one aggregator, one sampler, ... and a lookup by name is both
faster and easier to reason about than a chain of plugins that might all answer.

``register(name, config_class, factory)``:

- ``name`` (str): the value of ``name:`` in the config, unique within its kind.
- ``config_class``: a subclass of :class:`fedplug.components.ComponentConfig` whose
  ``name`` field is ``Literal[name]``; its fields are the component's parameters, each
  with a range (``Field(ge=..., le=...)``) and a docstring.
- ``factory``: what the core calls to build the component from a validated config. Its
  signature depends on the kind and is stated in each hook below.

A hook must return ``None``; a second registration of the same name, a config class
that is not a ``ComponentConfig`` or a factory that is not callable is rejected at load
time with the plugin's name in the message (:class:`fedplug.errors.PluginError`).
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT_NAME = "fedplug"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[..., None]


@hookspec
def fedplug_register_datasets(register: Register) -> None:
    """Register datasets.

    Called once when the plugin manager loads. ``factory(config, root)`` receives the
    validated dataset config and the data folder (a ``pathlib.Path``) and returns a
    :class:`fedplug.data.datasets.Dataset` (train and held-out test arrays, number of
    classes, input shape, and the writer id of every training sample when the dataset
    has natural users).
    """


@hookspec
def fedplug_register_partitioners(register: Register) -> None:
    """Register partitioners: how a dataset's samples are spread over clients.

    Called once when the plugin manager loads. ``factory(labels, num_classes,
    num_clients, config, rng, users=None)`` must be a pure function of its inputs:
    ``labels`` is the int array of training labels, ``rng`` a
    ``numpy.random.Generator``, ``users`` the writer id per sample (or ``None``). An
    impossible request (more clients than samples, ...) raises
    :class:`fedplug.errors.DataError` saying what to change. It returns a
    :class:`fedplug.data.partitions.Partition` (client index lists, the K x C
    class-count matrix, and optional per-client input noise).
    """


@hookspec
def fedplug_register_models(register: Register) -> None:
    """Register model architectures.

    Called once when the plugin manager loads. ``factory(config, input_shape,
    num_classes)`` returns a fresh ``torch.nn.Module`` that maps a batch of inputs of
    ``input_shape`` to ``num_classes`` logits. Weights are initialised from torch's
    global generator, which the simulator seeds before calling it.
    """


@hookspec
def fedplug_register_samplers(register: Register) -> None:
    """Register client samplers: which local samples a client visits in an epoch.

    Called once when the plugin manager loads. ``factory(config)`` returns a
    :class:`fedplug.components.Sampler`. The default, ``uniform``, shuffles the client's
    data; IWDS draws with class-rebalancing weights that decay over rounds.
    """


@hookspec
def fedplug_register_loss_transforms(register: Register) -> None:
    """Register loss transforms: how a client's training loss is formed.

    Called once when the plugin manager loads. ``factory(config)`` returns a
    :class:`fedplug.components.LossTransform`. Examples: plain cross-entropy, FedProx's
    proximal term, FedShift's logit shift, FedDisk's density-ratio sample weights.
    Evaluation never goes through a loss transform.
    """


@hookspec
def fedplug_register_aggregators(register: Register) -> None:
    """Register aggregators: how the server combines client models (and what the
    client must do for it, e.g. SCAFFOLD's control variates).

    Called once when the plugin manager loads. ``factory(config, num_clients)`` returns a
    :class:`fedplug.components.Aggregator`.
    """


@hookspec
def fedplug_register_groupers(register: Register) -> None:
    """Register groupers: who trains with whom in a round.

    Called once when the plugin manager loads. ``factory(config)`` returns a
    :class:`fedplug.components.Grouper`. The default, ``none``, lets every sampled client
    train alone from the global model; FedGSP builds groups whose members train one after
    another.
    """


@hookspec
def fedplug_register_trackers(register: Callable[[str, Callable[..., object]], None]) -> None:
    """Register trackers: where a run's params, per-round metrics, tags and model go.

    Called once when the plugin manager loads. ``register(name, factory)`` takes no
    config class: a tracker is chosen by listing its ``name`` in ``tracking.backends``.
    ``factory(context)`` receives a :class:`fedplug.tracking.TrackerContext` (the
    validated config, the run's output folder, run name, tags, fingerprint, resume flag,
    parent run) and returns a :class:`fedplug.tracking.TrackerBackend`: an object with
    ``logged_rounds`` (the rounds it already holds, for resuming without duplicates),
    ``log_params``, ``log_round``, ``log_result``, ``log_model``, ``log_artifacts``,
    ``set_tags``, ``finish`` and ``fail``. Built in: ``mlflow`` and ``tensorboard``
    (:mod:`fedplug.tracking`).
    """
