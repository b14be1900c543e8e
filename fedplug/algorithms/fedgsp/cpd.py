"""Class probability distance (CPD, FedGSP's eq. 14) between groups of clients, and the
study analysis (column and box plot) that reports it."""

from __future__ import annotations

import math

import numpy as np

from fedplug.analysis import Analysis, BoxFigure, RoundMetricColumn
from fedplug.components import RoundPlan

DEFAULT_CPD_SIGMA = 1.0
"""Kernel width of :func:`cpd` when no FedGSP config provides one."""


def cpd(p: np.ndarray, q: np.ndarray, sigma: float = DEFAULT_CPD_SIGMA) -> float:
    """Class probability distance (the paper's eq. 14) between two class distributions.

    MMD^2 with a Gaussian RBF kernel, each class a one-hot point, so
    ``K(i, j) = 1 if i == j else exp(-1 / sigma^2)`` and
    ``MMD^2 = (1 - exp(-1 / sigma^2)) * ||P - Q||^2`` (see ALGORITHMS.md).

    Args:
        p, q: class counts or probabilities (normalised here), length C each.
        sigma: kernel width (default 1.0).
    """
    if sigma <= 0:
        raise ValueError(f"sigma must be positive, got {sigma}")
    distributions = []
    for vector in (p, q):
        vector = np.asarray(vector, dtype=np.float64)
        total = vector.sum()
        if total <= 0:
            raise ValueError("a class distribution must have a positive total")
        distributions.append(vector / total)
    difference = distributions[0] - distributions[1]
    return float(-math.expm1(-1.0 / sigma**2) * difference @ difference)


def cpd_summary(
    groups: list[list[int]],
    class_counts: np.ndarray,
    sigma: float = DEFAULT_CPD_SIGMA,
    block_rows: int = 512,
) -> tuple[float, float]:
    """Median and mean CPD over all unordered pairs of ``groups``.

    A group's distribution is its members' summed class counts, normalised. Pairwise
    squared distances come from the Gram matrix, a block of rows at a time, so thousands
    of groups (the default grouper's one group per client) stay fast and small in memory.

    Args:
        groups: client ids (rows of ``class_counts``) of each group.
        class_counts: K x C class counts of all clients.
        sigma: kernel width of :func:`cpd` (default 1.0).
        block_rows: rows of the pair matrix computed at once (default 512).

    Returns:
        ``(median, mean)``. Groups without samples have no class distribution and are
        left out; with fewer than two groups left there is no pair, and no divergence
        between groups either, so ``(0.0, 0.0)``.
    """
    if sigma <= 0:
        raise ValueError(f"sigma must be positive, got {sigma}")
    class_counts = np.asarray(class_counts)  # only the members' rows become float64, not all K
    sizes = np.fromiter((len(group) for group in groups), dtype=np.int64, count=len(groups))
    members = np.fromiter(
        (client for group in groups for client in group), dtype=np.int64, count=int(sizes.sum())
    )
    group_of_member = np.repeat(np.arange(len(groups)), sizes)
    totals = np.zeros((len(groups), class_counts.shape[1]))
    np.add.at(totals, group_of_member, class_counts[members].astype(np.float64))
    mass = totals.sum(axis=1, keepdims=True)
    distributions = totals[mass[:, 0] > 0] / mass[mass[:, 0] > 0]
    count = distributions.shape[0]
    if count < 2:
        return 0.0, 0.0
    norms = (distributions**2).sum(axis=1)
    pairs = np.empty(count * (count - 1) // 2)
    filled = 0
    columns = np.arange(count)
    for start in range(0, count - 1, block_rows):
        stop = min(start + block_rows, count - 1)
        rows = np.arange(start, stop)
        block = norms[rows, None] + norms[None, :] - 2.0 * distributions[rows] @ distributions.T
        upper = block[columns[None, :] > rows[:, None]]
        pairs[filled : filled + upper.size] = upper
        filled += upper.size
    np.maximum(pairs, 0.0, out=pairs)
    pairs *= -math.expm1(-1.0 / sigma**2)
    mean = float(pairs.mean())
    return float(np.median(pairs, overwrite_input=True)), mean


def group_cpd_metrics(plan: RoundPlan, class_counts: np.ndarray | None, sigma: float) -> dict[str, float]:
    """``cpd_median`` and ``cpd_mean`` between the groups of ``plan`` (its chains when it
    names no groups); empty when the class counts are unknown."""
    if class_counts is None:
        return {}
    groups = plan.groups if plan.groups is not None else plan.chains
    median, mean = cpd_summary(groups, class_counts, sigma)
    return {"cpd_median": float(median), "cpd_mean": float(mean)}


CPD_NOTE = ("CPD: class probability distance between the groups formed in a round (FedGSP, eq. 14: "
            "RBF-kernel MMD of their class distributions), the median over pairs of groups; for FedAvg "
            "every client is its own group. Lower = groups more alike.")
"""The caption of the CPD box plot: what CPD is."""

CPD_ANALYSIS = Analysis(
    columns=(RoundMetricColumn("cpd_median", "median CPD", reduce="median", series="cpd", digits=3),),
    figures=(BoxFigure("cpd_box", series="cpd", title="per-round median CPD",
                       axis_label="per-round median CPD between groups", note=CPD_NOTE),),
)
"""What a study keeps of :func:`group_cpd_metrics`: ``cpd_median`` (the median over rounds
of each round's ``cpd_median``) as a column, the rounds' values as ``cpd``, and the box
plot ``cpd_box`` of them. Declared by FedGSP's grouper and by the default grouper (its
baseline: every client its own group)."""
