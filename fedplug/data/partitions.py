"""Partitioners: how a dataset's training samples are spread over K federated clients.

Every partitioner is a pure function of ``(labels, num_classes, num_clients, config, rng,
users)``: the same ``numpy.random.Generator`` state gives the same split, every sample
lands on exactly one client (``natural`` with fewer clients than writers drops the
smallest writers), and the K x C class-count matrix travels with the split
(:class:`Partition`). The maths lives in small pure helpers (``*_counts``, ``*_shares``,
``*_assignment``); the registered factories only unpack their config and call them.

Sources (the exact definitions are in ``shared/ALGORITHMS.md``, section "Partitions"):

- ``iid``: shuffle and cut into K parts of sizes differing by at most one.
- ``dirichlet_class`` ("LDA"): per class c, p_c ~ Dir_K(alpha), redrawn until every client
  holds ``min_size`` samples. M. Yurochkin et al., "Bayesian Nonparametric Federated
  Learning of Neural Networks", ICML 2019, arXiv:1905.12022; the redraw rule is the
  NIID-Bench/FedML convention of Q. Li, Y. Diao, Q. Chen, B. He, "Federated Learning on
  Non-IID Data Silos: An Experimental Study", ICDE 2022, arXiv:2102.02079. Used by FedShift
  (Y. Shen, H. Wang, H. Lv, "Federated Learning with Classifier Shift for Class Imbalance",
  2023, arXiv:2304.04972) and IWDS. ``balance: true`` adds the balance rule of the
  reference code (see :func:`balanced_counts_from_shares`).
- ``dirichlet_client``: equal client sizes, q_k ~ Dir(alpha * p). T.-M. H. Hsu, H. Qi,
  M. Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
  Classification", 2019, arXiv:1909.06335, section 3.
- ``shards``: sort by label, 2 shards per client. H. B. McMahan, E. Moore, D. Ramage,
  S. Hampson, B. Agüera y Arcas, "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017, arXiv:1602.05629.
- ``llt``: label long-tail partition of the IWDS paper ("Imbalanced Weight Decay Sampling",
  ``shared/papers/iwds-imbalanced-weight-decay-sampling.txt``; its authors' FedML-derived
  code), see :func:`llt_shares`.
- ``feature_noise``: feature skew by per-client Gaussian input noise, from "Federated
  Learning for distribution skewed data using sample weights" (FedDisk), section 7.1.1.
  Two per-client ramps: fedplug's own (the default) and NIID-Bench's
  (arXiv:2102.02079); see :func:`feature_noise_std`.
- ``natural``: the dataset's own writers, as in LEAF (S. Caldas et al., "LEAF: A Benchmark
  for Federated Settings", 2018, arXiv:1812.01097), used by FedGSP and FedDisk.

Within each client the indices are in a random order (drawn from ``rng``), so a later cut
of a client into local train and test parts is never class-sorted.
"""

from __future__ import annotations

import operator
import os
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
from pydantic import Field

from fedplug.components import ComponentConfig
from fedplug.errors import DataError
from fedplug.hookspecs import PartitionerFactory, RegisterPartitioner, hookimpl
from fedplug.output_folder import default_file_mode

# ------------------------------------------------------------------------------ result


