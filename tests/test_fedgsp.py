"""FedGSP: growth functions, balanced k-means, ICG, CPD, the grouper and the cost model."""

from __future__ import annotations

import copy
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pluggy
import pytest
from conftest import SMALL_EXPERIMENT
from pydantic import ValidationError

from fedplug import hookspecs
from fedplug.algorithms import fedgsp
from fedplug.cost_model import LinkAndDevice, round_cost
from fedplug.algorithms.fedgsp import (
    MAX_GROWTH,
    BalancedAssigner,
    FedGSPConfig,
    FedGSPGrouper,
    balanced_assignment,
    balanced_kmeans,
    cluster_potentials,
    cpd,
    cpd_summary,
    growth,
    integer_costs,
    inter_cluster_groups,
    num_groups,
    random_groups,
)
from fedplug.config import validate_experiment
from fedplug.errors import ConfigError
from fedplug.experiment import run_experiment
from fedplug.plugins import collect_registry
from fedplug.run import local_training


def skewed_counts(
    rng: np.random.Generator, num_clients: int = 100, num_classes: int = 10
) -> np.ndarray:
    """Each client holds 1 or 2 of the classes, 20-59 samples of each."""
    counts = np.zeros((num_clients, num_classes))
    for client in range(num_clients):
        held = rng.choice(num_classes, size=rng.integers(1, 3), replace=False)
        counts[client, held] = rng.integers(20, 60, size=held.size)
    return counts


