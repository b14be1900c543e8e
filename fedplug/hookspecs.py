"""The hooks a fedplug plugin can implement, and the ``register`` callback each receives.

At start-up the core calls each hook once, through pluggy (so ``tryfirst``, ``trylast``
and hook wrappers apply), with a ``register`` callback; the plugin calls
``register(ConfigClass, factory)`` for each component it provides, named by the
``name: Literal["..."]`` of its config class (the old form, ``register(name,
ConfigClass, factory)``, still works). The experiment config then picks components by
``name``. Each hook states its kind's factory signature, typed by the Protocols below. A
bad registration is a :class:`fedplug.errors.PluginError` naming the plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    from torch import nn

    from fedplug.components import Aggregator, ComponentConfig, Grouper, LossTransform, Sampler
    from fedplug.data.datasets import Dataset
    from fedplug.data.partitions import Partition
    from fedplug.tracking.observer import TrackerBackend, TrackerContext

PROJECT_NAME = "fedplug"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# ------------------------------------------------------------------ factories per kind
# ``config`` is the component's own validated config (a ComponentConfig subclass), typed
# Any so that a factory may declare its own subclass.


class DatasetFactory(Protocol):
    """``factory(config, root)``: load a dataset from the data folder ``root``."""

    def __call__(self, config: Any, root: Path, /) -> Dataset: ...


class PartitionerFactory(Protocol):
    """``factory(labels, num_classes, num_clients, config, rng, users=None)``: spread a
    dataset's training samples over clients."""

    def __call__(
        self,
        labels: np.ndarray,
        num_classes: int,
        num_clients: int,
        config: Any,
        rng: np.random.Generator,
        /,
        *,
        users: np.ndarray | None = None,
    ) -> Partition: ...


class ModelFactory(Protocol):
    """``factory(config, input_shape, num_classes)``: a fresh model."""

    def __call__(
        self, config: Any, input_shape: tuple[int, ...], num_classes: int, /
    ) -> nn.Module: ...


class SamplerFactory(Protocol):
    """``factory(config)``: a client sampler."""

    def __call__(self, config: Any, /) -> Sampler: ...


class LossTransformFactory(Protocol):
    """``factory(config)``: a loss transform."""

    def __call__(self, config: Any, /) -> LossTransform: ...


class AggregatorFactory(Protocol):
    """``factory(config, num_clients)``: a server aggregator."""

    def __call__(self, config: Any, num_clients: int, /) -> Aggregator: ...


class GrouperFactory(Protocol):
    """``factory(config)``: a grouper."""

    def __call__(self, config: Any, /) -> Grouper: ...


class TrackerFactory(Protocol):
    """``factory(context)``: a tracker backend for one run."""

    def __call__(self, context: TrackerContext, /) -> TrackerBackend: ...


# ------------------------------------------------------------------ register callbacks

FactoryT_contra = TypeVar("FactoryT_contra", contravariant=True)


class Register(Protocol[FactoryT_contra]):
    """The ``register`` callback of one kind, generic in that kind's factory type.

    ``register(ConfigClass, factory)`` names the component by ``ConfigClass.name``,
    which must be declared ``Literal["its-name"]``. ``register(name, ConfigClass,
    factory)`` is the old form, kept for plugins written before it; ``name`` must equal
    that Literal.
    """

    @overload
    def __call__(
        self, config_class: type[ComponentConfig], factory: FactoryT_contra, /
    ) -> None: ...

    @overload
    def __call__(
        self, name: str, config_class: type[ComponentConfig], factory: FactoryT_contra, /
    ) -> None: ...


RegisterDataset = Register[DatasetFactory]
RegisterPartitioner = Register[PartitionerFactory]
RegisterModel = Register[ModelFactory]
RegisterSampler = Register[SamplerFactory]
RegisterLossTransform = Register[LossTransformFactory]
RegisterAggregator = Register[AggregatorFactory]
RegisterGrouper = Register[GrouperFactory]


class RegisterTracker(Protocol):
    """``register(name, factory)``: trackers have no config class; a run lists the
    names of its trackers in ``tracking.backends``."""

    def __call__(self, name: str, factory: TrackerFactory, /) -> None: ...


