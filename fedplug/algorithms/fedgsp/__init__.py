"""FedGSP: grouped sequential-to-parallel training, as a grouper plugin.

Paper: Shenglai Zeng, Zonghang Li, Hongfang Yu, Yihong He, Zenglin Xu, Dusit Niyato and
Han Yu, "Heterogeneous Federated Learning via Grouped Sequential-to-Parallel Training"
(FedGSP), DASFAA 2022, arXiv:2201.12976.

Each round the sampled clients form M = f(r) groups of alike class distributions
(``growth``, ``groups``, built on the general ``balanced_kmeans``); a fraction of the
groups trains, each as a chain, and the server averages the chains' last models
(``grouper``). ``cpd`` measures how alike the groups are. Design notes: docs/algorithms.md.
"""

from __future__ import annotations

from fedplug.algorithms.fedgsp.balanced_kmeans import (
    COST_RESOLUTION,
    BalancedAssigner,
    balanced_assignment,
    balanced_kmeans,
    cluster_potentials,
    integer_costs,
)
from fedplug.algorithms.fedgsp.cpd import (
    CPD_ANALYSIS,
    CPD_NOTE,
    DEFAULT_CPD_SIGMA,
    cpd,
    cpd_summary,
    group_cpd_metrics,
)
from fedplug.algorithms.fedgsp.grouper import (
    INCOMPATIBLE_AGGREGATORS,
    FedGSPConfig,
    FedGSPGrouper,
)
from fedplug.algorithms.fedgsp.groups import inter_cluster_groups, random_groups
from fedplug.algorithms.fedgsp.growth import MAX_GROWTH, GrowthKind, growth, num_groups
from fedplug.hookspecs import RegisterGrouper, hookimpl

__all__ = [
    "COST_RESOLUTION",
    "CPD_ANALYSIS",
    "CPD_NOTE",
    "DEFAULT_CPD_SIGMA",
    "INCOMPATIBLE_AGGREGATORS",
    "MAX_GROWTH",
    "BalancedAssigner",
    "FedGSPConfig",
    "FedGSPGrouper",
    "GrowthKind",
    "balanced_assignment",
    "balanced_kmeans",
    "cluster_potentials",
    "cpd",
    "cpd_summary",
    "fedplug_register_groupers",
    "group_cpd_metrics",
    "growth",
    "integer_costs",
    "inter_cluster_groups",
    "num_groups",
    "random_groups",
]


@hookimpl
def fedplug_register_groupers(register: RegisterGrouper) -> None:
    register(FedGSPConfig, FedGSPGrouper)
