"""FedAvg: the sample-weighted average of the clients' models.

    Communication-Efficient Learning of Deep Networks from Decentralized Data.
    H. Brendan McMahan, Eider Moore, Daniel Ramage, Seth Hampson, Blaise Aguera y Arcas.
    AISTATS 2017, arXiv:1602.05629.

Server update over the clients S that replied this round::

    w^{t+1} = sum_{k in S} p_k w_k^{t+1},   p_k = weight_k / sum_{j in S} weight_j

where ``weight_k`` is :attr:`ClientUpdate.weight` (n_k for a client, or 1 for a uniformly
weighted group). The client side is plain local training.

This module also holds :func:`average_models`, the streaming weighted average that the
other server-side optimisers (FedAvgM, FedAdam, ...) start from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fedplug.components import Aggregator, ClientUpdate, ComponentConfig, WeightedMean
from fedplug.errors import TrainingError
from fedplug.hookspecs import RegisterAggregator, hookimpl


@dataclass(frozen=True)
class ModelAverage:
    """The weighted mean of one round's client models."""

    mean: Tensor
    """sum_k p_k w_k in float64, on the device of the client vectors."""
    total_weight: float
    """sum_k weight_k."""
    count: int
    """How many updates were averaged."""


def check_update_weight(update: ClientUpdate) -> None:
    """Reject a weight that would corrupt a weighted mean (negative, NaN or infinite)."""
    if not (math.isfinite(update.weight) and update.weight >= 0):
        raise ValueError(
            f"client {update.client_id} sent aggregation weight {update.weight!r}; "
            "weights must be finite and non-negative"
        )


def no_updates_error(aggregator_name: str) -> TrainingError:
    """The error every aggregator raises when a round produced nothing to aggregate."""
    return TrainingError(
        f"no client update reached the {aggregator_name!r} aggregator this round (every "
        "sampled client failed or held no training samples); check the partition and the "
        "fraction of clients sampled per round"
    )


def average_models(updates: Iterable[ClientUpdate], aggregator_name: str) -> ModelAverage:
    """Consume ``updates`` once and return their weighted mean, in float64.

    Args:
        updates: the round's client replies, read as a stream.
        aggregator_name: named in the error raised when ``updates`` is empty.

    Raises:
        TrainingError: no update arrived, or all of them had weight 0.
    """
    accumulator = WeightedMean()
    for update in updates:
        check_update_weight(update)
        accumulator.add(update.vector, update.weight)
    if accumulator.empty:
        raise no_updates_error(aggregator_name)
    return ModelAverage(
        mean=accumulator.mean(torch.float64),
        total_weight=accumulator.weight,
        count=accumulator.count,
    )


class FedAvgConfig(ComponentConfig):
    """FedAvg (McMahan et al. 2017): the sample-weighted mean of the client models."""

    name: Literal["fedavg"] = "fedavg"


class FedAvg(Aggregator):
    """Server side of FedAvg: ``w^{t+1} = sum_k p_k w_k``.

    Args:
        config: the validated :class:`FedAvgConfig` (it has no parameters).
        num_clients: K, the number of clients in the federation.
    """

    def __init__(self, config: FedAvgConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.config = config

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """The weighted mean of the updates, as float32."""
        return average_models(updates, self.config.name).mean.float()


@hookimpl
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    register(FedAvgConfig, FedAvg)
