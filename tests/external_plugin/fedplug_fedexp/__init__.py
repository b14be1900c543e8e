"""FedExP: FedAvg whose server step extrapolates when the clients' updates disagree.

    FedExP: Speeding Up Federated Averaging via Extrapolation. Divyansh Jhunjhunwala,
    Shiqiang Wang, Gauri Joshi. ICLR 2023, arXiv:2301.09604.

Algorithm 1 of the paper, over the M clients S that replied in round t::

    Delta_i = w^t - w_i^{t+1}                  (the paper's pseudo-gradient, global minus local)
    Delta   = sum_{i in S} p_i Delta_i
    eta_g   = max(1, sum_{i in S} p_i ||Delta_i||^2 / (2 (||Delta||^2 + epsilon)))
    w^{t+1} = w^t - eta_g Delta

The paper averages uniformly, ``p_i = 1/M``, which makes the step
``sum_i ||Delta_i||^2 / (2 M (||Delta||^2 + epsilon))``: that is ``weighting: uniform``, the
default. ``weighting: samples`` uses fedplug FedAvg's weights instead, ``p_i = n_i / sum_j
n_j`` (:attr:`fedplug.components.ClientUpdate.weight`), in the mean update and in the mean
of the squared norms alike; with ``eta_g = 1`` it is then FedAvg bit for bit. The paper's
``epsilon`` is ``1e-3`` (the default here). Only norms enter ``eta_g``, so the sign
convention of ``Delta`` does not change it; the new model is ``w^t + eta_g (mean_i w_i -
w^t)``. The paper also reports the average of the last two global models, because FedExP's
iterates oscillate; fedplug evaluates the global model itself, as it does for every
aggregator.

The aggregator reports the step it used as the round metric ``server_step``, and its config
declares a study column of it (the median and the largest over a run's rounds) and a box
plot of its per-round values (:class:`fedplug.analysis.Analysis`).

A plugin outside fedplug: ``pyproject.toml`` beside this package names it in the entry-point
group ``fedplug``, and nothing in fedplug names it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedplug.analysis import Analysis, BoxFigure, RoundMetricColumn
from fedplug.components import (
    Aggregator,
    ClientUpdate,
    ComponentConfig,
    RoundPlan,
    WeightedMean,
    check_update_weight,
    no_updates_error,
)
from fedplug.hookspecs import RegisterAggregator, hookimpl

SERVER_STEP = "server_step"
"""The round metric: the server step eta_g of the round."""
SERVER_STEPS = "server_steps"
"""The study record's key of a run's per-round steps (its box plot's series)."""

ANALYSIS = Analysis(
    columns=(
        RoundMetricColumn(SERVER_STEP, "median server step", reduce="median", series=SERVER_STEPS, digits=3),
        RoundMetricColumn(SERVER_STEP, "largest server step", reduce="max", column="server_step_max", digits=3),
    ),
    figures=(
        BoxFigure(
            kind="server_step_box",
            series=SERVER_STEPS,
            title="per-round FedExP server step",
            axis_label="server step eta_g",
            note="FedExP's server step eta_g in each round (1: the FedAvg step; above 1: extrapolation).",
        ),
    ),
)


class FedExPConfig(ComponentConfig):
    """FedExP (Jhunjhunwala, Wang, Joshi 2023): FedAvg with an adaptive, extrapolating server step."""

    name: Literal["fedexp"] = "fedexp"
    analysis = ANALYSIS
    epsilon: float = Field(default=1e-3, gt=0.0, le=1.0)
    """Added to ||Delta||^2 in the step's denominator (default 1e-3, the paper's); larger
    values keep the step nearer 1 when the clients' updates cancel out."""
    weighting: Literal["uniform", "samples"] = "uniform"
    """How the round's updates are averaged (default ``uniform``: 1/M each, as in the
    paper); ``samples`` weighs each by its samples, as fedplug's FedAvg does."""


def server_step(mean_squared_norm: float, squared_norm_of_mean: float, epsilon: float) -> float:
    """FedExP's eta_g from the weighted mean of the updates' squared norms and the squared
    norm of their weighted mean: ``max(1, mean_squared_norm / (2 (squared_norm_of_mean +
    epsilon)))``."""
    return max(1.0, mean_squared_norm / (2.0 * (squared_norm_of_mean + epsilon)))


class FedExP(Aggregator):
    """Server side of FedExP; the client side is plain local training, so it runs wherever
    FedAvg runs.

    Args:
        config: the validated :class:`FedExPConfig`.
        num_clients: K, the number of clients in the federation.
    """

    def __init__(self, config: FedExPConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.config = config
        self.last_step = 1.0
        """The step of the round last aggregated (round metric ``server_step``)."""

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """One pass over the updates: their weighted mean model and the weighted mean of
        ``||w^t - w_i||^2``; then the extrapolated step, in float64."""
        current = global_vector.detach().double()
        models = WeightedMean()
        squared_norms = 0.0
        for update in updates:
            check_update_weight(update)
            weight = self.update_weight(update)
            models.add(update.vector, weight)
            squared_norms += weight * float((current - update.vector.detach().double()).square().sum())
        if models.empty:
            raise no_updates_error(self.config.name)
        mean = models.mean(torch.float64)
        mean_update = current - mean
        self.last_step = server_step(
            squared_norms / models.weight, float(mean_update.square().sum()), self.config.epsilon
        )
        # w - step * (w - mean), written around `mean` so that a step of 1 is FedAvg's mean exactly.
        return ((1.0 - self.last_step) * current + self.last_step * mean).float()

    def update_weight(self, update: ClientUpdate) -> float:
        """``p_i`` before normalisation: 1 per update (``uniform``; an update of weight 0,
        which trained on nothing, stays 0) or the update's own weight (``samples``)."""
        if self.config.weighting == "samples":
            return update.weight
        return 1.0 if update.weight > 0 else 0.0

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        """``server_step``: the eta_g of the round just aggregated."""
        return {SERVER_STEP: self.last_step}


@hookimpl
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    register(FedExPConfig, FedExP)
