"""Balanced k-means: clusters of exactly equal size, the assignment step a min-cost flow
(OR-Tools) solved by column generation. General; FedGSP's grouping (ICG) uses it."""

from __future__ import annotations

import numpy as np
from ortools.graph.python.min_cost_flow import SimpleMinCostFlow

COST_RESOLUTION = 1_000_000
"""Largest integer arc cost of the assignment flow: squared distances are scaled so the
largest becomes this, then rounded. A relative rounding error of 1e-6 cannot change an
assignment except between near-ties, and the value leaves int64 far from overflow."""


def _kmeans_plus_plus(
    vectors: np.ndarray, num_clusters: int, rng: np.random.Generator
) -> np.ndarray:
    """k-means++ seeding (D^2 sampling): a start that usually needs few iterations."""
    num_points = vectors.shape[0]
    centroids = np.empty((num_clusters, vectors.shape[1]))
    centroids[0] = vectors[rng.integers(num_points)]
    nearest = ((vectors - centroids[0]) ** 2).sum(axis=1)
    for index in range(1, num_clusters):
        total = nearest.sum()
        if total > 0:
            choice = int(rng.choice(num_points, p=nearest / total))
        else:  # every point coincides with a centroid already
            choice = int(rng.integers(num_points))
        centroids[index] = vectors[choice]
        np.minimum(nearest, ((vectors - centroids[index]) ** 2).sum(axis=1), out=nearest)
    return centroids


