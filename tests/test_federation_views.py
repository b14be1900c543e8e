"""The federation as arrays: clients built on access equal the clients the eager loop
built (bit for bit), the cache stays bounded, and the lean data paths (partition indices
as one array, dirichlet_client's fast path, the block-wise synthetic generator) give
the numbers their straightforward versions give."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fedplug.algorithms.fedgsp import cpd_summary
from fedplug.config import validate_section
from fedplug.cost_model import LinkAndDevice, chain_training_seconds
from fedplug.data import partitions as partitions_module
from fedplug.data.build import build_federation, load_dataset, make_partition
from fedplug.data.datasets import make_synthetic
from fedplug.data.federation import ClientArrays, ClientData, Federation
from fedplug.data.partitions import (
    ClientIndices,
    Partition,
    dirichlet_client_counts,
    draw_without_replacement,
    indices_from_assignment,
    load_partition,
    save_partition,
)
from fedplug.faults import Faults
from fedplug.plugins import default_registry
from fedplug.run.evaluation import Evaluator
from fedplug.run.round_plan import clients_per_round, plan_round, sample_clients


def data_config(partition: dict[str, Any], local_test_fraction: float, num_clients: int = 12) -> Any:
    return validate_section(
        "data",
        {
            "dataset": {"name": "synthetic", "num_train": 600, "num_test": 50, "num_features": 5, "num_classes": 4},
            "partition": partition,
            "num_clients": num_clients,
            "local_test_fraction": local_test_fraction,
            "seed": 3,
        },
        default_registry(),
    )


def eager_clients(config: Any) -> list[ClientData]:
    """The clients as the per-client loop built them before the federation became
    arrays: written out here, independent of fedplug.data.federation."""
    registry = default_registry()
    dataset = load_dataset(config, registry)
    partition = make_partition(dataset, config, registry)
    train_y = torch.as_tensor(dataset.train_y, dtype=torch.long)
    clients = []
    for client_id, indices in enumerate(partition.client_indices):
        rng = np.random.default_rng([config.seed, client_id, 0x7E57])
        shuffled = rng.permutation(np.asarray(indices))
        num_test = min(int(np.floor(config.local_test_fraction * len(shuffled))), max(len(shuffled) - 1, 0))
        train_ids, test_ids = shuffled[num_test:], shuffled[:num_test]
        x_train, x_test = dataset.train_x[train_ids], dataset.train_x[test_ids]
        if partition.noise_std is not None:
            std = float(partition.noise_std[client_id])
            noisy = [np.asarray(x, dtype=np.float32) for x in (x_train, x_test)]
            noisy = [x + rng.normal(0.0, std, size=x.shape).astype(np.float32) if std > 0 else x for x in noisy]
            x_train, x_test = (np.clip(x, 0.0, 1.0) for x in noisy)
        y_train = train_y[train_ids]
        clients.append(
            ClientData(
                client_id=client_id,
                train_x=torch.as_tensor(x_train, dtype=torch.float32),
                train_y=y_train,
                test_x=torch.as_tensor(x_test, dtype=torch.float32),
                test_y=train_y[test_ids],
                class_counts=np.bincount(y_train.numpy(), minlength=dataset.num_classes).astype(np.int64),
            )
        )
    return clients


def same_client(a: ClientData, b: ClientData) -> bool:
    tensors = ("train_x", "train_y", "test_x", "test_y")
    return (
        a.client_id == b.client_id
        and all(getattr(a, name).dtype == getattr(b, name).dtype for name in tensors)
        and all(torch.equal(getattr(a, name), getattr(b, name)) for name in tensors)
        and np.array_equal(a.class_counts, b.class_counts)
        and a.class_counts.dtype == b.class_counts.dtype
    )


CASES = [
    pytest.param({"name": "dirichlet_client", "alpha": 1.0}, 0.0, id="no-local-test"),
    pytest.param({"name": "dirichlet_class", "alpha": 0.5, "min_size": 2}, 0.25, id="local-test"),
    pytest.param({"name": "feature_noise", "sigma": 0.3}, 0.2, id="feature-noise"),
    pytest.param({"name": "feature_noise", "sigma": 0.3}, 0.0, id="feature-noise-no-local-test"),
]


@pytest.mark.parametrize(("partition", "fraction"), CASES)
def test_lazy_clients_equal_the_eager_loop_bit_for_bit(partition: dict[str, Any], fraction: float) -> None:
    config = data_config(partition, fraction)
    expected = eager_clients(config)
    federation = build_federation(config, default_registry())
    assert isinstance(federation.clients, ClientArrays)
    assert len(federation.clients) == federation.num_clients == len(expected)
    # In a scrambled order (and twice), so no client depends on another being built first.
    for client_id in [7, 0, 11, 3, 7, *range(12)]:
        assert same_client(federation.clients[client_id], expected[client_id]), client_id
    assert all(same_client(a, b) for a, b in zip(federation.clients, expected, strict=True))
    assert np.array_equal(federation.class_counts, np.stack([c.class_counts for c in expected]))
    assert np.array_equal(federation.client_sizes, [c.num_samples for c in expected])
    assert same_client(federation.clients[-1], expected[-1])
    assert [c.client_id for c in federation.clients[2:5]] == [2, 3, 4]


@pytest.mark.parametrize(("partition", "fraction"), CASES)
def test_class_counts_and_local_tests_before_any_client_is_built(partition: dict[str, Any], fraction: float) -> None:
    """The K x C counts and the evaluator's local tests come from the arrays (one pass),
    not from built clients, and equal the eager ones."""
    config = data_config(partition, fraction)
    expected = eager_clients(config)
    federation = build_federation(config, default_registry())
    counts = federation.class_counts
    x, y, sizes = federation.local_test_set()
    assert not federation.clients._cache  # nothing was built
    assert np.array_equal(counts, np.stack([c.class_counts for c in expected]))
    assert torch.equal(x, torch.cat([c.test_x for c in expected]))
    assert torch.equal(y, torch.cat([c.test_y for c in expected]))
    assert sizes.tolist() == [len(c.test_y) for c in expected]
    assert x.dtype == torch.float32 and y.dtype == torch.long


def test_class_counts_and_local_tests_share_one_pass_over_the_clients(monkeypatch) -> None:
    """With a local test split, the per-client generators run once for the class counts
    and the evaluator's local tests together (the O(K) step), not once for each."""
    federation = build_federation(data_config({"name": "iid"}, 0.25), default_registry())
    calls = []
    split = ClientArrays._split
    monkeypatch.setattr(ClientArrays, "_split", lambda self, k: calls.append(k) or split(self, k))
    counts = federation.class_counts
    federation.local_test_set()
    assert federation.class_counts is counts
    assert calls == list(range(12))


