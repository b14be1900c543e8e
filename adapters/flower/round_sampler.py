"""A fedplug sampler (IWDS or any registered one) as a round-aware
``torch.utils.data.Sampler`` for the user's own DataLoader: :class:`RoundSampler`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch.utils.data import Sampler

from fedplug.config import validate_section
from fedplug.errors import ConfigError
from fedplug.registry import Registry
from fedplug.run.components import build_component
from fedplug.run.local_training import local_rng

from .capabilities import declare
from .local_data import DEFAULT_LABEL_KEY
from .own_loop_common import (
    ComponentSpec,
    LabelCache,
    component_spec,
    message_config,
    registry_or_default,
)
from .records import (
    NUM_CLASSES,
    ROUND,
    integer,
)
from .trainer import (
    client_id_of,
)


class RoundSampler(Sampler[int]):
    """A fedplug sampler (IWDS or any registered one) as a ``torch.utils.data.Sampler``.

    Each pass over the DataLoader is one local epoch: the indices fedplug's sampler
    draws for this client in this round, from the simulator's random stream
    (``local_rng(seed, round, client)``; epoch e takes the e-th draw), so with the same
    batch size and a plain SGD loop the client sees exactly the batches it would see in
    ``fedplug run``. Call :meth:`for_round` (or :meth:`set_round`) once per round,
    before the first epoch; it restarts the stream, so a retried round draws the same
    indices.

    Args:
        sampler: the sampler's config (default ``{"name": "iwds"}``).
        seed: ``train.seed`` of the experiment the server runs (default 0): the key of
            every client's stream.
        num_classes: C, for the class counts the sampler reads (default: the server's
            ``fedplug.num-classes`` when it sends one, else the largest label + 1).
        label_key: the label's key in dict samples (default ``"label"``).
        registry: the component registry (default: the installed plugins).
        app: the ClientApp (default: none); the sampler is declared on its capability
            handler (:mod:`.capabilities`), which the server asks before round 1.
    """

    def __init__(
        self,
        sampler: ComponentSpec | None = None,
        *,
        seed: int = 0,
        num_classes: int | None = None,
        label_key: str = DEFAULT_LABEL_KEY,
        registry: Registry | None = None,
        app: ClientApp | None = None,
    ) -> None:
        registry = registry_or_default(registry)
        train = validate_section(
            "train", {"sampler": component_spec(sampler or {"name": "iwds"}), "seed": seed}, registry
        )
        self.config = train.sampler
        self.seed = int(train.seed)
        self.num_classes = num_classes
        self.component = build_component("sampler", train, registry)
        self._labels = LabelCache(label_key)
        self._round: tuple[np.ndarray, np.ndarray, int, np.random.Generator] | None = None
        self._next_epoch: np.ndarray | None = None
        if app is not None:
            declare(app, {"sampler": self.config.name})

    def for_round(self, message: Message, context: Context, data: Any) -> RoundSampler:
        """Start the round of ``message`` (its ``server-round``) for this node's client
        (the server's ``fedplug.client-id``, else the node's ``partition-id``) on
        ``data`` (the training dataset the DataLoader reads, or its labels); returns
        ``self``, for ``DataLoader(..., sampler=sampler.for_round(msg, context, data))``."""
        config = message_config(message)
        num_classes = self.num_classes
        if num_classes is None and NUM_CLASSES in config:
            num_classes = integer(config, NUM_CLASSES)
        return self.set_round(
            integer(config, ROUND, 1),
            data,
            client_id=client_id_of(config, context),
            num_classes=num_classes,
        )

    def set_round(
        self, server_round: int, data: Any, *, client_id: int = 0, num_classes: int | None = None
    ) -> RoundSampler:
        """Start round ``server_round`` (1-based, Flower's ``server-round``) of client
        ``client_id`` on ``data`` (a dataset, a DataLoader or the labels); returns
        ``self``."""
        if server_round < 1:
            raise ConfigError(f"server_round is 1-based, got {server_round}")
        labels = self._labels(data)
        width = num_classes or self.num_classes or (int(labels.max()) + 1 if labels.size else 1)
        if labels.size and (labels.min() < 0 or labels.max() >= width):
            raise ConfigError(
                f"labels must lie in [0, {width - 1}], found "
                f"{int(labels.min())}..{int(labels.max())}; pass num_classes="
            )
        class_counts = np.bincount(labels, minlength=width).astype(np.int64)
        round_index = server_round - 1
        rng = local_rng(self.seed, round_index, client_id)
        self._round = (labels, class_counts, round_index, rng)
        self._next_epoch = None
        return self

    def _epoch(self) -> np.ndarray:
        if self._round is None:
            raise RuntimeError(
                "call sampler.for_round(message, context, data) (or set_round) before iterating"
            )
        if self._next_epoch is None:
            labels, class_counts, round_index, rng = self._round
            self._next_epoch = np.asarray(
                self.component.epoch_indices(labels, class_counts, round_index, rng), dtype=np.int64
            )
        return self._next_epoch

    def __iter__(self) -> Iterator[int]:
        indices = self._epoch()
        self._next_epoch = None  # the next pass is the next epoch
        return iter(indices.tolist())

    def __len__(self) -> int:
        """The length of the coming epoch (drawn now, and used by the next pass)."""
        return len(self._epoch())


