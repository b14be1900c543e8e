"""How FedGSP groups a round's clients: Inter-Cluster Grouping (balanced k-means on class
counts, one client of every cluster per group) and NaiveGSP's random groups."""

from __future__ import annotations

import numpy as np

from fedplug.algorithms.fedgsp.balanced_kmeans import balanced_kmeans


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