FACTORIES: dict[str, Any] = {
    "datasets": DatasetFactory,
    "partitioners": PartitionerFactory,
    "models": ModelFactory,
    "samplers": SamplerFactory,
    "loss_transforms": LossTransformFactory,
    "aggregators": AggregatorFactory,
    "groupers": GrouperFactory,
}
"""The factory Protocol of each registry kind."""


# ------------------------------------------------------------------------------- hooks


@hookspec
def fedplug_register_datasets(register: RegisterDataset) -> None:
    """Register datasets.

    Called once when the registry is built. ``factory(config, root)``
    (:class:`DatasetFactory`) receives the validated dataset config and the data folder
    (a ``pathlib.Path``) and returns a :class:`fedplug.data.datasets.Dataset` (train and
    held-out test arrays, number of classes, input shape, and the writer id of every
    training sample when the dataset has natural users).
    """


@hookspec
def fedplug_register_partitioners(register: RegisterPartitioner) -> None:
    """Register partitioners: how a dataset's samples are spread over clients.

    Called once when the registry is built. ``factory(labels, num_classes, num_clients,
    config, rng, users=None)`` (:class:`PartitionerFactory`) must be a pure function of
    its inputs: ``labels`` is the int array of training labels, ``rng`` a
    ``numpy.random.Generator``, ``users`` the writer id per sample (or ``None``). An
    impossible request (more clients than samples, ...) raises
    :class:`fedplug.errors.DataError` saying what to change. It returns a
    :class:`fedplug.data.partitions.Partition` (client index lists, the K x C
    class-count matrix, and optional per-client input noise).
    """


@hookspec
def fedplug_register_models(register: RegisterModel) -> None:
    """Register model architectures.

    Called once when the registry is built. ``factory(config, input_shape, num_classes)``
    (:class:`ModelFactory`) returns a fresh ``torch.nn.Module`` that maps a batch of
    inputs of ``input_shape`` to ``num_classes`` logits. Weights are initialised from
    torch's global generator, which the simulator seeds before calling it.
    """


@hookspec
def fedplug_register_samplers(register: RegisterSampler) -> None:
    """Register client samplers: which local samples a client visits in an epoch.

    Called once when the registry is built. ``factory(config)`` (:class:`SamplerFactory`)
    returns a :class:`fedplug.components.Sampler`. The default, ``uniform``, shuffles the
    client's data; IWDS draws with class-rebalancing weights that decay over rounds.
    """


@hookspec
def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
    """Register loss transforms: how a client's training loss is formed.

    Called once when the registry is built. ``factory(config)``
    (:class:`LossTransformFactory`) returns a :class:`fedplug.components.LossTransform`.
    Examples: plain cross-entropy, FedProx's proximal term, FedShift's logit shift,
    FedDisk's density-ratio sample weights. Evaluation never goes through a loss
    transform.
    """


@hookspec
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    """Register aggregators: how the server combines client models (and what the
    client must do for it, e.g. SCAFFOLD's control variates).

    Called once when the registry is built. ``factory(config, num_clients)``
    (:class:`AggregatorFactory`) returns a :class:`fedplug.components.Aggregator`.
    """


@hookspec
def fedplug_register_groupers(register: RegisterGrouper) -> None:
    """Register groupers: who trains with whom in a round.

    Called once when the registry is built. ``factory(config)`` (:class:`GrouperFactory`)
    returns a :class:`fedplug.components.Grouper`. The default, ``none``, lets every
    sampled client train alone from the global model; FedGSP builds groups whose members
    train one after another.
    """


@hookspec
def fedplug_register_trackers(register: RegisterTracker) -> None:
    """Register trackers: where a run's params, per-round metrics, tags and model go.

    Called once when the registry is built. ``register(name, factory)`` takes no config
    class: a tracker is chosen by listing its ``name`` in ``tracking.backends``.
    ``factory(context)`` (:class:`TrackerFactory`) receives a
    :class:`fedplug.tracking.TrackerContext` (the validated config, the run's output
    folder, run name, tags, fingerprint, resume flag, parent run) and returns a
    :class:`fedplug.tracking.TrackerBackend`: an object with ``logged_rounds`` (the
    rounds it already holds, for resuming without duplicates), ``log_params``,
    ``log_round``, ``log_result``, ``log_model``, ``log_artifacts``, ``set_tags``,
    ``finish`` and ``fail``. Built in: ``mlflow`` and ``tensorboard``
    (:mod:`fedplug.tracking`).
    """