def test_evaluator_of_a_lazy_federation_equals_the_eager_one() -> None:
    config = data_config({"name": "feature_noise", "sigma": 0.3}, 0.25)
    lazy = build_federation(config, default_registry())
    eager = Federation(
        clients=eager_clients(config),
        test_x=lazy.test_x,
        test_y=lazy.test_y,
        num_classes=lazy.num_classes,
        input_shape=lazy.input_shape,
        dataset_name=lazy.dataset_name,
    )
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(5, 4))
    torch.nn.init.normal_(model[1].weight, generator=torch.Generator().manual_seed(0))
    assert Evaluator(lazy, 7).evaluate(model) == Evaluator(eager, 7).evaluate(model)


def test_the_cache_keeps_the_last_clients_built_and_no_more() -> None:
    config = data_config({"name": "dirichlet_client", "alpha": 1.0}, 0.2)
    federation = build_federation(config, default_registry(), cache_clients=3)
    clients = federation.clients
    first = clients[0]
    assert clients[0] is first  # cached: the same tensors, not gathered again
    for client_id in (1, 2, 0, 4):  # 0 used again: 1 is now the least recent
        clients[client_id]
    assert list(clients._cache) == [2, 0, 4]
    assert clients[0] is first
    for client_id in range(12):
        clients[client_id]
        assert len(clients._cache) <= 3
    rebuilt = clients[0]
    assert rebuilt is not first and same_client(rebuilt, first)


