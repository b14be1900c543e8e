"""FedGSP's grouper: its config (mode, growth, group fraction) and the grouper that forms
each round's chains."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import Field

from fedplug.algorithms.fedgsp.cpd import CPD_ANALYSIS, group_cpd_metrics
from fedplug.algorithms.fedgsp.groups import inter_cluster_groups, random_groups
from fedplug.algorithms.fedgsp.growth import GrowthKind, num_groups
from fedplug.components import ClientNeeds, ComponentConfig, FederationView, Grouper, RoundPlan

INCOMPATIBLE_AGGREGATORS = {
    "scaffold": (
        "SCAFFOLD keeps one control variate per client and corrects each client's steps "
        "with it; along a chain of different clients the model a client receives is not "
        "the global model its variate refers to, so the correction is undefined"
    ),
    "fednova": (
        "FedNova normalises each reply by the number of local steps of the one client "
        "that produced it; a chain's model carries the steps of several clients with "
        "different data sizes, so that normalisation is undefined"
    ),
}


class FedGSPConfig(ComponentConfig):
    """FedGSP grouped sequential-to-parallel training (Zeng et al., 2022).

    Match the paper by sampling every client each round (client fraction 1.0): FedGSP
    regroups all clients and samples a fraction ``group_fraction`` of the groups itself.
    """

    name: Literal["fedgsp"] = "fedgsp"
    analysis = CPD_ANALYSIS
    mode: Literal["fedgsp", "naive_icg", "naive"] = "fedgsp"
    """``fedgsp``: ICG groups, M = f(r) growing; ``naive_icg``: ICG groups, M fixed
    (NaiveGSP+ICG); ``naive``: random groups, M fixed (NaiveGSP)."""
    growth: GrowthKind = "log"
    """Growth function f of the ``fedgsp`` mode: linear, log or exp (paper's best: log)."""
    alpha: float = Field(default=2.0, ge=0.0, le=100.0)
    """Growth rate of f (paper default 2.0)."""
    beta: float = Field(default=10.0, gt=0.0, le=1_000_000.0)
    """Initial number of groups and growth span of f (paper default 10)."""
    fixed_groups: int = Field(default=10, ge=1, le=1_000_000)
    """M of the naive modes, clipped to the number of sampled clients."""
    group_fraction: float = Field(default=0.3, gt=0.0, le=1.0)
    """kappa: fraction of the groups formed that train each round, ceil(kappa x groups)
    and at least one (paper default 0.3)."""
    max_iterations: int = Field(default=10, ge=1, le=1000)
    """tau: most balanced k-means iterations of ICG (paper: 10)."""
    cpd_sigma: float = Field(default=1.0, gt=0.0, le=1000.0)
    """Kernel width of the CPD metric reported every round."""

    def incompatibilities(self, train: Any) -> list[str]:
        """Reject aggregators whose client-side maths assumes one client per reply."""
        aggregator = train.aggregator.name
        reason = INCOMPATIBLE_AGGREGATORS.get(aggregator)
        if reason is None:
            return []
        message = (
            f"grouper 'fedgsp' cannot run with aggregator {aggregator!r}: {reason}; "
            "use fedavg, fedavgm, fedadam, fedyogi or fedadagrad"
        )
        return [message]


class FedGSPGrouper(Grouper):
    """Forms each round's chains by ICG (or at random) and samples a fraction of them.

    Holds no state between rounds: the groups are recomputed every round from the
    round's generator, so :meth:`state_dict` is empty and a resumed run regroups exactly
    as an uninterrupted one would.

    Args:
        config: the validated :class:`FedGSPConfig`.
    """

    def __init__(self, config: FedGSPConfig) -> None:
        self.config = config
        self.class_counts: np.ndarray | None = None

    def client_needs(self) -> ClientNeeds:
        """ICG groups clients by their class counts; random groups need nothing."""
        return ClientNeeds(class_counts=self.config.mode != "naive")

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        """The paper's CPD (eq. 14) between the round's groups, with ``cpd_sigma``."""
        return group_cpd_metrics(plan, class_counts, self.config.cpd_sigma)

    def prepare(self, federation: FederationView) -> None:
        """Keep ``federation``'s K x C class counts, which ICG clusters."""
        class_counts = np.asarray(federation.class_counts, dtype=np.float64)
        if class_counts.ndim != 2:
            raise ValueError(f"class_counts must be K x C, got shape {class_counts.shape}")
        self.class_counts = class_counts

    def num_groups(self, round_number: int, num_clients: int) -> int:
        """M of round ``round_number`` for ``num_clients`` sampled clients."""
        config = self.config
        if config.mode == "fedgsp":
            return num_groups(round_number, num_clients, config.growth, config.alpha, config.beta)
        return min(config.fixed_groups, num_clients)

    def plan(self, round_number: int, clients: np.ndarray, rng: np.random.Generator) -> RoundPlan:
        clients = np.asarray(clients, dtype=np.int64)
        if clients.size == 0:
            raise ValueError("FedGSP needs at least one sampled client")
        count = self.num_groups(round_number, clients.size)
        if self.config.mode == "naive":
            groups = random_groups(clients, count, rng)
        else:
            if self.class_counts is None:
                raise RuntimeError("FedGSPGrouper.prepare(federation) must run before plan()")
            local = inter_cluster_groups(
                self.class_counts[clients], count, rng, self.config.max_iterations
            )
            groups = [[int(clients[index]) for index in group] for group in local]
        # round() first: 0.3 * 10 is 3.0000000000000004 in floating point, not 3.
        num_sampled = max(1, math.ceil(round(self.config.group_fraction * len(groups), 9)))
        sampled = rng.choice(len(groups), size=num_sampled, replace=False)
        chains = [[int(client) for client in rng.permutation(groups[index])] for index in sampled]
        return RoundPlan(chains=chains, weighting="uniform", groups=groups)