def _half_squared_distances(vectors: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """``||V_k - C_l||^2 / 2`` for every pair, K' x L, by the Gram-matrix expansion."""
    squared = (
        (vectors**2).sum(axis=1)[:, None]
        - 2.0 * vectors @ centroids.T
        + (centroids**2).sum(axis=1)[None, :]
    )
    return np.maximum(squared, 0.0) / 2.0


def integer_costs(costs: np.ndarray) -> tuple[np.ndarray, float]:
    """Scale float costs to the integers the flow solver needs.

    Subtracts each point's smallest cost first: that changes no optimum (every point is
    assigned exactly once, so a per-point constant adds the same to every feasible
    assignment) and leaves the rounding resolution for the differences that matter.
    Then scales so the largest cost is :data:`COST_RESOLUTION` and rounds.

    Returns:
        The int64 costs and the scale used (0.0 when all costs were equal).
    """
    relative = costs - costs.min(axis=1, keepdims=True)
    largest = float(relative.max())
    scale = COST_RESOLUTION / largest if largest > 0 else 0.0
    return np.rint(relative * scale).astype(np.int64), scale


def _check_balanced(num_points: int, num_clusters: int) -> None:
    if not 1 <= num_clusters <= num_points or num_points % num_clusters != 0:
        # OR-Tools crashes (rather than reporting UNBALANCED) on unbalanced supplies.
        raise ValueError(f"{num_points} points cannot form {num_clusters} clusters of equal size")


def _solve_flow(unit_costs: np.ndarray, allowed: np.ndarray | None) -> np.ndarray | None:
    """Min-cost flow over the point -> cluster arcs (all, or those where ``allowed``).

    Every point node supplies one unit (the source's capacity-1 arc to it), every
    cluster node absorbs K'/L units (its capacity-K'/L arc to the sink). Returns the
    labels, or ``None`` when a restricted problem is infeasible.
    """
    num_points, num_clusters = unit_costs.shape
    if allowed is None:
        points = np.repeat(np.arange(num_points), num_clusters)
        clusters = np.tile(np.arange(num_clusters), num_points)
    else:
        points, clusters = np.nonzero(allowed)
    points, clusters = points.astype(np.int32), clusters.astype(np.int32)
    # Row-major arcs, so the full problem's costs are the flattened matrix.
    arc_costs = unit_costs.ravel() if allowed is None else unit_costs[points, clusters]
    flow = SimpleMinCostFlow()
    arcs = flow.add_arcs_with_capacity_and_unit_cost(
        points, clusters + num_points, np.ones(points.size, dtype=np.int64), arc_costs
    )
    supplies = np.concatenate(
        [
            np.ones(num_points, dtype=np.int64),
            np.full(num_clusters, -(num_points // num_clusters), dtype=np.int64),
        ]
    )
    flow.set_nodes_supplies(np.arange(num_points + num_clusters, dtype=np.int32), supplies)
    status = flow.solve()
    if status == SimpleMinCostFlow.INFEASIBLE and allowed is not None:
        return None
    if status != SimpleMinCostFlow.OPTIMAL:
        raise RuntimeError(f"OR-Tools min-cost flow failed with status {status}")
    used = np.asarray(flow.flows(arcs)) > 0
    labels = np.empty(num_points, dtype=np.int64)
    labels[points[used]] = clusters[used]
    return labels


def cluster_potentials(
    unit_costs: np.ndarray,
    labels: np.ndarray,
    allowed: np.ndarray | None = None,
    start: np.ndarray | None = None,
) -> np.ndarray | None:
    """Dual prices of the clusters for a balanced assignment, or ``None`` if not optimal.

    Moving point k from its cluster a to cluster b changes the cost by
    ``c_kb - c_ka``. A balanced assignment is optimal exactly when no cycle of such
    moves (a -> b -> ... -> a, one point leaving each cluster) has negative total cost,
    i.e. when the L x L graph with arc weights ``W[a, b] = min_{k in a} c_kb - c_ka``
    (over the ``allowed`` arcs only, if given) has no negative cycle. Bellman-Ford from
    a virtual source then yields potentials d with ``c_ka - d_a <= c_kb - d_b`` for
    every point k of cluster a and every allowed b. Started from any potentials it
    settles within L + 1 passes when no negative cycle exists (shortest paths are then
    simple), and a good start (the previous solve's potentials) settles in a few.

    Args:
        unit_costs: K' x L integer costs (exact arithmetic, no tolerance needed).
        labels: a balanced assignment.
        allowed: K' x L mask of the arcs of a restricted problem (default: all).
        start: integer potentials to start from (default: zeros).
    """
    num_points, num_clusters = unit_costs.shape
    own = unit_costs[np.arange(num_points), labels]
    if allowed is None:
        # Balanced clusters: sorting the points by cluster gives an L x (K'/L) x L block.
        order = np.argsort(labels, kind="stable")
        move = unit_costs[order] - own[order, None]
        weights = move.reshape(num_clusters, -1, num_clusters).min(axis=1)
    else:
        points, clusters = np.nonzero(allowed)
        weights = np.full((num_clusters, num_clusters), np.iinfo(np.int64).max // 4)
        np.minimum.at(
            weights, (labels[points], clusters), unit_costs[points, clusters] - own[points]
        )
    distances = np.zeros(num_clusters, dtype=np.int64) if start is None else start.copy()
    for _ in range(num_clusters + 1):
        relaxed = np.minimum(distances, (distances[:, None] + weights).min(axis=0))
        if np.array_equal(relaxed, distances):
            return distances
        distances = relaxed
    return None


def balanced_assignment(costs: np.ndarray) -> np.ndarray:
    """Assign K' points to L clusters of exactly K'/L points each at least total cost.

    The min-cost flow of the paper's eq. 10-13 over all K' x L arcs, solved with
    OR-Tools' ``SimpleMinCostFlow``; costs are scaled to integers by
    :func:`integer_costs`. :class:`BalancedAssigner` reaches the same optimum faster.

    Args:
        costs: K' x L float costs; K' must be a multiple of L.

    Returns:
        Cluster label of each point, int64 array of length K'.
    """
    _check_balanced(*costs.shape)
    labels = _solve_flow(integer_costs(costs)[0], None)
    if labels is None:  # unreachable: with every arc present the flow is feasible
        raise RuntimeError("OR-Tools found the full balanced assignment infeasible")
    return labels


class BalancedAssigner:
    """The assignment step of balanced k-means, solved by column generation.

    Solving the flow over all K' x L arcs costs ~0.2 s at K' = 3,550, L = 68, and most
    arcs are useless: a point goes to one of its nearest clusters once clusters are
    priced. So each call solves a restricted flow whose arcs are, per point, its
    ``candidates`` clusters of smallest priced cost ``c_kl - d_l`` (d: the previous
    call's cluster potentials, 0 at first) plus the arc of a known feasible assignment
    (the previous labels, or a round-robin one at first), which keeps the restricted
    problem feasible. Then it prices every arc with the restricted optimum's potentials
    (:func:`cluster_potentials`): if no arc has negative reduced cost, linear
    programming duality certifies the restricted optimum optimal for the full problem;
    otherwise the violating arcs join and it solves again. The answer is therefore
    always an optimal assignment, as :func:`balanced_assignment` gives (ties may break
    differently); only the time differs.

    Args:
        candidates: clusters first offered to each point (default 8).
        max_rounds: restricted solves per call before falling back to the full flow
            (default 10; the arcs added per point double every round).
    """

    def __init__(self, candidates: int = 8, max_rounds: int = 10) -> None:
        self.candidates = candidates
        self.max_rounds = max_rounds
        self.prices: np.ndarray | None = None
        self.labels: np.ndarray | None = None
        self.restricted_solves = 0
        """Restricted flows solved so far."""
        self.full_solves = 0
        """Calls that fell back to the full flow."""

    def __call__(self, costs: np.ndarray) -> np.ndarray:
        num_points, num_clusters = costs.shape
        _check_balanced(num_points, num_clusters)
        unit_costs, scale = integer_costs(costs)
        prices = self.prices
        if prices is not None and prices.shape != (num_clusters,):
            prices = None
        start = None if prices is None else np.rint(-prices * scale).astype(np.int64)
        labels, potentials = self._column_generation(costs, unit_costs, prices, start)
        if labels is None:
            labels = balanced_assignment(costs)
            potentials = cluster_potentials(unit_costs, labels, start=start)
            self.full_solves += 1
        # Potentials are in integer units; prices are in the units of ``costs``.
        self.prices = None if potentials is None or scale == 0 else -potentials / scale
        self.labels = labels
        return labels

    def _column_generation(
        self,
        costs: np.ndarray,
        unit_costs: np.ndarray,
        prices: np.ndarray | None,
        start: np.ndarray | None,
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Labels and potentials of the certified optimum, or ``(None, None)``."""
        num_points, num_clusters = costs.shape
        rows = np.arange(num_points)
        if num_clusters <= 2 * self.candidates:
            return None, None  # the full flow is small already
        priced = costs if prices is None else costs + prices
        nearest = np.argpartition(priced, self.candidates - 1, axis=1)[:, : self.candidates]
        allowed = np.zeros((num_points, num_clusters), dtype=bool)
        allowed[rows[:, None], nearest] = True
        feasible = self.labels
        if feasible is None or feasible.shape != (num_points,):
            feasible = rows % num_clusters
        allowed[rows, feasible] = True
        potentials = start
        for round_index in range(self.max_rounds):
            labels = _solve_flow(unit_costs, allowed)
            self.restricted_solves += 1
            if labels is None:  # unreachable: the feasible assignment's arcs are allowed
                return None, None
            potentials = cluster_potentials(unit_costs, labels, allowed, potentials)
            if potentials is None:  # unreachable: a restricted optimum has no negative cycle
                return None, None
            reduced = unit_costs - potentials[None, :]
            reduced -= reduced[rows, labels][:, None]
            violators = np.flatnonzero((reduced < 0).any(axis=1))
            if violators.size == 0:
                return labels, potentials
            # Partial pricing: each violating point gains its most negative arcs only,
            # twice as many each round so that long tails of rounds cannot happen.
            added = min(self.candidates << round_index, num_clusters)
            best = np.argpartition(reduced[violators], added - 1, axis=1)[:, :added]
            allowed[violators[:, None], best] |= reduced[violators[:, None], best] < 0
        return None, None


def balanced_kmeans(
    vectors: np.ndarray,
    num_clusters: int,
    rng: np.random.Generator,
    max_iterations: int = 10,
) -> np.ndarray:
    """Balanced k-means: L clusters of exactly K'/L points each (the paper's eq. 10-13).

    Seeds the centroids with k-means++, then alternates the assignment step (a min-cost
    flow, :class:`BalancedAssigner`) and the update step (centroid = mean of members)
    until the assignment or the centroids stop changing, or ``max_iterations`` rounds.

    Args:
        vectors: K' x C points (here class-count vectors).
        num_clusters: L; K' must be a multiple of it.
        rng: source of randomness for the seeding.
        max_iterations: tau (default 10, the paper's), the most assignment steps run.

    Returns:
        Cluster label in [0, L) of each point, int64 array of length K'; every label
        occurs exactly K'/L times.
    """
    vectors = np.asarray(vectors, dtype=np.float64)
    if vectors.ndim != 2:
        raise ValueError(f"vectors must be a K' x C matrix, got shape {vectors.shape}")
    num_points = vectors.shape[0]
    _check_balanced(num_points, num_clusters)
    if max_iterations < 1:
        raise ValueError(f"max_iterations must be at least 1, got {max_iterations}")
    if num_clusters == 1:
        return np.zeros(num_points, dtype=np.int64)
    if num_clusters == num_points:  # clusters of one point: each point is its own centroid
        return np.arange(num_points, dtype=np.int64)

    centroids = _kmeans_plus_plus(vectors, num_clusters, rng)
    assign = BalancedAssigner()
    labels = np.full(num_points, -1, dtype=np.int64)
    for _ in range(max_iterations):
        new_labels = assign(_half_squared_distances(vectors, centroids))
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, vectors)
        new_centroids = sums / (num_points // num_clusters)
        if np.allclose(new_centroids, centroids, rtol=0.0, atol=1e-9):
            break
        centroids = new_centroids
    return labels
