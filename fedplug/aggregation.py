"""Weighted averaging of client models, and the refusals every aggregator shares: the
building blocks an aggregator, built-in or a plugin's, averages with.

Part of the public plugin API: import these from :mod:`fedplug.components`, which
re-exports every name here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fedplug.errors import TrainingError

if TYPE_CHECKING:
    from fedplug.components import ClientUpdate


class WeightedMean:
    """Running weighted mean of vectors: the building block of most aggregators."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.weight = 0.0
        self.count = 0

    def add(self, vector: Tensor, weight: float) -> None:
        if self.total is None:
            self.total = vector.detach().double() * weight
        else:
            self.total.add_(vector.detach().double(), alpha=weight)
        self.weight += weight
        self.count += 1

    @property
    def empty(self) -> bool:
        """True until a vector with positive total weight has been added."""
        return self.total is None or self.weight <= 0

    def mean(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``sum_k weight_k v_k / sum_k weight_k``, summed in float64 and returned as
        ``dtype``; ask for ``torch.float64`` to go on computing at full precision.

        Raises:
            ValueError: nothing with positive weight was added (:attr:`empty`).
        """
        if self.total is None or self.empty:
            raise ValueError("no client update reached the aggregator this round")
        return (self.total / self.weight).to(dtype)


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


# ---------------------------------------------------------------------------- groupers