def test_bad_client_ids_and_cache_sizes_are_refused() -> None:
    federation = build_federation(data_config({"name": "iid"}, 0.0, num_clients=4), default_registry())
    with pytest.raises(IndexError, match="client 4 is out of range; the federation has 4 clients"):
        federation.clients[4]
    with pytest.raises(IndexError):
        federation.clients[-5]
    with pytest.raises(TypeError, match="client ids are integers"):
        federation.clients[1.0]  # type: ignore[call-overload]
    assert federation.clients[np.int64(2)].client_id == 2
    with pytest.raises(ValueError, match="cache_clients must be at least 1"):
        build_federation(data_config({"name": "iid"}, 0.0, num_clients=4), default_registry(), cache_clients=0)


def test_a_list_federation_reports_sizes_and_local_tests_from_its_clients() -> None:
    """Federations made in code from a list (tests, benchmarks) keep working: sizes and
    the local test set come from the ClientData objects."""
    clients = [
        ClientData(k, torch.ones(n, 2), torch.zeros(n, dtype=torch.long), torch.full((t, 2), float(k)),
                   torch.full((t,), k, dtype=torch.long), np.array([n, 0]))
        for k, (n, t) in enumerate([(3, 1), (5, 0), (2, 2)])
    ]
    federation = Federation(clients, torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), 2, (2,), "hand")
    x, y, sizes = federation.local_test_set()
    assert federation.client_sizes.tolist() == [3, 5, 2]
    assert sizes.tolist() == [1, 0, 2]
    assert y.tolist() == [0, 2, 2] and x[:, 0].tolist() == [0.0, 2.0, 2.0]
    assert federation.class_counts.tolist() == [[3, 0], [5, 0], [2, 0]]


# ------------------------------------------------------------------- partitions


def test_client_indices_read_like_the_list_of_arrays_they_replace() -> None:
    parts = [np.array([4, 1]), np.array([], dtype=np.int64), np.array([0, 2, 3])]
    indices = ClientIndices.from_sizes(np.concatenate(parts), np.array([2, 0, 3]))
    assert len(indices) == 3
    assert [part.tolist() for part in indices] == [[4, 1], [], [0, 2, 3]]
    assert indices[-1].tolist() == [0, 2, 3] and indices[np.int32(0)].tolist() == [4, 1]
    assert [part.tolist() for part in indices[1:]] == [[], [0, 2, 3]]
    assert np.concatenate(indices).tolist() == [4, 1, 0, 2, 3]
    with pytest.raises(IndexError):
        indices[3]
    partition = Partition(indices, np.array([[1, 1], [0, 0], [2, 1]]))
    assert partition.sizes.tolist() == [2, 0, 3]


def test_a_saved_partition_loads_as_the_same_clients(tmp_path) -> None:
    original = Partition([np.array([2, 0]), np.array([3]), np.array([1, 4])], np.array([[2], [1], [2]]))
    save_partition(tmp_path / "p.npz", original)
    loaded = load_partition(tmp_path / "p.npz")
    assert isinstance(loaded.client_indices, ClientIndices)
    assert [i.tolist() for i in loaded.client_indices] == [[2, 0], [3], [1, 4]]
    save_partition(tmp_path / "q.npz", loaded)  # and back, from the flat form
    with np.load(tmp_path / "p.npz") as first, np.load(tmp_path / "q.npz") as second:
        assert sorted(first.files) == sorted(second.files) == ["class_counts", "indices", "offsets"]
        for key in first.files:
            assert first[key].dtype == second[key].dtype and np.array_equal(first[key], second[key])
        assert first["offsets"].tolist() == [0, 2, 3, 5] and first["indices"].tolist() == [2, 0, 3, 1, 4]
    loaded.validate(5)


def dirichlet_client_counts_reference(class_sizes, client_sizes, alpha, rng):
    """Client after client: q_k = rng.dirichlet, then the general capped draw."""
    class_sizes = np.asarray(class_sizes, dtype=np.int64)
    present = class_sizes > 0
    prior = class_sizes[present] / class_sizes.sum()
    remaining = class_sizes.copy()
    counts = np.zeros((len(client_sizes), class_sizes.size), dtype=np.int64)
    for client, size in enumerate(client_sizes):
        label_mix = np.zeros(class_sizes.size)
        label_mix[present] = rng.dirichlet(alpha * prior)
        counts[client] = draw_without_replacement(int(size), label_mix, remaining, rng)
        remaining -= counts[client]
    return counts


