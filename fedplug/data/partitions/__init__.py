"""Partitioners: how a dataset's training samples are spread over K federated clients.

Every partitioner is a pure function of ``(labels, num_classes, num_clients, config, rng,
users)`` returning a :class:`Partition` (each client's indices and the K x C class
counts). ``partitioners`` holds the configs and registered factories, ``sampling`` the
maths, ``partition`` the result and its file. Sources: docs/algorithms.md, "Partitions".
"""

from __future__ import annotations

from fedplug.data.partitions.partition import (
    ClientIndices,
    Partition,
    flat_indices,
    load_partition,
    save_partition,
)
from fedplug.data.partitions.partitioners import (
    PARTITIONERS,
    DirichletClassConfig,
    DirichletClientConfig,
    DirichletSizeConfig,
    FeatureNoiseConfig,
    IidConfig,
    LltConfig,
    NaturalConfig,
    ShardsConfig,
    dirichlet_class,
    dirichlet_client,
    dirichlet_size,
    dirichlet_sizes,
    feature_noise,
    iid,
    llt,
    natural,
    shards,
)
from fedplug.data.partitions.sampling import (
    DIRICHLET_CLIENT_BATCH,
    add_feature_noise,
    assignment_from_counts,
    balanced_counts_from_shares,
    class_counts_of,
    counts_by_client,
    counts_from_shares,
    dirichlet_class_counts,
    dirichlet_client_counts,
    draw_without_replacement,
    equal_sizes,
    feature_noise_std,
    iid_assignment,
    indices_from_assignment,
    llt_shares,
    natural_assignment,
    shards_assignment,
)
from fedplug.hookspecs import RegisterPartitioner, hookimpl

__all__ = [
    "DIRICHLET_CLIENT_BATCH",
    "PARTITIONERS",
    "ClientIndices",
    "DirichletClassConfig",
    "DirichletClientConfig",
    "DirichletSizeConfig",
    "FeatureNoiseConfig",
    "IidConfig",
    "LltConfig",
    "NaturalConfig",
    "Partition",
    "ShardsConfig",
    "add_feature_noise",
    "assignment_from_counts",
    "balanced_counts_from_shares",
    "class_counts_of",
    "counts_by_client",
    "counts_from_shares",
    "dirichlet_class",
    "dirichlet_class_counts",
    "dirichlet_client",
    "dirichlet_client_counts",
    "dirichlet_size",
    "dirichlet_sizes",
    "draw_without_replacement",
    "equal_sizes",
    "feature_noise",
    "feature_noise_std",
    "fedplug_register_partitioners",
    "flat_indices",
    "iid",
    "iid_assignment",
    "indices_from_assignment",
    "llt",
    "llt_shares",
    "load_partition",
    "natural",
    "natural_assignment",
    "save_partition",
    "shards",
    "shards_assignment",
]


@hookimpl
def fedplug_register_partitioners(register: RegisterPartitioner) -> None:
    for config_class, factory in PARTITIONERS:
        register(config_class, factory)
