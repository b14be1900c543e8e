"""FedGSP: grouped sequential-to-parallel training, as a grouper plugin.

Paper: Shenglai Zeng, Zonghang Li, Hongfang Yu, Yihong He, Zenglin Xu, Dusit Niyato and
Han Yu, "Heterogeneous Federated Learning via Grouped Sequential-to-Parallel Training"
(FedGSP), DASFAA 2022, arXiv:2201.12976.

Each round r the sampled clients are split into M = f(r) groups whose overall class
distributions are alike; a fraction kappa of the groups trains, each group as a chain
(its members train one after another in random order, handing the model on), the groups
in parallel, and the server averages the last model of every chain equally. M grows
with r, so training moves from sequential towards parallel (the paper's "STP").

The groups come from Inter-Cluster Grouping (ICG, the paper's Algorithm 2): cluster
the clients into L = floor(K / M) clusters of exactly equal size with balanced k-means
(the assignment step is a min-cost flow solved by OR-Tools), then build every group from
one client of every cluster. By the paper's Proposition 2 the centroid of every group is
then an unbiased estimate of the global centroid, so the groups' class distributions
are alike.

Clustering input: the raw class-count vectors V_k, not normalised ones. The paper
clusters the "class distribution matrix" in (Z+)^{F x K} and defines a group's
distribution as the *sum* of its members' count vectors (its eq. 8), so clients holding
more samples weigh more in the group's distribution; clustering the counts is what makes
the group sums (and hence the normalised group distributions that CPD compares) alike.

The module also provides the paper's ablations (``mode``): NaiveGSP (random groups,
fixed M) and NaiveGSP+ICG (ICG groups, fixed M), and its CPD metric between groups.

Local budget against FedAvg. Every member of a chain trains ``train.local_epochs`` epochs
of ``ceil(n_k / batch_size)`` SGD steps, so with kappa of M groups over K clients a round
trains about kappa K clients, and the model the server receives from a chain has taken
the steps of all its members in sequence. FedAvg with ``client_fraction`` kappa and the
same epochs takes the same SGD steps per round in all, but each model it aggregates has
taken one client's steps. With equal client sizes n and fixed M, FedAvg with
``client_fraction: ceil(kappa M) / K`` and ``local_epochs: E K / M`` matches both: as many
aggregated models, each after as many SGD steps, and the cost model's
``compute_seconds_model`` (the slowest chain's samples in sequence) is the same per
round. With a growing M no fixed FedAvg setting matches every round; compare time to
accuracy with the cost model's cumulative ``compute_seconds_model`` instead.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from ortools.graph.python.min_cost_flow import SimpleMinCostFlow
from pydantic import Field

from fedplug.analysis import Analysis, BoxFigure, RoundMetricColumn
from fedplug.components import ClientNeeds, ComponentConfig, FederationView, Grouper, RoundPlan
from fedplug.hookspecs import RegisterGrouper, hookimpl

GrowthKind = Literal["linear", "log", "exp"]

COST_RESOLUTION = 1_000_000
"""Largest integer arc cost of the assignment flow: squared distances are scaled so the
largest becomes this, then rounded. A relative rounding error of 1e-6 cannot change an
assignment except between near-ties, and the value leaves int64 far from overflow."""

MAX_GROWTH = 2**62
"""Where :func:`growth` saturates, far above any number of clients, so ``exp`` growth
cannot overflow in late rounds."""

DEFAULT_CPD_SIGMA = 1.0
"""Kernel width of :func:`cpd` when no FedGSP config provides one."""

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


# ---------------------------------------------------------------------------- growth


def growth(kind: GrowthKind, round_number: int, alpha: float, beta: float) -> int:
    """The paper's group-number growth function f(r) (eq. 1-3), before clipping.

    - ``linear``: ``beta * floor(alpha * (r - 1) + 1)``
    - ``log``: ``beta * floor(alpha * ln(r) + 1)``
    - ``exp``: ``beta * floor((1 + alpha) ** (r - 1))``

    Args:
        kind: which of the three functions.
        round_number: r, 1-based.
        alpha: growth rate (the paper's default 2.0 with ``log``).
        beta: initial number of groups and growth span (the paper's default 10; an
            integer in the paper, accepted as a float here, the product is floored).

    Returns:
        The number of groups, an int; saturates at :data:`MAX_GROWTH`.
    """
    if round_number < 1:
        raise ValueError(f"round_number is 1-based, got {round_number}")
    if kind == "linear":
        step = math.floor(alpha * (round_number - 1) + 1)
    elif kind == "log":
        step = math.floor(alpha * math.log(round_number) + 1)
    elif kind == "exp":
        exponent = (round_number - 1) * math.log1p(alpha)
        if exponent >= math.log(MAX_GROWTH):
            return MAX_GROWTH
        step = math.floor((1 + alpha) ** (round_number - 1))
    else:
        raise ValueError(f"unknown growth kind {kind!r}; use 'linear', 'log' or 'exp'")
    return min(math.floor(beta * step), MAX_GROWTH)


def num_groups(
    round_number: int,
    num_clients: int,
    kind: GrowthKind = "log",
    alpha: float = 2.0,
    beta: float = 10.0,
) -> int:
    """M = f(r) clipped to [1, num_clients]; arguments as in :func:`growth`."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    return int(min(max(growth(kind, round_number, alpha, beta), 1), num_clients))


# ------------------------------------------------------------------- balanced k-means


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


# ----------------------------------------------------------------------------- groups


def inter_cluster_groups(
    class_counts: np.ndarray,
    num_groups: int,
    rng: np.random.Generator,
    max_iterations: int = 10,
) -> list[list[int]]:
    """Inter-Cluster Grouping (the paper's Algorithm 2).

    With K = ``len(class_counts)`` and M = ``num_groups``: L = floor(K / M) clusters;
    keep L * floor(K / L) clients drawn at random (the remaining K mod L clients, fewer
    than L, sit out this round: equal cluster sizes need K' divisible by L, the paper's
    Assumption 1); balanced k-means on their class counts; then M' = K'/L groups, each
    made of one client drawn from every cluster without replacement. M' >= M, with
    equality when L divides K and K/L = M.

    Args:
        class_counts: K x C class counts of the clients to group.
        num_groups: M, in [1, K].
        rng: randomness for which clients sit out, the seeding and the draws.
        max_iterations: tau of :func:`balanced_kmeans` (default 10).

    Returns:
        M' groups of L row indices into ``class_counts`` each; no index twice.
    """
    class_counts = np.asarray(class_counts, dtype=np.float64)
    num_clients = class_counts.shape[0]
    if not 1 <= num_groups <= num_clients:
        raise ValueError(f"num_groups must be in [1, {num_clients}], got {num_groups}")
    num_clusters = num_clients // num_groups
    cluster_size = num_clients // num_clusters
    kept = np.sort(rng.choice(num_clients, size=num_clusters * cluster_size, replace=False))
    labels = balanced_kmeans(class_counts[kept], num_clusters, rng, max_iterations)
    # members[l, m]: the m-th client drawn from cluster l; column m is group m.
    order = np.lexsort((rng.random(kept.size), labels))
    members = kept[order].reshape(num_clusters, cluster_size)
    return [[int(client) for client in column] for column in members.T]


def random_groups(
    clients: np.ndarray, num_groups: int, rng: np.random.Generator
) -> list[list[int]]:
    """NaiveGSP's grouping: shuffle ``clients`` and cut them into exactly ``num_groups``
    groups whose sizes differ by at most one (the paper's constraint 6); every client
    takes part.

    Args:
        clients: the ids to group.
        num_groups: M, in [1, len(clients)].
        rng: randomness for the shuffle.
    """
    clients = np.asarray(clients)
    if not 1 <= num_groups <= clients.size:
        raise ValueError(f"num_groups must be in [1, {clients.size}], got {num_groups}")
    shuffled = rng.permutation(clients)
    return [[int(client) for client in part] for part in np.array_split(shuffled, num_groups)]


# -------------------------------------------------------------------------------- CPD


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


# ------------------------------------------------------------------------ the grouper


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


@hookimpl
def fedplug_register_groupers(register: RegisterGrouper) -> None:
    register(FedGSPConfig, FedGSPGrouper)
