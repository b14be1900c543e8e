"""FedAvg: the sample-weighted average of the clients' models.

    Communication-Efficient Learning of Deep Networks from Decentralized Data.
    H. Brendan McMahan, Eider Moore, Daniel Ramage, Seth Hampson, Blaise Aguera y Arcas.
    AISTATS 2017, arXiv:1602.05629.

Server update over the clients S that replied this round::

    w^{t+1} = sum_{k in S} p_k w_k^{t+1},   p_k = weight_k / sum_{j in S} weight_j

where ``weight_k`` is :attr:`ClientUpdate.weight` (n_k for a client, or 1 for a uniformly
weighted group). The client side is plain local training.

The streaming weighted average itself, which the other server-side optimisers (FedAvgM,
FedAdam, ...) start from too, is :func:`fedplug.components.average_models`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from torch import Tensor

from fedplug.components import Aggregator, ClientUpdate, ComponentConfig, average_models
from fedplug.hookspecs import RegisterAggregator, hookimpl


class FedAvgConfig(ComponentConfig):
    """FedAvg (McMahan et al. 2017): the sample-weighted mean of the client models."""

    name: Literal["fedavg"] = "fedavg"


class FedAvg(Aggregator):
    """Server side of FedAvg: ``w^{t+1} = sum_k p_k w_k`` (its config has no parameters)."""

    def __init__(self, config: FedAvgConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.config = config

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """The weighted mean of the updates, as float32."""
        return average_models(updates, self.config.name).mean.float()


@hookimpl
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    register(FedAvgConfig, FedAvg)
