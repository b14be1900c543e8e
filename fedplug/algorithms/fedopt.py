"""FedAdam, FedYogi and FedAdagrad: adaptive optimisers on the server.

    Adaptive Federated Optimization. Sashank J. Reddi, Zachary Charles, Manzil Zaheer,
    Zachary Garrett, Keith Rush, Jakub Konecny, Sanjiv Kumar, H. Brendan McMahan.
    ICLR 2021, arXiv:2003.00295.

The averaged client change is a pseudo-gradient for an adaptive server step (the paper's
Algorithm 2). The update and the choices where implementations differ (initial ``v``, no
bias correction, weighting, defaults): docs/algorithms.md, "FedAdam, FedYogi, FedAdagrad".
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from fedplug.algorithms.attribute_state import AttributeState
from fedplug.components import Aggregator, ClientUpdate, ComponentConfig, average_models
from fedplug.hookspecs import RegisterAggregator, hookimpl


class AdaptiveConfig(ComponentConfig):
    """The parameters FedAdagrad, FedAdam and FedYogi share (the paper's Algorithm 2)."""

    server_lr: float = Field(default=0.01, gt=0.0, le=10.0)
    """Server learning rate eta_s (default 0.01; FedAdagrad's 0.1)."""
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """Decay of the first moment m (default 0.9; 0.0 uses the round's change alone)."""
    tau: float = Field(default=1e-3, gt=0.0, le=1.0)
    """Adaptivity floor added to sqrt(v) (default 1e-3); v also starts at tau^2."""


class FedAdagradConfig(AdaptiveConfig):
    """FedAdagrad (Reddi et al. 2021): Adagrad on the server's pseudo-gradient."""

    name: Literal["fedadagrad"] = "fedadagrad"
    server_lr: float = Field(default=0.1, gt=0.0, le=10.0)
    """Server learning rate eta_s (default 0.1)."""


class FedAdamConfig(AdaptiveConfig):
    """FedAdam (Reddi et al. 2021): Adam on the server's pseudo-gradient."""

    name: Literal["fedadam"] = "fedadam"
    beta2: float = Field(default=0.99, ge=0.0, lt=1.0)
    """Decay of the second moment v (default 0.99)."""


class FedYogiConfig(AdaptiveConfig):
    """FedYogi (Reddi et al. 2021): Yogi on the server's pseudo-gradient."""

    name: Literal["fedyogi"] = "fedyogi"
    beta2: float = Field(default=0.99, ge=0.0, lt=1.0)
    """Rate (1 - beta2) at which v moves towards delta^2 (default 0.99)."""


class AdaptiveServerOptimizer(AttributeState, Aggregator):
    """Shared server step of FedAdagrad, FedAdam and FedYogi, built from the variant's
    config; subclasses give the v update."""

    state_attributes = ("first_moment", "second_moment")

    def __init__(self, config: AdaptiveConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.config = config
        self.first_moment: Tensor | None = None
        self.second_moment: Tensor | None = None

    def initialize(self, global_vector: Tensor) -> None:
        """``m = 0`` and ``v = tau^2`` (Algorithm 2's ``v_{-1} >= tau^2``)."""
        self.first_moment, self.second_moment = self._initial_moments(global_vector)

    def _initial_moments(self, global_vector: Tensor) -> tuple[Tensor, Tensor]:
        first_moment = torch.zeros_like(global_vector, dtype=torch.float32)
        second_moment = torch.full_like(global_vector, self.config.tau**2, dtype=torch.float32)
        return first_moment, second_moment

    def _moments(self, global_vector: Tensor) -> tuple[Tensor, Tensor]:
        """The current (m, v), initialised on first use if :meth:`initialize` was skipped."""
        if self.first_moment is None or self.second_moment is None:
            self.first_moment, self.second_moment = self._initial_moments(global_vector)
        return self.first_moment, self.second_moment

    @abstractmethod
    def next_second_moment(self, previous: Tensor, squared_delta: Tensor) -> Tensor:
        """The variant's update of v from its previous value and ``delta^2``."""

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """One adaptive step along the averaged client change."""
        mean = average_models(updates, self.config.name).mean
        first_moment, second_moment = self._moments(global_vector)
        current = global_vector.detach().float()
        delta = (mean - current.double()).float()
        beta1 = self.config.beta1
        self.first_moment = beta1 * first_moment + (1.0 - beta1) * delta
        self.second_moment = self.next_second_moment(second_moment, delta.square())
        step = self.first_moment / (self.second_moment.sqrt() + self.config.tau)
        return current + self.config.server_lr * step


class FedAdagrad(AdaptiveServerOptimizer):
    """``v = v + delta^2``."""

    config: FedAdagradConfig

    def next_second_moment(self, previous: Tensor, squared_delta: Tensor) -> Tensor:
        return previous + squared_delta


class FedAdam(AdaptiveServerOptimizer):
    """``v = beta2 v + (1 - beta2) delta^2``."""

    config: FedAdamConfig

    def next_second_moment(self, previous: Tensor, squared_delta: Tensor) -> Tensor:
        beta2 = self.config.beta2
        return beta2 * previous + (1.0 - beta2) * squared_delta


class FedYogi(AdaptiveServerOptimizer):
    """``v = v - (1 - beta2) delta^2 sign(v - delta^2)``."""

    config: FedYogiConfig

    def next_second_moment(self, previous: Tensor, squared_delta: Tensor) -> Tensor:
        beta2 = self.config.beta2
        return previous - (1.0 - beta2) * squared_delta * torch.sign(previous - squared_delta)


@hookimpl
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    register(FedAdagradConfig, FedAdagrad)
    register(FedAdamConfig, FedAdam)
    register(FedYogiConfig, FedYogi)
