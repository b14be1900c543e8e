"""fedplug's defaults: uniform shuffling, plain cross-entropy and no grouping.

What an experiment gets when it names no other sampler (``uniform``), loss transform
(``cross_entropy``) or grouper (``none``): ordinary federated training as in FedAvg
(McMahan et al., AISTATS 2017, arXiv:1602.05629). Details: docs/algorithms.md, "Defaults".
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from fedplug.algorithms.fedgsp import CPD_ANALYSIS, DEFAULT_CPD_SIGMA, group_cpd_metrics
from fedplug.components import (
    ClientNeeds,
    ComponentConfig,
    Grouper,
    LossTransform,
    RoundPlan,
    Sampler,
)
from fedplug.hookspecs import RegisterGrouper, RegisterLossTransform, RegisterSampler, hookimpl


class UniformSamplerConfig(ComponentConfig):
    """Shuffle the client's samples every local epoch (the default sampler)."""

    name: Literal["uniform"] = "uniform"


class UniformSampler(Sampler):
    """A fresh permutation of the client's local indices each epoch.

    Args:
        config: the validated :class:`UniformSamplerConfig` (it has no parameters).
    """

    def __init__(self, config: UniformSamplerConfig | None = None) -> None:
        self.config = config or UniformSamplerConfig()

    def client_needs(self) -> ClientNeeds:
        """Any training loop's shuffled epoch: nothing fedplug-specific on the client."""
        return ClientNeeds()

    def epoch_indices(
        self, labels: np.ndarray, class_counts: np.ndarray, round_index: int, rng: np.random.Generator
    ) -> np.ndarray:
        """Every index in ``range(len(labels))`` exactly once, in the order ``rng`` draws."""
        return rng.permutation(len(labels))


class CrossEntropyConfig(ComponentConfig):
    """Plain cross-entropy on the model's logits (the default loss transform)."""

    name: Literal["cross_entropy"] = "cross_entropy"


class CrossEntropy(LossTransform):
    """The base :class:`~fedplug.components.LossTransform`'s loss, plain cross-entropy:
    what any client's training loop already computes."""

    def client_needs(self) -> ClientNeeds:
        return ClientNeeds()


def build_cross_entropy(config: CrossEntropyConfig) -> LossTransform:
    """Plain cross-entropy."""
    return CrossEntropy()


class NoGroupingConfig(ComponentConfig):
    """Every sampled client trains alone from the global model (the default grouper)."""

    name: Literal["none"] = "none"
    analysis = CPD_ANALYSIS


class NoGrouping(Grouper):
    """One chain of length one per sampled client, weighted by samples.

    Args:
        config: the validated :class:`NoGroupingConfig` (it has no parameters).
    """

    def __init__(self, config: NoGroupingConfig | None = None) -> None:
        self.config = config or NoGroupingConfig()

    def plan(self, round_number: int, clients: np.ndarray, rng: np.random.Generator) -> RoundPlan:
        """Each client of ``clients`` in its own chain and its own group, in the given order."""
        singletons = [[int(client)] for client in clients]
        return RoundPlan(
            chains=singletons,
            weighting="samples",
            groups=[list(chain) for chain in singletons],
        )

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        """The CPD between the round's clients (each its own group, as in FedGSP's Figure
        3a), when the runtime knows the class counts; FedGSP's baseline."""
        return group_cpd_metrics(plan, class_counts, DEFAULT_CPD_SIGMA)


@hookimpl
def fedplug_register_samplers(register: RegisterSampler) -> None:
    register(UniformSamplerConfig, UniformSampler)


@hookimpl
def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
    register(CrossEntropyConfig, build_cross_entropy)


@hookimpl
def fedplug_register_groupers(register: RegisterGrouper) -> None:
    register(NoGroupingConfig, NoGrouping)
