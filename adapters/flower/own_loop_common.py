"""What the pieces of a user's own Flower training loop share.

The config types a user passes (:data:`ComponentSpec`, :data:`DataOf`), small helpers of
:class:`~fedplug.adapters.flower.round_sampler.RoundSampler` and
:class:`~fedplug.adapters.flower.own_loop.FedplugLoss`, and :func:`answer_class_counts`,
the one-line class-count reply a stock ClientApp adds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from fedplug.components import ComponentConfig
from fedplug.registry import Registry

from .capabilities import declare
from .local_data import DEFAULT_LABEL_KEY, labels_of
from .records import (
    CONFIG_KEY,
)
from .trainer import (
    FedplugTrainer,
)

ComponentSpec = Mapping[str, Any] | ComponentConfig
"""A component's config: a dict such as ``{"name": "iwds", "beta_0": 0.999}`` (validated
strictly, a typo is an error naming its path) or a validated config."""
DataOf = Callable[[Context], Any]
"""The node's training data, given the ClientApp's context (e.g.
``lambda context: load_data(context.node_config["partition-id"])``)."""


def registry_or_default(registry: Registry | None) -> Registry:
    """``registry``, or the installed plugins' registry when it is ``None``."""
    if registry is not None:
        return registry
    from fedplug.plugins import default_registry

    return default_registry()


def component_spec(spec: ComponentSpec) -> Any:
    """``spec`` as a plain dict, for :func:`fedplug.config.validate_section`."""
    return spec.model_dump() if isinstance(spec, ComponentConfig) else dict(spec)


def message_config(message: Message) -> ConfigRecord:
    """The fedplug config record of a server message (empty when it sends none)."""
    return message.content.config_records.get(CONFIG_KEY, ConfigRecord())


class LabelCache:
    """The labels of the last data object seen (a node reloads the same dataset object,
    or a new one each round). :func:`~fedplug.adapters.flower.local_data.labels_of` reads
    a label column where the data keep one, and every sample otherwise."""

    def __init__(self, label_key: str) -> None:
        self.label_key = label_key
        self._data: Any = None
        self._labels: np.ndarray | None = None

    def __call__(self, data: Any) -> np.ndarray:
        if self._labels is None or data is not self._data:
            self._labels = labels_of(data, self.label_key)
            self._data = data
        return self._labels


def answer_class_counts(
    app: ClientApp,
    data: DataOf,
    *,
    num_classes: int | None = None,
    label_key: str = DEFAULT_LABEL_KEY,
    trainer: FedplugTrainer | None = None,
) -> None:
    """Register ``@app.query()`` answering :class:`~fedplug.adapters.flower.FedplugStrategy`'s
    class-count query with this node's counts (:meth:`FedplugTrainer.describe`): what a
    stock ClientApp adds, in one line, when an algorithm needs every client's class
    counts (FedShift's prior, FedGSP's groups). The raw data never leave the node.

    The counts are of the labels only, read without loading an input where the data
    keep them apart: a Hugging Face ``Dataset``'s label column (its transform is not run),
    a ``Subset``'s parent's labels, a ``TensorDataset``'s label tensor, torchvision's
    ``targets``; a DataLoader is counted over its whole ``dataset``
    (:func:`~fedplug.adapters.flower.local_data.labels_of`). Other datasets are read
    sample by sample.

    Args:
        app: the ClientApp.
        data: the node's training data given the context (:data:`DataOf`).
        num_classes: C (default: the server's ``fedplug.num-classes``).
        label_key: the label's key in dict samples (default ``"label"``).
        trainer: the trainer whose ``describe`` answers (default: a plain one).
    """
    if trainer is None:
        trainer = FedplugTrainer.from_config({}, num_classes=num_classes, label_key=label_key)
    answering = trainer

    def query(message: Message, context: Context) -> Message:
        return answering.describe(data(context), message, context)

    app.query()(query)
    declare(app, {})  # the capability handler reports the query handler above