def blobs(sizes: list[int], spread: float = 1.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Points around well separated centres (100 apart) and their blob of origin."""
    rng = np.random.default_rng(seed)
    points = [100.0 * index + spread * rng.random((size, 3)) for index, size in enumerate(sizes)]
    origin = np.repeat(np.arange(len(sizes)), sizes)
    return np.concatenate(points), origin


def assignment_cost(costs: np.ndarray, labels: np.ndarray) -> int:
    return int(costs[np.arange(len(labels)), labels].sum())


# ---------------------------------------------------------------------------- growth


@pytest.mark.parametrize(
    ("kind", "alpha", "beta", "expected"),
    [
        # 10 * floor(2 ln r + 1): 2 ln r + 1 = 1, 2.39, 3.20, 3.77, 4.22, 4.58, 4.89, 5.16
        ("log", 2.0, 10.0, [10, 20, 30, 30, 40, 40, 40, 50]),
        # 10 * floor(2 (r - 1) + 1)
        ("linear", 2.0, 10.0, [10, 30, 50, 70, 90, 110, 130, 150]),
        # 10 * floor(0.5 (r - 1) + 1): 1, 1.5, 2, 2.5, 3, ...
        ("linear", 0.5, 10.0, [10, 10, 20, 20, 30, 30, 40, 40]),
        # 10 * floor(2 ** (r - 1))
        ("exp", 1.0, 10.0, [10, 20, 40, 80, 160, 320, 640, 1280]),
        # 3 * floor(1.5 ** (r - 1)): 1, 1.5, 2.25, 3.375, 5.06, 7.59, 11.39, 17.09
        ("exp", 0.5, 3.0, [3, 3, 6, 9, 15, 21, 33, 51]),
    ],
)
def test_growth_matches_hand_computed_values(kind, alpha, beta, expected) -> None:
    assert [growth(kind, r, alpha, beta) for r in range(1, 9)] == expected


def test_growth_floors_a_fractional_beta_and_saturates_exp() -> None:
    assert growth("log", 2, 2.0, 2.5) == 5  # floor(2.5 * 2)
    assert growth("exp", 10_000, 2.0, 10.0) == MAX_GROWTH
    with pytest.raises(ValueError, match="1-based"):
        growth("log", 0, 2.0, 10.0)


def test_num_groups_is_clipped_to_one_and_the_number_of_clients() -> None:
    assert num_groups(1, 364) == 10
    assert num_groups(3, 364) == 30
    assert num_groups(100, 50) == 50  # 10 * floor(2 ln 100 + 1) = 100 > 50
    assert num_groups(1, 364, "log", 2.0, 0.5) == 1  # floor(0.5 * 1) = 0 -> 1


# ------------------------------------------------------------------ balanced k-means


def test_balanced_assignment_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    for _ in range(5):
        costs = rng.random((6, 3)) * 10
        labels = balanced_assignment(costs)
        assert np.bincount(labels, minlength=3).tolist() == [2, 2, 2]
        best = min(
            costs[np.arange(6), list(order)].sum()
            for order in set(itertools.permutations([0, 0, 1, 1, 2, 2]))
        )
        assert costs[np.arange(6), labels].sum() == pytest.approx(best, abs=1e-4)


def test_balanced_assignment_rejects_unequal_cluster_sizes() -> None:
    with pytest.raises(ValueError, match="equal size"):
        balanced_assignment(np.zeros((7, 2)))


def test_cluster_potentials_certify_only_optimal_assignments() -> None:
    # Point 0 belongs in cluster 0, point 1 in cluster 1; swapping them costs 10 more.
    costs = np.array([[0, 5], [5, 0]], dtype=np.int64)
    potentials = cluster_potentials(costs, np.array([0, 1]))
    assert potentials is not None
    reduced = costs - potentials[None, :]
    assert reduced[0, 0] <= reduced[0, 1] and reduced[1, 1] <= reduced[1, 0]
    assert cluster_potentials(costs, np.array([1, 0])) is None


def test_balanced_assigner_reaches_the_full_flow_optimum_over_iterations() -> None:
    # 40 clusters > 2 x 8 candidates, so the restricted column-generation path runs;
    # skewed points crowd a few clusters, so the first restricted flows are not optimal
    # and the certificate must pull in more arcs.
    rng = np.random.default_rng(7)
    points = rng.dirichlet(np.full(20, 0.1), size=400) * 100
    centroids = points[rng.choice(400, size=40, replace=False)]
    assigner = BalancedAssigner()
    for _ in range(4):
        costs = ((points[:, None, :] - centroids[None]) ** 2).sum(axis=2) / 2
        fast = assigner(costs)
        full = balanced_assignment(costs)
        unit_costs, _ = integer_costs(costs)
        assert np.bincount(fast, minlength=40).tolist() == [10] * 40
        assert assignment_cost(unit_costs, fast) == assignment_cost(unit_costs, full)
        sums = np.zeros_like(centroids)
        np.add.at(sums, full, points)
        centroids = sums / 10
    assert assigner.restricted_solves > 4 and assigner.full_solves == 0


def test_balanced_kmeans_gives_exactly_equal_cluster_sizes() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.random((60, 4)) ** 3  # lopsided cloud: plain k-means would be unequal
    labels = balanced_kmeans(vectors, 4, rng)
    assert np.bincount(labels, minlength=4).tolist() == [15, 15, 15, 15]


def test_balanced_kmeans_recovers_two_blobs() -> None:
    vectors, origin = blobs([10, 10])
    labels = balanced_kmeans(vectors, 2, np.random.default_rng(1))
    # Same partition as the blobs, whatever the label names.
    assert len(set(zip(labels.tolist(), origin.tolist()))) == 2


def test_balanced_kmeans_with_many_clusters_recovers_blobs() -> None:
    vectors, origin = blobs([5] * 30)
    labels = balanced_kmeans(vectors, 30, np.random.default_rng(2))
    assert len(set(zip(labels.tolist(), origin.tolist()))) == 30


# ----------------------------------------------------------------------------- groups


def test_icg_groups_take_one_client_from_every_cluster() -> None:
    # Three blobs of four clients: the clusters are the blobs, so every group of the
    # M' = 12 / 3 = 4 groups must hold exactly one client of each blob.
    vectors, origin = blobs([4, 4, 4])
    groups = inter_cluster_groups(vectors, 4, np.random.default_rng(5))
    assert len(groups) == 4
    for group in groups:
        assert sorted(origin[group].tolist()) == [0, 1, 2]
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(12))


def test_icg_leaves_out_the_remainder_when_clusters_do_not_divide() -> None:
    # K = 14, M = 4: L = floor(14 / 4) = 3 clusters, K' = 3 * floor(14 / 3) = 12 kept,
    # M' = 12 / 3 = 4 groups of 3; two clients sit out.
    counts = skewed_counts(np.random.default_rng(0), num_clients=14)
    groups = inter_cluster_groups(counts, 4, np.random.default_rng(1))
    members = list(itertools.chain.from_iterable(groups))
    assert [len(group) for group in groups] == [3, 3, 3, 3]
    assert len(set(members)) == 12 and set(members) <= set(range(14))


def test_icg_with_one_group_or_one_client_per_group() -> None:
    counts = skewed_counts(np.random.default_rng(0), num_clients=9)
    one = inter_cluster_groups(counts, 1, np.random.default_rng(0))
    assert len(one) == 1 and sorted(one[0]) == list(range(9))
    alone = inter_cluster_groups(counts, 9, np.random.default_rng(0))
    assert sorted(alone) == [[client] for client in range(9)]


def test_random_groups_have_sizes_within_one() -> None:
    groups = random_groups(np.arange(100, 150), 7, np.random.default_rng(0))
    assert sorted(len(group) for group in groups) == [7, 7, 7, 7, 7, 7, 8]
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(100, 150))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_icg_median_cpd_is_far_below_random_grouping(seed: int) -> None:
    counts = skewed_counts(np.random.default_rng(seed))
    rng = np.random.default_rng(100 + seed)
    icg_median, _ = cpd_summary(inter_cluster_groups(counts, 10, rng), counts)
    random_median, _ = cpd_summary(random_groups(np.arange(100), 10, rng), counts)
    assert icg_median < 0.5 * random_median


# -------------------------------------------------------------------------------- CPD


def test_cpd_by_hand() -> None:
    # P = (0.75, 0.25), Q = (0.5, 0.5): ||P - Q||^2 = 0.125.
    assert cpd(np.array([3, 1]), np.array([1, 1]), 1.0) == pytest.approx((1 - math.exp(-1)) * 0.125)
    assert cpd(np.array([3, 1]), np.array([1, 1]), 2.0) == pytest.approx(
        (1 - math.exp(-0.25)) * 0.125
    )
    assert cpd(np.array([2, 2]), np.array([5, 5]), 1.0) == 0.0


def test_cpd_summary_by_hand_and_against_pairwise_cpd() -> None:
    counts = np.array([[3, 1], [1, 1], [0, 2], [2, 0]], dtype=float)
    # Groups: {0} -> (.75, .25); {1} -> (.5, .5); {2, 3} -> (.5, .5).
    # Pairs: 0.125, 0.125, 0 times (1 - e^-1): median 0.125 f, mean 0.25 / 3 f.
    factor = 1 - math.exp(-1)
    median, mean = cpd_summary([[0], [1], [2, 3]], counts, 1.0)
    assert median == pytest.approx(0.125 * factor)
    assert mean == pytest.approx(0.25 / 3 * factor)

    rng = np.random.default_rng(0)
    many = rng.integers(0, 9, size=(23, 5)) + 1
    groups = [[client] for client in range(23)]
    pairwise = [cpd(many[i], many[j], 0.7) for i, j in itertools.combinations(range(23), 2)]
    assert cpd_summary(groups, many, 0.7, block_rows=4) == pytest.approx(
        (float(np.median(pairwise)), float(np.mean(pairwise)))
    )


def test_cpd_summary_of_a_single_group_is_zero() -> None:
    assert cpd_summary([[0, 1]], np.ones((2, 3)), 1.0) == (0.0, 0.0)
    assert cpd_summary([], np.ones((2, 3)), 1.0) == (0.0, 0.0)


def test_cpd_summary_leaves_out_groups_without_samples() -> None:
    counts = np.array([[3, 1], [1, 1], [0, 0]], dtype=float)
    factor = 1 - math.exp(-1)
    assert cpd_summary([[0], [1], [2]], counts, 1.0) == pytest.approx(
        (0.125 * factor, 0.125 * factor)
    )
    assert cpd_summary([[0], [2]], counts, 1.0) == (0.0, 0.0)


# ------------------------------------------------------------------------ the grouper


def test_plan_samples_ceil_kappa_of_the_groups_in_random_order() -> None:
    counts = skewed_counts(np.random.default_rng(0), num_clients=200)
    grouper = FedGSPGrouper(FedGSPConfig(name="fedgsp"))
    grouper.prepare(counts)
    clients = np.arange(50, 150)  # 100 sampled clients with global ids
    plan = grouper.plan(1, clients, np.random.default_rng(1))
    # Round 1: M = 10 * floor(2 ln 1 + 1) = 10 -> L = 10 clusters of 10 -> 10 groups.
    assert plan.groups is not None and len(plan.groups) == 10
    assert sorted(itertools.chain.from_iterable(plan.groups)) == clients.tolist()
    assert len(plan.chains) == 3  # ceil(0.3 * 10), despite 0.3 * 10 > 3.0 in floats
    group_sets = [set(group) for group in plan.groups]
    assert all(set(chain) in group_sets for chain in plan.chains)
    assert plan.weighting == "uniform"

    later = grouper.plan(3, clients, np.random.default_rng(1))  # M = 30 -> L = 3 -> 33
    assert later.groups is not None and len(later.groups) == 33
    assert len(later.chains) == math.ceil(0.3 * 33)


def test_plan_is_reproducible_from_the_generator() -> None:
    counts = skewed_counts(np.random.default_rng(0))
    grouper = FedGSPGrouper(FedGSPConfig(name="fedgsp", group_fraction=0.5))
    grouper.prepare(counts)
    first = grouper.plan(2, np.arange(100), np.random.default_rng(9))
    second = grouper.plan(2, np.arange(100), np.random.default_rng(9))
    assert first == second


def test_naive_mode_uses_random_groups_of_fixed_size() -> None:
    grouper = FedGSPGrouper(
        FedGSPConfig(name="fedgsp", mode="naive", fixed_groups=7, group_fraction=1.0)
    )
    plan = grouper.plan(5, np.arange(50), np.random.default_rng(0))
    assert plan.groups is not None
    assert sorted(len(group) for group in plan.groups) == [7, 7, 7, 7, 7, 7, 8]
    assert len(plan.chains) == 7


def test_naive_icg_mode_keeps_m_fixed_across_rounds() -> None:
    counts = skewed_counts(np.random.default_rng(0))
    grouper = FedGSPGrouper(FedGSPConfig(name="fedgsp", mode="naive_icg", fixed_groups=20))
    grouper.prepare(counts)
    for round_number in (1, 50):
        plan = grouper.plan(round_number, np.arange(100), np.random.default_rng(0))
        assert plan.groups is not None and len(plan.groups) == 20
        assert len(plan.chains) == 6


def test_icg_modes_need_prepare() -> None:
    grouper = FedGSPGrouper(FedGSPConfig(name="fedgsp"))
    with pytest.raises(RuntimeError, match="prepare"):
        grouper.plan(1, np.arange(10), np.random.default_rng(0))


# ---------------------------------------------------------------------------- config


def train_with(aggregator: str) -> SimpleNamespace:
    return SimpleNamespace(aggregator=SimpleNamespace(name=aggregator))


def test_incompatible_with_scaffold_and_fednova_only() -> None:
    config = FedGSPConfig(name="fedgsp")
    for aggregator in ("scaffold", "fednova"):
        (reason,) = config.incompatibilities(train_with(aggregator))
        assert aggregator in reason and "chain" in reason
    for aggregator in ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"):
        assert config.incompatibilities(train_with(aggregator)) == []


def test_config_is_strict_and_ranged() -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        FedGSPConfig(name="fedgsp", kapa=0.3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        FedGSPConfig(name="fedgsp", group_fraction=0.0)
    with pytest.raises(ValidationError):
        FedGSPConfig(name="fedgsp", growth="quadratic")  # type: ignore[arg-type]


def test_registers_the_fedgsp_grouper() -> None:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(fedgsp, name="fedplug.algorithms.fedgsp")
    registry = collect_registry(manager)
    config = FedGSPConfig(name="fedgsp")
    assert isinstance(registry.build("groupers", config), FedGSPGrouper)


# ------------------------------------------------------------------------ cost model


def test_round_cost_of_two_chains_by_hand() -> None:
    # Chains [0, 1] and [2]; samples 100, 50, 120; 1e6 FLOPs per sample; 1 epoch.
    link = LinkAndDevice(device_flops=1e9, uplink_bps=1e8, downlink_bps=2e8, server_flops=1e9)
    cost = round_cost(
        [[0, 1], [2]],
        np.array([100, 50, 120]),
        local_epochs=1,
        train_flops_per_sample=1_000_000,
        model_bytes=4_000_000,
        link=link,
    )
    # Slowest chain: 150 samples * 1e6 / 1e9 = 0.15 s; summing 2 models of 1e6
    # parameters: 1 * 1e6 / 1e9 = 0.001 s.
    assert cost.compute_seconds == pytest.approx(0.151)
    # 3 participants, each one download and one upload of 4 MB (the hand-off 0 -> 1
    # goes through the group manager): 12 MB each way.
    assert cost.bytes_up == cost.bytes_down == 12_000_000
    assert cost.handoffs == 1
    # 8 * 12e6 / 2e8 down + 8 * 12e6 / 1e8 up = 0.48 + 0.96.
    assert cost.communication_seconds == pytest.approx(1.44)
    assert cost.total_seconds == pytest.approx(1.591)


def test_round_cost_matches_paper_equations_for_fedavg_like_plans() -> None:
    # kappa K clients alone (chains of one): eq. 16-17 give 2 kappa K M bytes and
    # 8 kappa K M (1/R_in + 1/R_out) seconds; eq. 15's training term n e N / T.
    link = LinkAndDevice()
    chains = [[client] for client in range(30)]
    cost = round_cost(chains, np.full(30, 226), 2, 96_000_000, 25_200_000, link)
    assert cost.bytes_up + cost.bytes_down == 2 * 30 * 25_200_000
    assert cost.communication_seconds == pytest.approx(8 * 30 * 25.2e6 * 2 / 567e6)
    assert cost.compute_seconds == pytest.approx(96e6 / 567e9 * 226 * 2 + 29 * 6.3e6 / 567e9)


def test_link_rejects_non_positive_rates() -> None:
    with pytest.raises(ConfigError, match="uplink_bps"):
        LinkAndDevice(uplink_bps=0.0)


# ------------------------------------------------------------- matched local budgets


def _run_counting_steps(train: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[list, int]:
    """One run of SMALL_EXPERIMENT with ``train`` changes on 8 clients of 64 training
    samples each; returns its history and the number of SGD steps taken in all."""
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"].update({"partition": {"name": "iid"}, "num_clients": 8})
    data["data"]["dataset"].update({"num_train": 640})
    data["train"].update({"rounds": 2, "batch_size": 16, "engine": "sequential", **train})
    steps = 0
    original = local_training.FusedSGD.step

    def counting(self: local_training.FusedSGD) -> None:
        nonlocal steps
        steps += 1
        original(self)

    monkeypatch.setattr(local_training.FusedSGD, "step", counting)
    result, simulator = run_experiment(validate_experiment(data), None)
    sizes = {client.num_samples for client in simulator.federation.clients}
    assert sizes == {64}, "the budgets match only for equal client sizes"
    return result.history, steps


def test_fedavg_can_match_a_group_chains_local_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # NaiveGSP with 2 fixed groups of 4 clients and kappa = 0.5: one chain of 4 clients
    # trains per round, each client 1 epoch of 64 / 16 = 4 steps: 16 SGD steps per round,
    # all on the one model the server gets. FedAvg with client_fraction 1/8 (one client)
    # and local_epochs 4 takes the same 16 steps on the one model it aggregates, and the
    # cost model charges both rounds the same compute time (4 x 64 samples in sequence).
    grouped, grouped_steps = _run_counting_steps(
        {
            "client_fraction": 1.0,
            "grouper": {"name": "fedgsp", "mode": "naive", "fixed_groups": 2, "group_fraction": 0.5},
        },
        monkeypatch,
    )
    matched, matched_steps = _run_counting_steps(
        {"client_fraction": 0.125, "local_epochs": 4}, monkeypatch
    )

    assert grouped_steps == matched_steps == 2 * 16
    assert [record.participants for record in grouped] == [4, 4]
    assert [record.participants for record in matched] == [1, 1]
    for ours, theirs in zip(grouped, matched, strict=True):
        assert ours.compute_seconds_model > 0
        assert ours.compute_seconds_model == pytest.approx(theirs.compute_seconds_model)
