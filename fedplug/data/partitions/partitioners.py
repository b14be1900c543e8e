"""The built-in partitioners: each config (its parameters, with defaults) and its
registered factory, which checks the request and calls the maths in ``sampling``.
Sources of each partition: docs/algorithms.md, section "Partitions"."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from fedplug.components import ComponentConfig
from fedplug.data.partitions.partition import Partition
from fedplug.data.partitions.sampling import (
    _check_request,
    _partition,
    assignment_from_counts,
    counts_from_shares,
    dirichlet_class_counts,
    dirichlet_client_counts,
    equal_sizes,
    feature_noise_std,
    iid_assignment,
    llt_shares,
    natural_assignment,
    shards_assignment,
)
from fedplug.errors import DataError
from fedplug.hookspecs import PartitionerFactory


class IidConfig(ComponentConfig):
    """IID: shuffle the training set and cut it into K parts of (almost) equal size."""

    name: Literal["iid"] = "iid"


class DirichletClassConfig(ComponentConfig):
    """Label skew by class ("LDA"): each class is spread over clients by p_c ~ Dir_K(alpha)."""

    name: Literal["dirichlet_class"] = "dirichlet_class"
    alpha: float = Field(0.5, gt=0, le=1e6)
    """Dirichlet concentration (default 0.5); smaller is more skewed (0.1 is strong skew)."""
    min_size: int = Field(10, ge=0, le=1_000_000)
    """Redraw until every client holds at least this many samples (default 10, the
    FedML/NIID-Bench convention; 0 accepts the first draw)."""
    max_attempts: int = Field(1000, ge=1, le=1_000_000)
    """Give up with a DataError after this many draws (default 1000)."""
    balance: bool = False
    """Apply the balance rule of the FedMA/NIID-Bench/FedML reference code (default false):
    while class c is spread, a client already holding at least N/K samples gets none of
    it (:func:`balanced_counts_from_shares`); flwr-datasets calls it ``self_balancing``.
    It makes client sizes far more even (MNIST's class sizes, K = 10, alpha = 0.1: the
    client sizes' coefficient of variation is 0.63 without and 0.44 with it, averaged over
    200 draws). Off by default so that existing splits stay the same; the shares are
    drawn identically either way."""


class DirichletClientConfig(ComponentConfig):
    """Label skew by client (Hsu et al.): equal sizes, label mix q_k ~ Dir(alpha * prior)."""

    name: Literal["dirichlet_client"] = "dirichlet_client"
    alpha: float = Field(1.0, gt=0, le=1e6)
    """Concentration (default 1.0): large makes every client look like the prior, near 0
    gives one class per client."""


class DirichletSizeConfig(ComponentConfig):
    """Quantity skew (NIID-Bench): IID labels, client sizes from shares q ~ Dir_K(beta)."""

    name: Literal["dirichlet_size"] = "dirichlet_size"
    beta: float = Field(0.5, gt=0, le=1e6)
    """Dirichlet concentration of the client sizes (default 0.5, NIID-Bench's setting);
    smaller is more skewed, large gives (almost) equal sizes."""
    min_size: int = Field(10, ge=0, le=1_000_000)
    """Samples every client holds at least (default 10, the NIID-Bench/FedML convention;
    0 gives exactly NIID-Bench's sizes). Each client gets ``min_size`` first and the rest
    is shared out by q (:func:`dirichlet_sizes`): one draw, never a redraw, so any
    ``num_clients * min_size`` up to the number of samples works."""


class ShardsConfig(ComponentConfig):
    """Pathological split (McMahan et al.): sort by label, deal out equal shards."""

    name: Literal["shards"] = "shards"
    shards_per_client: int = Field(2, ge=1, le=10_000)
    """Shards each client receives (default 2, McMahan et al.'s setting)."""


class LltConfig(ComponentConfig):
    """Label long-tail (IWDS): each class mostly on its "main" clients, a thin tail elsewhere."""

    name: Literal["llt"] = "llt"
    alpha_l: float = Field(0.9, gt=0, lt=1)
    """Share of each class given to its main clients (default 0.9; the IWDS paper uses
    0.9 and 0.99). Needs num_clients to be a multiple of the number of classes."""


class FeatureNoiseConfig(ComponentConfig):
    """Feature skew (FedDisk): IID labels, each client's inputs get Gaussian noise whose std
    ramps linearly over the clients up to sigma (:func:`feature_noise_std`)."""

    name: Literal["feature_noise"] = "feature_noise"
    sigma: float = Field(0.1, ge=0, le=10)
    """Noise std of the last client (default 0.1, NIID-Bench's noise level); 0 means no
    noise. Inputs are assumed scaled to [0, 1]."""
    convention: Literal["fedplug", "niid_bench"] = "fedplug"
    """The ramp: ``"fedplug"`` (default) gives client k = 1..K the std sigma * k / K (no
    client is clean); ``"niid_bench"`` gives client k = 0..K-1 the std sigma * k / (K - 1),
    as NIID-Bench's code does (client 0 clean). Same last client, same split."""


class NaturalConfig(ComponentConfig):
    """Natural split: one client per writer of the dataset (FEMNIST/LEAF)."""

    name: Literal["natural"] = "natural"


def _partition_by_counts(
    labels: np.ndarray, num_classes: int, counts: np.ndarray, num_clients: int, rng: np.random.Generator
) -> Partition:
    """The partition that gives client k ``counts[k, c]`` random samples of each class c."""
    assignment = assignment_from_counts(labels, counts, rng)
    del counts  # K x C: not kept while the indices are grouped
    return _partition(labels, num_classes, assignment, num_clients, rng)


def iid(
    labels: np.ndarray, num_classes: int, num_clients: int, config: IidConfig,
    rng: np.random.Generator, users: np.ndarray | None = None,
) -> Partition:
    """IID split: K random parts of sizes n // K or n // K + 1. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    assignment = iid_assignment(labels.size, num_clients, rng)
    return _partition(labels, num_classes, assignment, num_clients, rng)


def dirichlet_class(
    labels: np.ndarray, num_classes: int, num_clients: int, config: DirichletClassConfig,
    rng: np.random.Generator, users: np.ndarray | None = None,
) -> Partition:
    """LDA split (:func:`dirichlet_class_counts`, with the balance rule when
    ``config.balance``); client sizes vary. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    class_sizes = np.bincount(labels, minlength=num_classes)
    counts = dirichlet_class_counts(
        class_sizes,
        num_clients,
        config.alpha,
        config.min_size,
        config.max_attempts,
        rng,
        balance=config.balance,
    )
    return _partition_by_counts(labels, num_classes, counts, num_clients, rng)


def dirichlet_client(
    labels: np.ndarray, num_classes: int, num_clients: int, config: DirichletClientConfig,
    rng: np.random.Generator, users: np.ndarray | None = None,
) -> Partition:
    """Hsu et al.'s split (:func:`dirichlet_client_counts`). Client sizes are n // K; when
    K does not divide n the first n mod K clients get one sample more, so that every
    sample is placed. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    class_sizes = np.bincount(labels, minlength=num_classes)
    sizes = equal_sizes(labels.size, num_clients)
    # The K x C counts go straight in, so that no name here keeps them while the indices
    # are grouped.
    return _partition_by_counts(
        labels, num_classes, dirichlet_client_counts(class_sizes, sizes, config.alpha, rng), num_clients, rng
    )


def dirichlet_sizes(
    num_samples: int, num_clients: int, beta: float, min_size: int, rng: np.random.Generator
) -> np.ndarray:
    """K client sizes adding up to ``num_samples``: ``min_size`` each, and the
    ``num_samples - K * min_size`` left over cut by cumulative shares q ~ Dir_K(beta), as
    NIID-Bench's ``np.split(idx, (cumsum(q) * n)[:-1])`` cuts all of them (Q. Li et al.,
    arXiv:2102.02079, "quantity skew"). NIID-Bench redraws q until every client has 10
    samples; for MNIST's 60,000 samples over K = 100 clients at beta = 0.5 fewer than one
    draw in 10,000 passes, so the floor is given first instead: one draw, and the split
    of the rest exactly Dirichlet.

    Raises:
        DataError: ``num_clients * min_size`` is more than ``num_samples``.
    """
    spare = num_samples - num_clients * min_size
    if spare < 0:
        raise DataError(
            f"dirichlet_size: {num_clients} clients x min_size {min_size} needs {num_clients * min_size} "
            f"samples but there are {num_samples}; set min_size to at most {num_samples // num_clients}"
        )
    shares = rng.dirichlet(np.full(num_clients, beta))
    cuts = np.minimum(np.floor(np.cumsum(shares) * spare).astype(np.int64), spare)
    cuts[-1] = spare  # every sample placed, whatever the rounding of the cumulative shares
    return np.diff(cuts, prepend=0) + min_size


def dirichlet_size(
    labels: np.ndarray, num_classes: int, num_clients: int, config: DirichletSizeConfig,
    rng: np.random.Generator, users: np.ndarray | None = None,
) -> Partition:
    """Quantity skew: sizes from :func:`dirichlet_sizes`, each client's samples drawn
    uniformly at random (so its label mix is the dataset's, up to sampling).
    ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    sizes = dirichlet_sizes(labels.size, num_clients, config.beta, config.min_size, rng)
    assignment = np.empty(labels.size, dtype=np.int64)
    assignment[rng.permutation(labels.size)] = np.repeat(np.arange(num_clients, dtype=np.int64), sizes)
    return _partition(labels, num_classes, assignment, num_clients, rng)


def shards(
    labels: np.ndarray, num_classes: int, num_clients: int, config: ShardsConfig,
    rng: np.random.Generator, users: np.ndarray | None = None,
) -> Partition:
    """Pathological split (:func:`shards_assignment`). ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    assignment = shards_assignment(labels, num_clients, config.shards_per_client, rng)
    return _partition(labels, num_classes, assignment, num_clients, rng)


def llt(
    labels: np.ndarray, num_classes: int, num_clients: int, config: LltConfig,
    rng: np.random.Generator, users: np.ndarray | None = None,
) -> Partition:
    """Label long-tail split (:func:`llt_shares`, including its K > C quirk): each class's
    shuffled indices are cut at the cumulative shares. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    shares = llt_shares(num_clients, num_classes, config.alpha_l)
    counts = counts_from_shares(shares, np.bincount(labels, minlength=num_classes))
    return _partition_by_counts(labels, num_classes, counts, num_clients, rng)


def feature_noise(
    labels: np.ndarray, num_classes: int, num_clients: int, config: FeatureNoiseConfig,
    rng: np.random.Generator, users: np.ndarray | None = None,
) -> Partition:
    """IID split plus a per-client noise std ramping up to sigma
    (:func:`feature_noise_std` with ``config.convention``, a reconstruction); whoever loads
    client k's inputs applies :func:`add_feature_noise`. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    assignment = iid_assignment(labels.size, num_clients, rng)
    noise_std = feature_noise_std(num_clients, config.sigma, config.convention)
    return _partition(labels, num_classes, assignment, num_clients, rng, noise_std)


def natural(
    labels: np.ndarray, num_classes: int, num_clients: int, config: NaturalConfig,
    rng: np.random.Generator, users: np.ndarray | None = None,
) -> Partition:
    """One client per writer (:func:`natural_assignment`); ``users[i]`` is the writer of
    sample i. ``rng`` only orders the indices within each client."""
    labels = _check_request(labels, num_classes, num_clients)
    if users is None:
        raise DataError(
            "the natural partition needs the writer of every sample, and this dataset has "
            "none: pick a dataset with users (e.g. femnist) or another partition"
        )
    users = np.asarray(users)
    if users.shape != labels.shape:
        raise DataError(
            f"users must give one writer per training sample: got shape {users.shape} for "
            f"{labels.size} samples; rebuild the dataset"
        )
    assignment = natural_assignment(users, num_clients)
    return _partition(labels, num_classes, assignment, num_clients, rng)


PARTITIONERS: tuple[tuple[type[ComponentConfig], PartitionerFactory], ...] = (
    (IidConfig, iid),
    (DirichletClassConfig, dirichlet_class),
    (DirichletClientConfig, dirichlet_client),
    (DirichletSizeConfig, dirichlet_size),
    (ShardsConfig, shards),
    (LltConfig, llt),
    (FeatureNoiseConfig, feature_noise),
    (NaturalConfig, natural),
)
"""The built-in partitioners: (config class, which names the partitioner; factory)."""