@pytest.mark.parametrize(
    ("class_sizes", "client_sizes", "alpha"),
    [
        ([20] * 5, [10] * 10, 1.0),  # classes run out at the end
        ([100, 0, 5, 300], [20] * 20, 0.5),  # an absent class, a class that runs out early
        ([30, 70], [20] * 5, 0.01),  # tiny alpha: numpy's stick-breaking dirichlet
        ([40, 40, 40, 1], [15] * 8 + [0, 1], 1.0),  # a class of one sample, empty clients
    ],
)
def test_dirichlet_client_counts_have_the_distribution_of_the_per_client_loop(
    class_sizes, client_sizes, alpha
) -> None:
    class_sizes = np.array(class_sizes)
    client_sizes = np.array(client_sizes)
    client_sizes[-1] += class_sizes.sum() - client_sizes.sum()
    runs = 1500
    batched = np.array(
        [dirichlet_client_counts(class_sizes, client_sizes, alpha, np.random.default_rng(s)) for s in range(runs)]
    )
    reference = np.array(
        [
            dirichlet_client_counts_reference(class_sizes, client_sizes, alpha, np.random.default_rng(10**6 + s))
            for s in range(runs)
        ]
    )
    assert (batched.sum(axis=1) == class_sizes).all() and (batched.sum(axis=2) == client_sizes).all()
    # Per (client, class): the difference of the two means in standard errors. At most
    # 44 cells, so |z| > 4.5 by chance has probability below 3e-4 (normal tails).
    for statistic in (batched.astype(float), (batched > 0).astype(float)):
        other = reference if statistic.max() > 1 else (reference > 0)
        error = np.sqrt(statistic.var(axis=0) / runs + other.var(axis=0) / runs)
        z = np.abs(statistic.mean(axis=0) - other.mean(axis=0)) / np.maximum(error, 1e-9)
        assert z.max() < 4.5, (np.unravel_index(z.argmax(), z.shape), z.max())


def test_dirichlet_client_counts_on_an_ample_pool_are_one_dirichlet_and_one_multinomial_call() -> None:
    # No class can run out (each holds more than all clients together take), so every
    # client keeps its multinomial draw: the counts are numpy's two batched calls.
    class_sizes, client_sizes, alpha = np.array([500, 300, 200]), np.array([7, 9, 4, 12]), 0.8
    expected_rng = np.random.default_rng(3)
    label_mix = expected_rng.dirichlet(alpha * class_sizes / class_sizes.sum(), size=4)
    expected = expected_rng.multinomial(client_sizes, label_mix)

    counts = dirichlet_client_counts(class_sizes, client_sizes, alpha, np.random.default_rng(3))

    assert np.array_equal(counts, expected)


def test_dirichlet_client_counts_batches_join_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # Batches of 3 clients: the pool carried from batch to batch is used up exactly.
    monkeypatch.setattr(partitions_module.sampling, "DIRICHLET_CLIENT_BATCH", 3)
    counts = dirichlet_client_counts(np.array([17, 9, 4]), np.array([3] * 10), 0.3, np.random.default_rng(5))
    assert counts.sum(axis=0).tolist() == [17, 9, 4] and counts.sum(axis=1).tolist() == [3] * 10


# ------------------------------------------------------------------ synthetic data


def make_synthetic_reference(num_train, num_test, num_features, num_classes, class_separation, rng):
    """The generator as one large draw (three float64 arrays at once)."""
    means = rng.normal(0.0, class_separation, size=(num_classes, num_features))
    train_y = rng.permutation(np.arange(num_train, dtype=np.int64) % num_classes)
    test_y = rng.permutation(np.arange(num_test, dtype=np.int64) % num_classes)
    train_x = means[train_y] + rng.standard_normal((num_train, num_features))
    test_x = means[test_y] + rng.standard_normal((num_test, num_features))
    low = min(train_x.min(), test_x.min())
    span = max(train_x.max(), test_x.max()) - low
    return ((train_x - low) / span).astype(np.float32), train_y, ((test_x - low) / span).astype(np.float32), test_y