class ClientIndices(Sequence[np.ndarray]):
    """K clients' index arrays held as one flat int64 array and K + 1 offsets: client k
    is ``flat[offsets[k]:offsets[k + 1]]`` (a view). Reads like a list of K arrays,
    without one Python object per client."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat = np.asarray(flat, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)

    @classmethod
    def from_sizes(cls, flat: np.ndarray, sizes: np.ndarray) -> ClientIndices:
        """``flat`` cut into consecutive parts of ``sizes``."""
        return cls(flat, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]
        client = operator.index(index)
        if client < 0:
            client += len(self)
        if not 0 <= client < len(self):
            raise IndexError(f"client {index} is out of range; there are {len(self)} clients")
        return self.flat[self.offsets[client] : self.offsets[client + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for client in range(len(self)):
            yield self.flat[self.offsets[client] : self.offsets[client + 1]]


def flat_indices(client_indices: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``client_indices`` as one int64 array and K + 1 offsets (no copy for a
    :class:`ClientIndices`)."""
    if isinstance(client_indices, ClientIndices):
        return client_indices.flat, client_indices.offsets
    parts = [np.asarray(indices, dtype=np.int64).reshape(-1) for indices in client_indices]
    sizes = np.array([len(part) for part in parts], dtype=np.int64)
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return flat, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Partition:
    """A split of a training set over K clients.

    ``eq=False`` because numpy arrays have no single truth value; compare partitions
    field by field.
    """

    client_indices: Sequence[np.ndarray]
    """One int64 array per client: the indices into the training set it holds (a list,
    or a :class:`ClientIndices`, as the built-in partitioners return)."""
    class_counts: np.ndarray
    """K x C int64 matrix N: ``class_counts[k, c]`` samples of class c on client k."""
    noise_std: np.ndarray | None = None
    """Per-client standard deviation of Gaussian input noise (length K), set only by
    ``feature_noise``; ``None`` means clean inputs."""

    @property
    def num_clients(self) -> int:
        """K, the number of clients."""
        return len(self.client_indices)

    @property
    def sizes(self) -> np.ndarray:
        """n_k of every client (length K, int64)."""
        if isinstance(self.client_indices, ClientIndices):
            return np.diff(self.client_indices.offsets)
        return np.array([len(indices) for indices in self.client_indices], dtype=np.int64)

    def validate(self, num_samples: int) -> None:
        """Check the partition against a training set of ``num_samples`` samples.

        Raises :class:`DataError` when an index is out of range, a sample sits on two
        clients, or ``class_counts``/``noise_std`` disagree with the client lists.
        """
        regenerate = "re-run the partition stage to regenerate it"
        if self.class_counts.ndim != 2 or self.class_counts.shape[0] != self.num_clients:
            raise DataError(
                f"partition has {self.num_clients} clients but class_counts has shape "
                f"{self.class_counts.shape}; {regenerate}"
            )
        if not np.array_equal(self.class_counts.sum(axis=1), self.sizes):
            raise DataError(
                f"partition class_counts rows do not add up to client sizes; {regenerate}"
            )
        if self.noise_std is not None and self.noise_std.shape != (self.num_clients,):
            raise DataError(
                f"partition noise_std has shape {self.noise_std.shape}, expected "
                f"({self.num_clients},); {regenerate}"
            )
        every = flat_indices(self.client_indices)[0]
        if every.size and (every.min() < 0 or every.max() >= num_samples):
            raise DataError(
                f"partition indexes samples outside 0..{num_samples - 1}: it was made for "
                f"another dataset; {regenerate}"
            )
        if np.bincount(every, minlength=num_samples).max(initial=0) > 1:
            raise DataError(f"partition puts a sample on more than one client; {regenerate}")


# ----------------------------------------------------------------------------- configs


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


# ---------------------------------------------------------------------- shared helpers


