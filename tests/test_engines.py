"""The vectorised engine against the sequential one: the same updates, client by client.

Both engines run inside a real :class:`Simulator` (same federation, seed and start
vector); a recording wrapper keeps every outcome each engine yields, so the tests compare
every client's vector, weight, step count and extras, and the final global model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from fedplug.components import ClientUpdate, ComponentConfig, LossTransform
from fedplug.config import validate_section
from fedplug.data.build import build_federation
from fedplug.data.federation import Federation
from fedplug.errors import ConfigError
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.round_screen import ClientFailure
from fedplug.simulation.sequential import SequentialEngine
from fedplug.simulation.simulator import Simulator
from fedplug.simulation.vectorized import VectorizedEngine
from fedplug.simulation.vectorized_blocks import batch_plan, stack_contexts

ATOL = 1e-5
BATCH_SIZE = 7

DATA: dict[str, Any] = {
    "dataset": {
        "name": "synthetic",
        "num_train": 600,
        "num_test": 100,
        "num_features": 12,
        "num_classes": 4,
    },
    "partition": {"name": "dirichlet_class", "alpha": 0.3, "min_size": 5},
    "num_clients": 6,
    "local_test_fraction": 0.2,
    "seed": 0,
}

TRAIN: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [16]},
    "client_fraction": 1.0,
    "rounds": 2,
    "local_epochs": 2,
    "batch_size": BATCH_SIZE,
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    "seed": 0,
}


# ------------------------------------------------------------------ test components


class SampleWeightedConfig(ComponentConfig):
    """Per-sample weights of length n_k, like FedDisk's (without its MADE phase)."""

    name: Literal["sample_weighted"] = "sample_weighted"


class SampleWeighted(LossTransform):
    def __init__(self, config: SampleWeightedConfig) -> None:
        self.config = config
        self.sizes: list[int] = []

    def prepare(self, federation: Any) -> None:
        self.sizes = [client.num_samples for client in federation.clients]

    def client_context(self, client_id: int, class_counts: np.ndarray) -> dict[str, Tensor]:
        count = self.sizes[client_id]
        return {"sample_weight": 0.5 + torch.arange(count, dtype=torch.float32) / count}

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Any
    ) -> Tensor:
        weights = context["sample_weight"].gather(0, sample_ids)
        return weights * super().per_sample_loss(logits, targets, sample_ids, context)


class BrokenDiskConfig(ComponentConfig):
    """Cross-entropy, but client 1's context cannot be read."""

    name: Literal["broken_disk"] = "broken_disk"


class BrokenDisk(LossTransform):
    def __init__(self, config: BrokenDiskConfig) -> None:
        self.config = config

    def client_context(self, client_id: int, class_counts: np.ndarray) -> dict[str, Tensor]:
        if client_id == 1:
            raise OSError("client 1 lost its disk")
        return {}