@pytest.mark.parametrize("block_values", [1 << 22, 64, 7])
def test_block_wise_synthetic_data_equals_one_large_draw(monkeypatch, block_values: int) -> None:
    monkeypatch.setattr("fedplug.data.datasets.synthetic.SYNTHETIC_BLOCK_VALUES", block_values)
    expected_rng, rng = np.random.default_rng(5), np.random.default_rng(5)
    expected = make_synthetic_reference(1003, 211, 7, 5, 1.5, expected_rng)
    dataset = make_synthetic(1003, 211, 7, 5, 1.5, rng)
    for want, got in zip(expected, (dataset.train_x, dataset.train_y, dataset.test_x, dataset.test_y)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert expected_rng.random() == rng.random()


# ------------------------------------------------------------- per-round paths


@pytest.mark.parametrize(("num_clients", "count"), [(1, 1), (37, 5), (1000, 100), (20_000, 100), (50_000, 2000)])
def test_sampling_from_a_count_equals_sampling_from_the_id_array(num_clients: int, count: int) -> None:
    for seed, round_index in [(0, 0), (3, 7), (11, 2)]:
        from_array = sample_clients(np.arange(num_clients), count, seed, round_index)
        from_count = sample_clients(num_clients, count, seed, round_index)
        assert from_count.dtype == np.int64 and np.array_equal(from_count, from_array)
    assert clients_per_round(num_clients, count / num_clients) == count


def test_round_plans_are_those_of_sampling_among_every_id() -> None:
    """The simulator's plan (no trace: sampled from K without an id array) equals the
    plan drawn among an explicit array of all ids (the path a trace or Flower takes)."""
    config = validate_section(
        "train",
        {"model": {"name": "logreg"}, "client_fraction": 0.01, "rounds": 5, "seed": 4,
         "faults": {"dropout": {"probability": 0.3}}},
        default_registry(),
    )
    grouper = default_registry().build("groupers", config.grouper)
    faults = Faults.for_run(config, 5000)
    for round_index in range(5):
        plan, dropout = plan_round(config, grouper, 5000, round_index, faults)
        explicit, explicit_dropout = plan_round(
            config, grouper, 5000, round_index, faults, candidates=np.arange(5000)
        )
        assert plan.chains == explicit.chains and plan.chains
        assert dropout.entries(1) == explicit_dropout.entries(1)


def test_chain_time_reads_only_the_members() -> None:
    link = LinkAndDevice()
    sizes = np.array([3, 5, 7], dtype=np.int64)
    assert chain_training_seconds([0, 2], sizes, 2, 100, link) == (3 + 7) * 2 * 100 / link.device_flops
    slow = np.array([1.0, 1.0, 4.0])
    assert chain_training_seconds([2, 0], sizes, 1, 10, link, slow) == (7 * 4.0 + 3) * 10 / link.device_flops


def test_cpd_of_integer_counts_equals_that_of_the_same_counts_as_floats() -> None:
    counts = np.random.default_rng(0).integers(0, 50, size=(40, 6))
    groups = [[0, 5], [7], [3, 9, 11], [20], [39, 1]]
    assert cpd_summary(groups, counts) == cpd_summary(groups, counts.astype(np.float64))


@pytest.mark.parametrize(("num_clients", "unassigned"), [(70_000, False), (70_000, True), (300, True), (1 << 17, False)])
def test_grouping_by_client_equals_one_stable_sort(num_clients: int, unassigned: bool) -> None:
    """Client ids wider than 16 bits are sorted as two radix digits; the grouping equals
    one stable argsort of the ids (with and without unassigned samples, -1)."""
    assignment = np.random.default_rng(1).integers(-1 if unassigned else 0, num_clients, size=200_000)
    grouped = indices_from_assignment(assignment, num_clients, np.random.default_rng(2))
    order = np.random.default_rng(2).permutation(assignment.size)
    owners = assignment[order]
    order, owners = order[owners >= 0], owners[owners >= 0]
    expected = order[np.argsort(owners, kind="stable")]
    assert grouped.flat.dtype == np.int64 and np.array_equal(grouped.flat, expected)
    assert np.array_equal(np.diff(grouped.offsets), np.bincount(owners, minlength=num_clients))