def _check_request(labels: np.ndarray, num_classes: int, num_clients: int) -> np.ndarray:
    """Validate the inputs common to every partitioner; return labels as int64."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be a 1-D array of class ids, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be integer class ids, got dtype {labels.dtype}")
    labels = labels.astype(np.int64, copy=False)
    if num_classes < 1:
        raise DataError(f"num_classes must be at least 1, got {num_classes}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(
            f"labels must lie in 0..{num_classes - 1}, found {labels.min()}..{labels.max()}: "
            "check the dataset's num_classes"
        )
    if num_clients < 1:
        raise DataError(f"num_clients must be at least 1, got {num_clients}")
    if num_clients > labels.size:
        raise DataError(
            f"cannot split {labels.size} samples over {num_clients} clients: set "
            f"num_clients to at most {labels.size}"
        )
    return labels


def class_counts_of(
    labels: np.ndarray, client_indices: list[np.ndarray], num_classes: int
) -> np.ndarray:
    """The K x C int64 matrix of class counts of ``client_indices`` under ``labels``."""
    labels = np.asarray(labels, dtype=np.int64)
    num_clients = len(client_indices)
    if num_clients == 0:
        return np.zeros((0, num_classes), dtype=np.int64)
    every, offsets = flat_indices(client_indices)
    return counts_by_client(labels, every, offsets, num_classes)


def counts_by_client(
    labels: np.ndarray, ids: np.ndarray | None, offsets: np.ndarray, num_classes: int
) -> np.ndarray:
    """K x C int64 counts of ``labels[ids]`` (of ``labels`` itself when ``ids`` is None),
    client k owning positions ``offsets[k]:offsets[k + 1]``; counted in blocks, so the
    temporaries stay small whatever the number of samples."""
    num_clients = len(offsets) - 1
    counts = np.zeros(num_clients * num_classes, dtype=np.int64)
    owners = np.repeat(np.arange(num_clients, dtype=np.min_scalar_type(max(num_clients - 1, 0))), np.diff(offsets))
    block = 1 << 22
    for start in range(0, len(owners), block):
        chosen = labels[start : start + block] if ids is None else labels[ids[start : start + block]]
        keys = owners[start : start + block].astype(np.int64) * num_classes + chosen
        counts += np.bincount(keys, minlength=num_clients * num_classes)
    return counts.reshape(num_clients, num_classes)


def equal_sizes(num_samples: int, num_clients: int) -> np.ndarray:
    """K sizes adding up to ``num_samples``: n // K each, one more for the first n mod K."""
    sizes = np.full(num_clients, num_samples // num_clients, dtype=np.int64)
    sizes[: num_samples % num_clients] += 1
    return sizes


def _narrow(keys: np.ndarray, largest: int) -> np.ndarray:
    """Non-negative integer ``keys`` up to ``largest`` in the smallest unsigned dtype."""
    return keys.astype(np.min_scalar_type(max(largest, 0)), copy=False)


def _stable_order(keys: np.ndarray, largest: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for non-negative keys up to ``largest``; keys
    are narrowed to the smallest unsigned dtype first, which lets numpy radix-sort 8- and
    16-bit keys (about 4x faster than sorting int64 at a million samples)."""
    return np.argsort(_narrow(keys, largest), kind="stable")


def indices_from_assignment(
    assignment: np.ndarray, num_clients: int, rng: np.random.Generator
) -> ClientIndices:
    """Turn ``assignment[i]`` (client of sample i, or -1 for none) into per-client index
    arrays, each in a random order drawn from ``rng``. O(n), no per-sample loop."""
    order = rng.permutation(assignment.size)
    if (assignment >= 0).all():
        owners = _narrow(assignment, num_clients - 1)[order]
    else:
        owners = assignment[order]
        kept = owners >= 0
        order, owners = order[kept], _narrow(owners[kept], num_clients - 1)
        del kept
    sizes = np.bincount(owners, minlength=num_clients)
    # A stable sort by owner keeps the random order within each client.
    if owners.dtype.itemsize != 4:
        grouped = order[np.argsort(owners, kind="stable")]
    else:
        # Owners of 17 to 32 bits: sorted as two 16-bit digits, the low one first, each
        # by a stable radix sort. That is the order of one stable sort (by high digit,
        # then low, then position) in linear time (a million clients over ten million
        # samples: 0.3 s instead of 2 s), each step's temporaries freed before the next.
        by_low = np.argsort(owners.astype(np.uint16), kind="stable")
        high = (owners >> 16).astype(np.uint16)[by_low]
        del owners
        order = order[by_low]
        del by_low
        by_high = np.argsort(high, kind="stable")
        del high
        grouped = order[by_high]
    return ClientIndices.from_sizes(grouped.astype(np.int64, copy=False), sizes)


def assignment_from_counts(
    labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Give client k ``counts[k, c]`` samples of class c, chosen at random.

    Each class's indices are shuffled once and dealt out in client order, i.e. the
    class's shuffled list is cut at the cumulative sums of ``counts[:, c]``. The column
    sums of ``counts`` must equal the class sizes.
    """
    num_clients, num_classes = counts.shape
    shuffled = rng.permutation(labels.size)
    by_class = shuffled[_stable_order(_narrow(labels, num_classes - 1)[shuffled], num_classes - 1)]
    del shuffled
    # by_class lists class 0's samples (shuffled), then class 1's, ...; the owners in
    # that order are client 0 repeated counts[0, 0] times, client 1 counts[1, 0] times, ...
    client_ids = np.arange(num_clients, dtype=np.min_scalar_type(max(num_clients - 1, 0)))
    owners = np.repeat(np.tile(client_ids, num_classes), counts.T.ravel())
    assignment = np.empty(labels.size, dtype=np.int64)
    assignment[by_class] = owners
    return assignment


def counts_from_shares(shares: np.ndarray, class_sizes: np.ndarray) -> np.ndarray:
    """Cut each class by cumulative shares, as ``np.split(idx, (cumsum(p) * n_c)[:-1])``.

    ``shares`` is C x K (row c: how class c is spread over clients, summing to 1);
    returns the K x C int64 count matrix. Client k of class c receives
    ``floor(S_k n_c) - floor(S_{k-1} n_c)`` with S the cumulative shares and the last cut
    pinned to n_c, so every sample is placed despite rounding.
    """
    class_sizes = np.asarray(class_sizes, dtype=np.int64)
    cuts = np.floor(np.cumsum(shares, axis=1) * class_sizes[:, None]).astype(np.int64)
    cuts = np.minimum(cuts, class_sizes[:, None])
    cuts[:, -1] = class_sizes
    counts = np.diff(cuts, axis=1, prepend=0)
    return counts.T.astype(np.int64)


def balanced_counts_from_shares(shares: np.ndarray, class_sizes: np.ndarray) -> np.ndarray:
    """:func:`counts_from_shares` with the balance rule of the reference code.

    Classes are spread in order c = 0..C-1. Before class c is cut, every client already
    holding at least N/K samples (N = ``class_sizes.sum()``, K clients; the comparison is
    ``n_k * K >= N`` in integers) has its share set to 0, and the remaining shares are
    renormalised: ``p_k <- p_k [n_k < N/K] / sum_j p_j [n_j < N/K]``. The class is then cut
    at the floored cumulative shares as in :func:`counts_from_shares`.

    Source: the ``noniid-labeldir`` branch of ``partition_data`` in NIID-Bench's
    ``utils.py`` (github.com/Xtra-Computing/NIID-Bench, the line after ``## Balance``:
    ``proportions = np.array([p * (len(idx_j) < N / n_parties) ...])``); the same line is
    in FedMA's ``utils.py`` (github.com/IBM/FedMA, ``partition_data``) and in FedML's
    ``partition_class_samples_with_dirichlet_distribution``
    (github.com/FedML-AI/FedML, ``python/fedml/core/data/noniid_partition.py``), the code
    the IWDS authors built on. flwr-datasets' ``DirichletPartitioner`` offers it
    as ``self_balancing`` (default off) with a slightly different test: it excludes a
    client only when it holds *more* than N/K samples; we follow the reference code
    (``>=`` excludes).

    While a class with samples is left, at least one client is below N/K (the clients hold
    fewer than N samples in all), so some share survives; should the surviving shares all
    be 0 (a Dirichlet draw can underflow at tiny alpha), where the reference code would
    divide by zero, the class is spread evenly over the clients still below N/K.

    Returns the K x C int64 count matrix; ``shares`` is C x K as in
    :func:`counts_from_shares`.
    """
    class_sizes = np.asarray(class_sizes, dtype=np.int64)
    num_classes, num_clients = shares.shape
    total = int(class_sizes.sum())
    counts = np.zeros((num_clients, num_classes), dtype=np.int64)
    held = np.zeros(num_clients, dtype=np.int64)
    for label in range(num_classes):
        if class_sizes[label] == 0:
            continue
        open_clients = held * num_clients < total
        row = np.where(open_clients, shares[label], 0.0)
        mass = row.sum()
        if not np.isfinite(mass) or mass <= 0:
            row, mass = open_clients.astype(np.float64), float(open_clients.sum())
        column = counts_from_shares((row / mass)[None, :], class_sizes[label : label + 1])[:, 0]
        counts[:, label] = column
        held += column
    return counts


def _partition(
    labels: np.ndarray,
    num_classes: int,
    assignment: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    noise_std: np.ndarray | None = None,
) -> Partition:
    client_indices = indices_from_assignment(assignment, num_clients, rng)
    return Partition(
        client_indices=client_indices,
        class_counts=class_counts_of(labels, client_indices, num_classes),
        noise_std=noise_std,
    )


# ------------------------------------------------------------------------------- maths


def iid_assignment(num_samples: int, num_clients: int, rng: np.random.Generator) -> np.ndarray:
    """Client of each sample for a uniform random split into :func:`equal_sizes` parts."""
    assignment = np.empty(num_samples, dtype=np.int64)
    assignment[rng.permutation(num_samples)] = np.repeat(
        np.arange(num_clients, dtype=np.int64), equal_sizes(num_samples, num_clients)
    )
    return assignment


def dirichlet_class_counts(
    class_sizes: np.ndarray,
    num_clients: int,
    alpha: float,
    min_size: int,
    max_attempts: int,
    rng: np.random.Generator,
    balance: bool = False,
) -> np.ndarray:
    """K x C counts of the LDA partition: for each class c, p_c ~ Dir_K(alpha) and client
    k gets the share p_{c,k} of class c (cut by :func:`counts_from_shares`, or with
    ``balance`` by :func:`balanced_counts_from_shares`). Redrawn until every client holds
    at least ``min_size`` samples; after ``max_attempts`` draws raise :class:`DataError`.
    The C x K shares are drawn the same way with and without ``balance``.
    """
    class_sizes = np.asarray(class_sizes, dtype=np.int64)
    num_samples = int(class_sizes.sum())
    if min_size * num_clients > num_samples:
        raise DataError(
            f"dirichlet_class cannot give each of {num_clients} clients min_size={min_size} "
            f"samples out of {num_samples}: lower min_size or num_clients"
        )
    concentration = np.full(num_clients, alpha)
    for _ in range(max_attempts):
        shares = rng.dirichlet(concentration, size=class_sizes.size)
        if balance:
            counts = balanced_counts_from_shares(shares, class_sizes)
        else:
            counts = counts_from_shares(shares, class_sizes)
        if counts.sum(axis=1).min() >= min_size:
            return counts
    raise DataError(
        f"dirichlet_class found no split with every one of {num_clients} clients holding "
        f"at least min_size={min_size} samples in {max_attempts} draws at alpha={alpha}: "
        "raise alpha, or lower min_size or num_clients (or raise max_attempts)"
    )


DIRICHLET_CLIENT_BATCH = 1 << 16
"""Clients whose label mixes and first multinomial draws :func:`dirichlet_client_counts`
draws in one numpy call each."""


def dirichlet_client_counts(
    class_sizes: np.ndarray,
    client_sizes: np.ndarray,
    alpha: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """K x C counts of Hsu et al.'s partition.

    Client k (in order 0..K-1) draws q_k ~ Dir(alpha * p), p = ``class_sizes / n``, and
    fills its ``client_sizes[k]`` slots with classes drawn from q_k without replacement
    from the shared pool; once a class runs out, q_k is renormalised over the classes
    left. Should q_k put no mass at all on the classes left (possible at tiny alpha), the
    client is filled in proportion to the pool instead, where the one-by-one process would
    never finish.

    Drawn in batches of :data:`DIRICHLET_CLIENT_BATCH` clients: the batch's q_k in one
    call, then each client's slots as one multinomial over all classes, in one call. A
    client whose multinomial fits in what the clients before it left keeps it (drawing
    those same slots one by one would never meet an empty class); one whose draw does not
    fit keeps what fits and redraws the overflow over the classes still open
    (:func:`draw_without_replacement`). The distribution is that of drawing client after
    client; the numbers of a seed are not those of fedplug's earlier client-by-client loop.
    """
    class_sizes = np.asarray(class_sizes, dtype=np.int64)
    client_sizes = np.asarray(client_sizes, dtype=np.int64)
    present = np.flatnonzero(class_sizes > 0)
    concentration = alpha * class_sizes[present] / class_sizes.sum()
    remaining = class_sizes.copy()
    counts = np.zeros((len(client_sizes), class_sizes.size), dtype=np.int64)
    for start in range(0, len(client_sizes), DIRICHLET_CLIENT_BATCH):
        sizes = client_sizes[start : start + DIRICHLET_CLIENT_BATCH]
        label_mix = np.zeros((len(sizes), class_sizes.size))
        label_mix[:, present] = rng.dirichlet(concentration, size=len(sizes))
        # A mix numpy could not normalise (every gamma variate underflowed) gets no
        # multinomial of its own: its client is filled from the pool.
        usable = np.isfinite(label_mix).all(axis=1) & (label_mix.sum(axis=1) > 0)
        placeholder = 1.0 / class_sizes.size
        drawn = rng.multinomial(sizes, np.where(usable[:, None], label_mix, placeholder))
        drawn[~usable] = -1  # never fits
        batch = counts[start : start + len(sizes)]
        _keep_what_fits(batch, drawn, sizes, label_mix, remaining, rng)
    return counts


def _keep_what_fits(
    counts: np.ndarray,
    drawn: np.ndarray,
    sizes: np.ndarray,
    label_mix: np.ndarray,
    remaining: np.ndarray,
    rng: np.random.Generator,
) -> None:
    """Fill a batch's rows of ``counts`` from its multinomial draws (rows of -1: none),
    client after client in effect, taking them from ``remaining``. Runs of clients whose
    draws fit are found by one cumulative sum over a window, doubled while every draw
    fits: the pool runs short only near the end of a partition."""
    position, window = 0, 64
    while position < len(drawn):
        block = drawn[position : position + window]
        found = remaining - (np.cumsum(block, axis=0) - block)  # what each client finds
        misfits = np.flatnonzero(((block > found) | (block < 0)).any(axis=1))
        fitting = int(misfits[0]) if misfits.size else len(block)
        counts[position : position + fitting] = block[:fitting]
        remaining -= block[:fitting].sum(axis=0)
        position += fitting
        if not misfits.size:
            window *= 2
            continue
        first_draw = block[fitting]
        if first_draw[0] < 0:  # no usable mix: the pool's proportions
            counts[position] = draw_without_replacement(
                int(sizes[position]), label_mix[position], remaining, rng
            )
        else:
            kept = np.minimum(first_draw, remaining)
            overflow = int(first_draw.sum() - kept.sum())
            counts[position] = kept + draw_without_replacement(
                overflow, label_mix[position], remaining - kept, rng
            )
        remaining -= counts[position]
        position, window = position + 1, 64


def draw_without_replacement(
    needed: int, label_mix: np.ndarray, remaining: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Class counts of ``needed`` draws from ``label_mix``, renormalised over the classes
    with ``remaining`` samples each time one runs out (``remaining`` is not modified).

    Batched: a multinomial over the open classes, each class capped at what is left, the
    overflow redrawn over the classes still open; this has the distribution of drawing one
    sample at a time. Falls back to the pool's proportions when ``label_mix`` has no mass
    on the open classes. ``needed`` must not exceed ``remaining.sum()``.
    """
    left = remaining.astype(np.int64).copy()
    taken_total = np.zeros_like(left)
    while needed > 0:
        weights = np.where(left > 0, label_mix, 0.0)
        total = weights.sum()
        if not np.isfinite(total) or total <= 0:
            weights = left.astype(np.float64)
            total = weights.sum()
        taken = np.minimum(rng.multinomial(needed, weights / total), left)
        taken_total += taken
        left -= taken
        needed -= int(taken.sum())
    return taken_total


def shards_assignment(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> np.ndarray:
    """Client of each sample for McMahan et al.'s split: order the samples by label
    (random order within a label), cut them into ``num_clients * shards_per_client``
    contiguous shards of sizes differing by at most one, and deal the shards out at
    random, ``shards_per_client`` to each client."""
    num_shards = num_clients * shards_per_client
    if num_shards > labels.size:
        raise DataError(
            f"shards needs {num_shards} shards ({num_clients} clients x {shards_per_client}) "
            f"but there are only {labels.size} samples: lower num_clients or shards_per_client"
        )
    shuffled = rng.permutation(labels.size)
    by_label = shuffled[_stable_order(labels[shuffled], int(labels.max()))]
    shard_of_position = np.repeat(
        np.arange(num_shards, dtype=np.int64), equal_sizes(labels.size, num_shards)
    )
    owner_of_shard = rng.permutation(num_shards) // shards_per_client
    assignment = np.empty(labels.size, dtype=np.int64)
    assignment[by_label] = owner_of_shard[shard_of_position]
    return assignment


def llt_shares(num_clients: int, num_classes: int, alpha_l: float) -> np.ndarray:
    """C x K shares of the label long-tail partition (IWDS authors' code).

    ``main_prop = alpha_l / (K // C)``, ``tail_prop = (1 - main_prop) / (K - K // C)``;
    class c gives ``main_prop`` to each of its main clients ``c + i*C`` (i = 0..K//C-1)
    and ``tail_prop`` to every other client, and the row is normalised to sum to 1.

    Quirk kept from the original: ``tail_prop`` spreads what *one* main client leaves
    (``1 - main_prop``) rather than what all of them leave (``1 - alpha_l``), so a row sums
    to ``1 + alpha_l * (1 - C / K)`` before normalising (exactly 1 only when K = C). At
    K = 100, C = 10 that is ``1 + 0.9 * alpha_l``, so the ten main clients together hold
    only ``alpha_l / (1 + 0.9 * alpha_l)`` of their class, about 52-53% at alpha_l = 0.99,
    not 99%. With a single class every client is a main client and the split is even.
    """
    if num_clients % num_classes:
        raise DataError(
            f"llt needs num_clients to be a multiple of the number of classes ({num_classes}), "
            f"got {num_clients}: set num_clients to a multiple of {num_classes}"
        )
    mains_per_class = num_clients // num_classes
    main_prop = alpha_l / mains_per_class
    tail_clients = num_clients - mains_per_class
    tail_prop = (1.0 - main_prop) / tail_clients if tail_clients else 0.0
    shares = np.full((num_classes, num_clients), tail_prop)
    clients = np.arange(num_clients)
    shares[clients % num_classes, clients] = main_prop
    return shares / shares.sum(axis=1, keepdims=True)


def feature_noise_std(
    num_clients: int, sigma: float, convention: Literal["fedplug", "niid_bench"] = "fedplug"
) -> np.ndarray:
    """Per-client input-noise std, a linear ramp up to ``sigma`` (entry i is the i-th
    client, 0-based).

    - ``"fedplug"`` (default): ``sigma * k / K`` for k = 1..K, i.e. entry i is
      ``sigma * (i + 1) / K``; every client is noisy, the first one by sigma / K.
    - ``"niid_bench"``: ``sigma * k / (K - 1)`` for k = 0..K-1, i.e. entry i is
      ``sigma * i / (K - 1)``; client 0 is clean. This is NIID-Bench's ``noise_type``
      ``increasing`` (Xtra-Computing/NIID-Bench, ``experiments.py``: ``noise_level =
      args.noise / (args.n_parties - 1) * net_id``). With K = 1 the one client is client 0
      and stays clean (NIID-Bench itself divides by zero there).

    Reconstruction: the FedDisk paper (section 7.1.1) says each client's inputs get
    Gaussian noise of a different variance, but its formula was lost in text extraction.
    Both ramps are readings of it; the fedplug ramp is *not* NIID-Bench's (it shifts every
    client's std up by sigma / K for K > 1 and so has no clean client).
    """
    if convention == "niid_bench":
        if num_clients == 1:
            return np.zeros(1, dtype=np.float64)
        return sigma * np.arange(num_clients, dtype=np.float64) / (num_clients - 1)
    return sigma * np.arange(1, num_clients + 1, dtype=np.float64) / num_clients


def add_feature_noise(
    inputs: np.ndarray, noise_std: float, rng: np.random.Generator
) -> np.ndarray:
    """``clip(inputs + N(0, noise_std^2), 0, 1)`` as float32: one client's noisy inputs.

    ``inputs`` must already be scaled to [0, 1]; ``noise_std`` 0 returns a clipped copy.
    """
    noisy = np.asarray(inputs, dtype=np.float32)
    if noise_std > 0:
        noisy = noisy + rng.normal(0.0, noise_std, size=noisy.shape).astype(np.float32)
    return np.clip(noisy, 0.0, 1.0)


def natural_assignment(users: np.ndarray, num_clients: int) -> np.ndarray:
    """Client of each sample when clients are the dataset's writers.

    Writers are ordered by id; client k is the k-th of them. With ``num_clients`` below
    the number of writers, the ``num_clients`` writers holding the most samples are kept
    (ties go to the smaller id), still in id order, and the other writers' samples are
    left out (assignment -1).
    """
    writer_ids, writer_of_sample, writer_sizes = np.unique(
        users, return_inverse=True, return_counts=True
    )
    num_writers = writer_ids.size
    if num_clients > num_writers:
        raise DataError(
            f"natural partition has {num_writers} writers but num_clients={num_clients}: set "
            f"num_clients to at most {num_writers}"
        )
    by_size = np.lexsort((np.arange(num_writers), -writer_sizes))
    kept = np.sort(by_size[:num_clients])
    client_of_writer = np.full(num_writers, -1, dtype=np.int64)
    client_of_writer[kept] = np.arange(num_clients, dtype=np.int64)
    return client_of_writer[writer_of_sample.reshape(-1)]


# ---------------------------------------------------------------------------- factories


def iid(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    config: IidConfig,
    rng: np.random.Generator,
    users: np.ndarray | None = None,
) -> Partition:
    """IID split: K random parts of sizes n // K or n // K + 1. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    assignment = iid_assignment(labels.size, num_clients, rng)
    return _partition(labels, num_classes, assignment, num_clients, rng)


def dirichlet_class(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    config: DirichletClassConfig,
    rng: np.random.Generator,
    users: np.ndarray | None = None,
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
    assignment = assignment_from_counts(labels, counts, rng)
    return _partition(labels, num_classes, assignment, num_clients, rng)


def dirichlet_client(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    config: DirichletClientConfig,
    rng: np.random.Generator,
    users: np.ndarray | None = None,
) -> Partition:
    """Hsu et al.'s split (:func:`dirichlet_client_counts`). Client sizes are n // K; when
    K does not divide n the first n mod K clients get one sample more, so that every
    sample is placed. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    class_sizes = np.bincount(labels, minlength=num_classes)
    counts = dirichlet_client_counts(
        class_sizes, equal_sizes(labels.size, num_clients), config.alpha, rng
    )
    assignment = assignment_from_counts(labels, counts, rng)
    del counts  # K x C: not kept while the indices are grouped
    return _partition(labels, num_classes, assignment, num_clients, rng)


def shards(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    config: ShardsConfig,
    rng: np.random.Generator,
    users: np.ndarray | None = None,
) -> Partition:
    """Pathological split (:func:`shards_assignment`). ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    assignment = shards_assignment(labels, num_clients, config.shards_per_client, rng)
    return _partition(labels, num_classes, assignment, num_clients, rng)


def llt(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    config: LltConfig,
    rng: np.random.Generator,
    users: np.ndarray | None = None,
) -> Partition:
    """Label long-tail split (:func:`llt_shares`, including its K > C quirk): each class's
    shuffled indices are cut at the cumulative shares. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    shares = llt_shares(num_clients, num_classes, config.alpha_l)
    counts = counts_from_shares(shares, np.bincount(labels, minlength=num_classes))
    assignment = assignment_from_counts(labels, counts, rng)
    return _partition(labels, num_classes, assignment, num_clients, rng)


def feature_noise(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    config: FeatureNoiseConfig,
    rng: np.random.Generator,
    users: np.ndarray | None = None,
) -> Partition:
    """IID split plus a per-client noise std ramping up to sigma
    (:func:`feature_noise_std` with ``config.convention``, a reconstruction); whoever loads
    client k's inputs applies :func:`add_feature_noise`. ``users`` is ignored."""
    labels = _check_request(labels, num_classes, num_clients)
    assignment = iid_assignment(labels.size, num_clients, rng)
    noise_std = feature_noise_std(num_clients, config.sigma, config.convention)
    return _partition(labels, num_classes, assignment, num_clients, rng, noise_std)


def natural(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    config: NaturalConfig,
    rng: np.random.Generator,
    users: np.ndarray | None = None,
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
    (ShardsConfig, shards),
    (LltConfig, llt),
    (FeatureNoiseConfig, feature_noise),
    (NaturalConfig, natural),
)
"""The built-in partitioners: (config class, which names the partitioner; factory)."""


@hookimpl
def fedplug_register_partitioners(register: RegisterPartitioner) -> None:
    for config_class, factory in PARTITIONERS:
        register(config_class, factory)


# --------------------------------------------------------------------------------- I/O


def _how_to_regenerate(path: Path) -> str:
    return (
        f"delete {path} and re-run the partition stage (e.g. `dvc repro partition`) "
        "to regenerate it"
    )


def save_partition(path: str | os.PathLike[str], partition: Partition) -> None:
    """Write ``partition`` to one ``.npz`` file at exactly ``path``.

    Keys: ``indices`` (all clients' indices concatenated, int64), ``offsets`` (K+1 int64:
    client k is ``indices[offsets[k]:offsets[k+1]]``), ``class_counts`` (K x C int64) and,
    when set, ``noise_std`` (K float64). The file is written beside ``path`` and renamed
    into place, so a crash never leaves a half-written partition.
    """
    path = Path(path)
    flat, offsets = flat_indices(partition.client_indices)
    arrays: dict[str, np.ndarray] = {
        "indices": flat,
        "offsets": offsets,
        "class_counts": np.asarray(partition.class_counts, dtype=np.int64),
    }
    if partition.noise_std is not None:
        arrays["noise_std"] = np.asarray(partition.noise_std, dtype=np.float64)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(handle, default_file_mode())
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **arrays)  # type: ignore[arg-type]
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_partition(path: str | os.PathLike[str]) -> Partition:
    """Read a partition written by :func:`save_partition`.

    Raises :class:`DataError` naming ``path`` when the file is missing, unreadable or
    inconsistent (offsets that do not cover the indices, class counts that do not match
    the client sizes).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"partition file {path} does not exist; {_how_to_regenerate(path)}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            indices = np.asarray(archive["indices"])
            offsets = np.asarray(archive["offsets"])
            class_counts = np.asarray(archive["class_counts"])
            noise_std = np.asarray(archive["noise_std"]) if "noise_std" in archive.files else None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise DataError(
            f"partition file {path} is corrupt or not a fedplug partition ({error}); "
            f"{_how_to_regenerate(path)}"
        ) from None
    if (
        indices.ndim != 1
        or offsets.ndim != 1
        or offsets.size < 1
        or not np.issubdtype(indices.dtype, np.integer)
        or not np.issubdtype(offsets.dtype, np.integer)
        or offsets[0] != 0
        or offsets[-1] != indices.size
        or np.any(np.diff(offsets) < 0)
        or class_counts.ndim != 2
        or class_counts.shape[0] != offsets.size - 1
        or not np.array_equal(class_counts.sum(axis=1), np.diff(offsets))
        or (noise_std is not None and noise_std.shape != (offsets.size - 1,))
    ):
        raise DataError(
            f"partition file {path} is inconsistent (offsets, class counts and noise do not "
            f"match its indices); {_how_to_regenerate(path)}"
        )
    indices = indices.astype(np.int64, copy=False)
    return Partition(
        client_indices=ClientIndices(indices, offsets),
        class_counts=class_counts.astype(np.int64, copy=False),
        noise_std=None if noise_std is None else noise_std.astype(np.float64, copy=False),
    )