class Recorder:
    """Wraps an engine and keeps what it yields, round by round."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = engine.name
        self.rounds: list[list[ClientUpdate | ClientFailure]] = []

    def run_round(self, *args: Any) -> Iterator[ClientUpdate | ClientFailure]:
        outcomes: list[ClientUpdate | ClientFailure] = []
        self.rounds.append(outcomes)
        for outcome in self.engine.run_round(*args):
            outcomes.append(outcome)
            yield outcome

    def derived_params(self) -> dict[str, Any]:
        return self.engine.derived_params()

    def close(self) -> None:
        self.engine.close()


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(scope="module")
def registry() -> Registry:
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register(
        "loss_transforms", "test", "sample_weighted", SampleWeightedConfig, SampleWeighted
    )
    registry.register("loss_transforms", "test", "broken_disk", BrokenDiskConfig, BrokenDisk)
    return registry


@pytest.fixture(scope="module")
def federation(registry: Registry) -> Federation:
    return build_federation(validate_section("data", DATA, registry), registry)


def simulate(
    registry: Registry,
    federation: Federation,
    engine: str,
    engine_options: dict[str, Any] | None = None,
    **train: Any,
) -> tuple[Simulator, Recorder]:
    config = validate_section("train", {**TRAIN, **train}, registry)
    simulator = Simulator(config, federation, registry)
    if engine == "sequential":
        recorder = Recorder(SequentialEngine(simulator.model))
    else:
        recorder = Recorder(VectorizedEngine(simulator.model, **(engine_options or {})))
    simulator.engine = recorder
    simulator.run(resume=False)
    return simulator, recorder


def by_chain(outcomes: list[Any]) -> dict[tuple[int, ...], Any]:
    return {tuple(outcome.chain): outcome for outcome in outcomes}


def assert_same_updates(expected: Recorder, actual: Recorder) -> None:
    assert len(expected.rounds) == len(actual.rounds)
    for round_expected, round_actual in zip(expected.rounds, actual.rounds):
        wanted, got = by_chain(round_expected), by_chain(round_actual)
        assert sorted(wanted) == sorted(got)
        for chain, update in wanted.items():
            other = got[chain]
            assert isinstance(update, ClientUpdate) and isinstance(other, ClientUpdate)
            assert (other.client_id, other.weight, other.num_steps) == (
                update.client_id,
                update.weight,
                update.num_steps,
            )
            torch.testing.assert_close(other.vector, update.vector, rtol=0.0, atol=ATOL)
            assert sorted(other.extras) == sorted(update.extras)
            for key, value in update.extras.items():
                torch.testing.assert_close(other.extras[key], value, rtol=0.0, atol=ATOL)


def compare_engines(
    registry: Registry,
    federation: Federation,
    engine_options: dict[str, Any] | None = None,
    **train: Any,
) -> tuple[Simulator, Recorder, Simulator, Recorder]:
    sequential, sequential_log = simulate(registry, federation, "sequential", **train)
    vectorized, vectorized_log = simulate(
        registry, federation, "vectorized", engine_options, **train
    )
    assert_same_updates(sequential_log, vectorized_log)
    torch.testing.assert_close(
        vectorized.final_vector, sequential.final_vector, rtol=0.0, atol=ATOL
    )
    # The model moved: the comparison is not between two untouched start vectors.
    assert not torch.allclose(sequential.final_vector, sequential.engine.rounds[0][0].vector)
    return sequential, sequential_log, vectorized, vectorized_log


# ------------------------------------------------------------------ equivalences


def test_fedavg_with_unequal_clients_momentum_and_weight_decay(registry, federation):
    sizes = [client.num_samples for client in federation.clients]
    assert len(set(sizes)) == len(sizes)  # every client a different size
    assert any(size % BATCH_SIZE for size in sizes)  # short last batches
    compare_engines(registry, federation)


def test_fedprox_penalty(registry, federation):
    compare_engines(registry, federation, loss_transform={"name": "fedprox", "mu": 0.5})


def test_scaffold_control_variates(registry, federation):
    sequential, _, vectorized, _ = compare_engines(
        registry, federation, aggregator="scaffold", optimizer={"name": "sgd", "lr": 0.05}
    )
    # After round 1 c is non-zero, so round 2's correction entered the local steps.
    control = sequential.algorithm.aggregator.control
    assert control is not None and control.abs().max() > 1e-3
    torch.testing.assert_close(
        vectorized.algorithm.aggregator.control, control, rtol=0.0, atol=ATOL
    )


def test_fedshift_per_client_shift(registry, federation):
    compare_engines(registry, federation, loss_transform="fedshift")


def test_iwds_sampler(registry, federation):
    compare_engines(registry, federation, sampler="iwds")


def test_per_sample_weights_are_padded_to_the_longest_client(registry, federation):
    compare_engines(registry, federation, loss_transform="sample_weighted")


def test_fedgsp_chains_of_unequal_length_with_fedprox(registry, federation):
    grouper = {"name": "fedgsp", "mode": "naive", "fixed_groups": 4, "group_fraction": 1.0}
    _, sequential_log, _, _ = compare_engines(
        registry,
        federation,
        grouper=grouper,
        local_epochs=1,
        loss_transform={"name": "fedprox", "mu": 0.5},
    )
    chains = [outcome.chain for outcome in sequential_log.rounds[0]]
    assert sorted(len(chain) for chain in chains) == [1, 1, 2, 2]  # unequal chains
    assert all(outcome.weight == 1.0 for outcome in sequential_log.rounds[0])  # uniform weighting


def test_simulator_histories_agree(registry, federation):
    histories = {}
    for engine in ("sequential", "vectorized"):
        config = validate_section("train", {**TRAIN, "engine": engine}, registry)
        simulator = Simulator(config, federation, registry)
        assert simulator.engine.name == engine
        histories[engine] = simulator.run(resume=False).history
    for expected, actual in zip(histories["sequential"], histories["vectorized"]):
        assert actual.accuracy == expected.accuracy
        assert actual.loss == pytest.approx(expected.loss, abs=1e-5)
        assert (actual.bytes_up, actual.failures) == (expected.bytes_up, expected.failures)


# ------------------------------------------------------------------ blocks and failures


def test_small_blocks_give_the_same_updates(registry, federation):
    _, _, vectorized, _ = compare_engines(
        registry, federation, {"max_clients_per_block": 4}, rounds=1
    )
    assert vectorized.engine.engine.block_size == 4


def test_a_cpu_block_holds_a_few_clients_by_default(registry, federation):
    from fedplug.simulation.vectorized import DEFAULT_CPU_CLIENTS_PER_BLOCK

    _, recorder = simulate(registry, federation, "vectorized", rounds=1)
    assert recorder.engine.block_size == DEFAULT_CPU_CLIENTS_PER_BLOCK == 8


def test_block_size_follows_the_memory_budget(registry, federation):
    # A budget far below one client's footprint still trains, one client per block.
    _, _, vectorized, log = compare_engines(
        registry, federation, {"memory_fraction": 1e-12}, rounds=1
    )
    assert vectorized.engine.engine.block_size == 1
    assert len(log.rounds[0]) == federation.num_clients


def test_a_failing_block_fails_only_its_own_chains(registry, federation):
    _, sequential_log = simulate(
        registry, federation, "sequential", loss_transform="broken_disk", rounds=1
    )
    _, vectorized_log = simulate(
        registry,
        federation,
        "vectorized",
        {"max_clients_per_block": 2},
        loss_transform="broken_disk",
        rounds=1,
    )
    failed = [
        outcome.chain for outcome in vectorized_log.rounds[0] if isinstance(outcome, ClientFailure)
    ]
    # Client 1 and the one client that shares its block (blocks of 2).
    assert len(failed) == 2 and [1] in failed
    assert all(
        "client 1 lost its disk" in outcome.reason
        for outcome in vectorized_log.rounds[0]
        if isinstance(outcome, ClientFailure)
    )
    expected = by_chain(sequential_log.rounds[0])
    updates = [outcome for outcome in vectorized_log.rounds[0] if isinstance(outcome, ClientUpdate)]
    assert len(updates) == federation.num_clients - 2
    for update in updates:
        torch.testing.assert_close(
            update.vector, expected[tuple(update.chain)].vector, rtol=0.0, atol=ATOL
        )


def test_out_of_memory_halves_the_block_and_retries(registry, federation, monkeypatch):
    original = VectorizedEngine._train_group

    def limited(self, members, round_index, context):
        if len(members) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, members, round_index, context)

    monkeypatch.setattr(VectorizedEngine, "_train_group", limited)
    _, _, vectorized, log = compare_engines(
        registry, federation, aggregator="scaffold", optimizer={"name": "sgd", "lr": 0.05}
    )
    assert vectorized.engine.engine.block_size == 2
    assert all(isinstance(outcome, ClientUpdate) for outcome in log.rounds[-1])


def test_batch_norm_models_are_refused():
    with pytest.raises(ConfigError, match="BatchNorm"):
        VectorizedEngine(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))


# ------------------------------------------------------------------ the pieces


def test_batch_plan_pads_short_batches_and_idle_steps():
    # Client 0: epochs [4 0 3 1 2] and [2 2]; client 1: one epoch [5 6 7].  Batch size 2.
    plan = batch_plan([[np.array([4, 0, 3, 1, 2]), np.array([2, 2])], [np.array([5, 6, 7])]], 2)
    assert plan.steps.tolist() == [4, 2]
    assert plan.local_ids.tolist() == [
        [[4, 0], [3, 1], [2, 0], [2, 2]],
        [[5, 6], [7, 0], [0, 0], [0, 0]],
    ]
    assert plan.mask.tolist() == [
        [[1, 1], [1, 1], [1, 0], [1, 1]],
        [[1, 1], [1, 0], [0, 0], [0, 0]],
    ]


def test_batch_plan_narrows_to_the_longest_epoch():
    plan = batch_plan([[np.array([1, 0])], [np.array([2])]], 50)
    assert plan.local_ids.shape == (2, 1, 2)
    assert plan.mask.tolist() == [[[1, 1]], [[1, 0]]]


def test_stack_contexts_pads_the_first_dimension_and_stacks_nested_dicts():
    stacked = stack_contexts(
        [
            {"w": torch.tensor([1.0, 2.0, 3.0]), "inner": {"s": torch.tensor(1.0)}},
            {"w": torch.tensor([4.0]), "inner": {"s": torch.tensor(2.0)}},
        ]
    )
    assert stacked["w"].tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]
    assert stacked["inner"]["s"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    "contexts, message",
    [
        ([{"a": torch.zeros(2, 3)}, {"a": torch.zeros(2, 4)}], "only the first dimension"),
        ([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], "different keys"),
        ([{"a": 1.0}, {"a": 2.0}], "must be a tensor"),
    ],
)
def test_stack_contexts_explains_what_it_cannot_stack(contexts, message):
    with pytest.raises(TypeError, match=message):
        stack_contexts(contexts)


# ------------------------------------------------------------------ the analytic path


def test_plain_sgd_steps_in_place_on_the_analytic_path(registry, federation):
    plain_sgd = {"name": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0}
    _, _, _, vectorized_log = compare_engines(registry, federation, optimizer=plain_sgd)
    assert vectorized_log.engine.analytic_groups > 0


@pytest.mark.parametrize(
    ("train", "analytic"),
    [
        ({}, True),
        ({"model": {"name": "logreg"}}, True),
        ({"loss_transform": {"name": "fedprox", "mu": 0.5}}, False),  # a penalty
        ({"aggregator": "scaffold", "optimizer": {"name": "sgd", "lr": 0.05}}, False),  # client penalty
        ({"loss_transform": "fedshift"}, False),  # its own per-sample loss
        ({"loss_transform": "sample_weighted"}, False),
    ],
    ids=["mlp", "logreg", "fedprox", "scaffold", "fedshift", "sample-weighted"],
)
def test_only_linear_relu_models_under_plain_cross_entropy_take_the_analytic_path(
    registry, federation, train, analytic
):
    _, recorder = simulate(registry, federation, "vectorized", **{**train, "rounds": 1})
    assert (recorder.engine.analytic_groups > 0) is analytic


def test_linear_stack_recognises_only_flatten_linear_relu_sequences():
    from fedplug.simulation.linear_stack import linear_stack

    mlp = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    assert linear_stack(mlp) == [("1.weight", "1.bias"), ("3.weight", "3.bias")]
    assert linear_stack(nn.Sequential(nn.Linear(4, 2, bias=False))) == [("0.weight", None)]
    for other in (
        nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)),  # not ReLU
        nn.Sequential(nn.Linear(4, 3), nn.ReLU()),  # ends in an activation
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Linear(3, 2)),
        nn.Linear(4, 2),  # not a Sequential
    ):
        assert linear_stack(other) is None


@pytest.mark.parametrize("in_place", [False, True])
def test_the_analytic_step_is_autograds_gradient_of_the_mean_over_real_samples(in_place):
    from fedplug.simulation.linear_stack import LinearStackStep, linear_stack

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4, bias=False))
    clients, width, lr = 3, 4, 0.1
    inputs = torch.randn(clients, width, 2, 3)
    targets = torch.randint(0, 4, (clients, width))
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])  # short batches
    start = {name: p.detach() for name, p in model.named_parameters()}
    params = {name: (value + 0.1 * torch.randn(clients, *value.shape)) for name, value in start.items()}
    before = {name: value.clone() for name, value in params.items()}
    step = LinearStackStep(linear_stack(model))
    gradients, losses = step(params, inputs, targets, mask, lr if in_place else None)
    for n in range(clients):
        real = mask[n].bool()
        client = {name: value[n].clone().requires_grad_() for name, value in before.items()}
        logits = torch.func.functional_call(model, client, (inputs[n][real],))
        loss = torch.nn.functional.cross_entropy(logits, targets[n][real])
        expected = dict(zip(client, torch.autograd.grad(loss, list(client.values()))))
        assert losses[n].item() == pytest.approx(loss.item(), abs=1e-6)
        for name, gradient in expected.items():
            if in_place:
                torch.testing.assert_close(params[name][n], before[name][n] - lr * gradient, rtol=0.0, atol=1e-6)
            else:
                torch.testing.assert_close(gradients[name][n], gradient, rtol=0.0, atol=1e-6)
    assert (gradients is None) is in_place
