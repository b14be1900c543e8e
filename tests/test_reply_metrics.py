"""Reply metrics (``ClientNeeds.reply_metrics``): a component asks every client for its
mean training loss (``train_loss``), each runtime computes it only then, and Flower's
QFedAvg aggregates with it inside fedplug.

- ``train_locally``'s loss against one computed by hand on a tiny model, and nothing
  computed (nor changed) when nobody asks;
- the sequential, vectorised and parallel engines report the same losses;
- screening drops an update whose required metric is missing or not finite;
- QFedAvg's model against an independent numpy computation of q-FedAvg;
- QFedAvg in ``fedplug run``, on Flower's in-process grid (equal to the simulator within
  1e-5), and a loss-reading test-only aggregator on the FedML adapter (its venv only).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import numpy as np
import pytest
import torch
import yaml
from conftest import SMALL_EXPERIMENT
from torch import Tensor, nn
from torch.nn import functional as F

from fedplug.components import (
    REPLY_METRICS,
    TRAIN_LOSS,
    Aggregator,
    ClientNeeds,
    ClientUpdate,
    ComponentConfig,
    RoundPlan,
    WeightedMean,
)
from fedplug.config import validate_experiment, validate_section
from fedplug.data.build import build_federation
from fedplug.errors import ConfigError
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.local_training import (
    ClientAlgorithm,
    LocalSchedule,
    local_rng,
    train_locally,
)
from fedplug.run.round_plan import chain_update
from fedplug.run.round_screen import ClientFailure, unusable
from fedplug.simulation.sequential import SequentialEngine
from fedplug.simulation.simulator import Simulator
from fedplug.simulation.vectorized import VectorizedEngine

ATOL = 1e-5

# --------------------------------------------------------------- a loss-reading plugin


class LossWeightedConfig(ComponentConfig):
    """Test-only: the mean of the client models weighted by ``n_k * exp(-train_loss)``."""

    name: Literal["loss_weighted"] = "loss_weighted"


class LossWeighted(Aggregator):
    """Reads every update's ``train_loss``, so the result depends on it; keeps the
    losses it saw, round by round."""

    def __init__(self, config: LossWeightedConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.seen: list[dict[int, float]] = []

    def client_needs(self) -> ClientNeeds:
        return ClientNeeds(reply_metrics=(TRAIN_LOSS,))

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        mean, seen = WeightedMean(), {}
        for update in updates:
            loss = update.metrics[TRAIN_LOSS]
            seen[update.client_id] = loss
            mean.add(update.vector, update.weight * math.exp(-loss))
        self.seen.append(seen)
        return mean.mean()


def loss_registry() -> Registry:
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register("aggregators", "test", "loss_weighted", LossWeightedConfig, LossWeighted)
    return registry


# ------------------------------------------------------------------ train_locally


def tiny_client() -> tuple[nn.Module, Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    inputs = torch.randn(5, 3)
    labels = torch.tensor([0, 1, 1, 0, 1])
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return model, inputs, labels, start


def local_training(reply_metrics: tuple[str, ...] = ()) -> Any:
    registry = collect_registry(new_plugin_manager(autoload=False))
    train = validate_section(
        "train", {"optimizer": {"name": "sgd", "lr": 0.3, "momentum": 0.5}}, registry
    )
    algorithm = ClientAlgorithm(
        sampler=registry.build("samplers", train.sampler),
        loss_transform=registry.build("loss_transforms", train.loss_transform),
        aggregator=registry.build("aggregators", train.aggregator, 1),
    )
    model, inputs, labels, start = tiny_client()
    schedule = LocalSchedule(local_epochs=2, batch_size=2, optimizer=train.optimizer)
    result = train_locally(
        model,
        start,
        inputs,
        labels,
        np.bincount(labels.numpy(), minlength=2),
        algorithm=algorithm,
        loss_context={},
        payload={},
        client_state={},
        schedule=schedule,
        round_index=0,
        rng=local_rng(0, 0, 3),
        reply_metrics=reply_metrics,
    )
    return result, algorithm


def test_train_locally_reports_the_mean_of_its_batch_losses_by_hand():
    # Prepare: the same two epochs by hand: torch's SGD, the sampler's orders, batches of
    # 2 (2 + 2 + 1 samples per epoch), each batch's loss taken before its step.
    result, algorithm = local_training((TRAIN_LOSS,))
    model, inputs, labels, _ = tiny_client()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
    rng = local_rng(0, 0, 3)
    losses = []
    for _ in range(2):
        order = algorithm.sampler.epoch_indices(labels.numpy(), np.array([2, 3]), 0, rng)
        for batch in np.array_split(order, [2, 4]):
            loss = F.cross_entropy(model(inputs[batch]), labels[batch])
            losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    # Execute / Assert: six steps; the mean of their six losses.
    assert result.num_steps == len(losses) == 6
    assert result.metrics == {TRAIN_LOSS: pytest.approx(sum(losses) / 6, abs=1e-6)}


def test_nothing_is_computed_unless_asked_and_training_is_the_same():
    asked, _ = local_training((TRAIN_LOSS,))
    plain, _ = local_training()
    assert plain.metrics == {}
    assert torch.equal(asked.vector, plain.vector)


def test_a_metric_fedplug_does_not_compute_is_refused():
    with pytest.raises(ConfigError, match=r"\['grad_norm'\].*it reports: train_loss"):
        local_training(("grad_norm",))
    assert set(REPLY_METRICS) == {TRAIN_LOSS}


def test_needs_combine_and_describe_the_metric():
    needs = ClientNeeds(reply_metrics=(TRAIN_LOSS,)) | ClientNeeds(reply_metrics=(TRAIN_LOSS,))
    assert needs.reply_metrics == (TRAIN_LOSS,)
    assert needs.describe() == [
        "'train_loss' (the mean training loss of the round's local steps) in every reply's metrics"
    ]
    assert ClientNeeds().describe() == []


# ------------------------------------------------------------------ engines

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
    "aggregator": {"name": "loss_weighted"},
    "client_fraction": 1.0,
    "rounds": 2,
    "local_epochs": 2,
    "batch_size": 7,
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    "seed": 0,
}


class Recorder:
    """Wraps an engine and keeps every outcome it yields."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = engine.name
        self.outcomes: list[ClientUpdate | ClientFailure] = []

    def run_round(self, *args: Any) -> Iterator[ClientUpdate | ClientFailure]:
        for outcome in self.engine.run_round(*args):
            self.outcomes.append(outcome)
            yield outcome

    def derived_params(self) -> dict[str, Any]:
        return self.engine.derived_params()

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="module")
def registry() -> Registry:
    return loss_registry()


@pytest.fixture(scope="module")
def federation(registry: Registry) -> Any:
    return build_federation(validate_section("data", DATA, registry), registry)


def losses_of(registry: Registry, federation: Any, engine: str, **train: Any) -> dict:
    """``{(round, chain): train_loss}`` of every update an engine yields."""
    from fedplug.simulation.parallel import ParallelEngine

    config = validate_section("train", {**TRAIN, **train}, registry)
    simulator = Simulator(config, federation, registry)
    engines = {
        "sequential": SequentialEngine,
        "vectorized": VectorizedEngine,
        "parallel": lambda model: ParallelEngine(model, workers=2),
    }
    recorder = Recorder(engines[engine](simulator.model))
    simulator.engine = recorder
    simulator.run(resume=False)
    per_round = len(recorder.outcomes) // config.rounds
    losses = {}
    for index, update in enumerate(recorder.outcomes):
        assert isinstance(update, ClientUpdate), update
        losses[(index // per_round, tuple(update.chain))] = update.metrics[TRAIN_LOSS]
    assert simulator.algorithm.aggregator.seen[0]  # the aggregator read them
    return losses


@pytest.mark.parametrize(
    "train",
    [
        {},
        {
            "grouper": {
                "name": "fedgsp",
                "mode": "naive",
                "fixed_groups": 4,
                "group_fraction": 1.0,
            },
            "local_epochs": 1,
            "loss_transform": {"name": "fedprox", "mu": 0.5},
        },
    ],
    ids=["unequal-clients-momentum", "fedgsp-chains-fedprox"],
)
def test_sequential_vectorized_and_parallel_report_the_same_losses(registry, federation, train):
    # Execute
    sequential = losses_of(registry, federation, "sequential", **train)
    vectorized = losses_of(registry, federation, "vectorized", **train)
    parallel = losses_of(registry, federation, "parallel", **train)
    # Assert: every client's own mean (they differ), the parallel engine's bit for bit.
    assert len(set(sequential.values())) == len(sequential)
    assert all(0 < loss < 10 for loss in sequential.values())
    assert parallel == sequential
    assert sorted(vectorized) == sorted(sequential)
    for key, loss in sequential.items():
        assert vectorized[key] == pytest.approx(loss, abs=ATOL), key


def test_a_chain_reports_its_last_members_loss(registry, federation, monkeypatch):
    # Prepare: record what every member's local training reported.
    from fedplug.simulation import sequential

    reported: list[float] = []
    original = sequential.train_locally

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        reported.append(result.metrics[TRAIN_LOSS])
        return result

    monkeypatch.setattr(sequential, "train_locally", recording)
    grouper = {"name": "fedgsp", "mode": "naive", "fixed_groups": 3, "group_fraction": 1.0}
    # Execute
    chains = losses_of(registry, federation, "sequential", grouper=grouper, rounds=1)
    # Assert: members train chain by chain, in plan order; each chain's loss is its last's.
    assert any(len(chain) > 1 for _, chain in chains)
    lasts = np.cumsum([len(chain) for _, chain in chains]) - 1
    assert list(chains.values()) == [reported[i] for i in lasts]


def test_the_default_run_computes_no_metric(federation):
    registry = collect_registry(new_plugin_manager(autoload=False))
    config = validate_section("train", {**TRAIN, "aggregator": {"name": "fedavg"}}, registry)
    simulator = Simulator(config, federation, registry)
    assert simulator.reply_metrics == ()
    recorder = Recorder(SequentialEngine(simulator.model))
    simulator.engine = recorder
    simulator.run(resume=False)
    assert all(update.metrics == {} for update in recorder.outcomes)


# ------------------------------------------------------------------ screening


def test_a_missing_or_non_finite_required_metric_makes_an_update_unusable():
    plan = RoundPlan([[0]])

    def update(**metrics: float) -> ClientUpdate:
        return chain_update(
            [0],
            torch.zeros(3),
            samples=4,
            steps=1,
            extras={},
            plan=plan,
            seconds=0.0,
            metrics=metrics,
        )

    required = (TRAIN_LOSS,)
    assert unusable(update(train_loss=0.7), (3,), None, required) is None
    assert unusable(update(), (3,), None) is None  # nobody asks: nothing required
    assert unusable(update(), (3,), None, required) == "reported no 'train_loss' in its metrics"
    for bad in (math.nan, math.inf):
        reason = unusable(update(train_loss=bad), (3,), None, required)
        assert reason is not None and reason.startswith(f"reported train_loss = {bad} (not finite")


# ------------------------------------------------------------------ QFedAvg


def q_fedavg(
    global_vector: np.ndarray, locals_: list[np.ndarray], losses: list[float], q: float, lr: float
) -> np.ndarray:
    """Li et al. 2020, Algorithm 2 as Flower writes it: L = 1/lr, Delta w_k = L (w - w_k),
    Delta_k = F_k^q Delta w_k, h_k = q F_k^(q-1) ||Delta w_k||^2 + L F_k^q,
    w' = w - sum Delta_k / sum h_k (Flower adds 1e-10 to every loss)."""
    lipschitz = 1.0 / lr
    deltas, hs = [], []
    for local, loss in zip(locals_, losses):
        loss = loss + 1e-10
        step = lipschitz * (global_vector - local)
        deltas.append(loss**q * step)
        hs.append(q * loss ** (q - 1) * float(np.sum(step**2)) + lipschitz * loss**q)
    return global_vector - np.sum(deltas, axis=0) / np.sum(hs)


def qfedavg(**config: Any) -> Any:
    pytest.importorskip("flwr")
    from fedplug.algorithms.flower_strategies import FlowerStrategyAggregator, FlowerStrategyConfig

    return FlowerStrategyAggregator(FlowerStrategyConfig(strategy="QFedAvg", **config), 8)


@pytest.mark.parametrize("q", [0.0, 0.5, 2.0])
def test_qfedavg_is_q_fedavg_computed_independently(q):
    # Prepare: three clients around w = (1, -1, 0.5), unequal losses and weights (which
    # q-FedAvg ignores).
    current = np.array([1.0, -1.0, 0.5])
    changes = ([0.1, 0.2, -0.1], [-0.3, 0.0, 0.2], [0.05, -0.4, 0.3])
    locals_ = [current + np.array(change) for change in changes]
    losses = [0.4, 1.3, 2.2]
    updates = [
        ClientUpdate(k, torch.tensor(v, dtype=torch.float32), w, 1, metrics={TRAIN_LOSS: f})
        for k, (v, f, w) in enumerate(zip(locals_, losses, [10.0, 3.0, 7.0]))
    ]
    expected = q_fedavg(current, locals_, losses, q=q, lr=0.2)
    # Execute
    aggregator = qfedavg(q=q, client_learning_rate=0.2)
    result = aggregator.aggregate(torch.tensor(current, dtype=torch.float32), updates)
    # Assert
    np.testing.assert_allclose(result.numpy(), expected, rtol=0, atol=1e-6)
    assert aggregator.client_needs().reply_metrics == (TRAIN_LOSS,)


def test_qfedavg_with_zero_q_moves_along_the_plain_mean():
    # q = 0: w' = w - (1/K) sum (w - w_k) ... = the unweighted mean of the client models.
    current = np.zeros(2)
    locals_ = [np.array([1.0, 2.0]), np.array([3.0, -2.0])]
    updates = [
        ClientUpdate(
            k, torch.tensor(v, dtype=torch.float32), 5.0 * (k + 1), 1, metrics={TRAIN_LOSS: 1.0 + k}
        )
        for k, v in enumerate(locals_)
    ]
    result = qfedavg(q=0.0, client_learning_rate=0.5).aggregate(torch.zeros(2), updates)
    np.testing.assert_allclose(result.numpy(), [2.0, 0.0], atol=1e-6)


def test_qfedavg_needs_the_loss_and_the_learning_rate(small_experiment):
    with pytest.raises(ValueError, match=r"client 0's update carries no \['train_loss'\]"):
        qfedavg(client_learning_rate=0.1).aggregate(
            torch.zeros(2), [ClientUpdate(0, torch.ones(2), 1.0, 1)]
        )
    with pytest.raises(ConfigError, match="QFedAvg needs client_learning_rate"):
        qfedavg()
    small_experiment["train"]["aggregator"] = {"name": "flower", "strategy": "QFedAvg", "q": 0.2}
    with pytest.raises(ConfigError, match=r"set it to the clients' train.optimizer.lr \(0.5\)"):
        validate_experiment(small_experiment)


def qfedavg_experiment(**train: Any) -> dict[str, Any]:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["train"].update(
        client_fraction=1.0,
        aggregator={"name": "flower", "strategy": "QFedAvg", "q": 0.5, "client_learning_rate": 0.5},
        **train,
    )
    return data


def test_fedplug_run_with_qfedavg(tmp_path):
    pytest.importorskip("flwr")
    from fedplug.cli import main

    path = tmp_path / "qfedavg.yaml"
    path.write_text(yaml.safe_dump(qfedavg_experiment(sampler={"name": "iwds"})))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    history = metrics["history"]
    assert [record["failures"] for record in history] == [0, 0, 0]
    assert history[-1]["loss"] < history[0]["loss"]


def test_qfedavg_on_flowers_grid_gives_the_simulators_records():
    pytest.importorskip("flwr")
    from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid
    from fedplug.adapters.flower.requirements import Component, client_requirements

    from fedplug.experiment import run_experiment

    config = validate_experiment(qfedavg_experiment())
    simulated, simulator = run_experiment(config, None)
    grid = LoopbackGrid(make_client_app(), config.data.num_clients)
    flower, strategy = run_on_grid(grid, config, federated_evaluation=False)
    assert len(flower.history) == len(simulated.history) == 3
    for ours, theirs in zip(flower.history, simulated.history):
        assert ours.accuracy == pytest.approx(theirs.accuracy, abs=ATOL)
        assert ours.loss == pytest.approx(theirs.loss, abs=ATOL)
        assert ours.failures == theirs.failures == 0
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=ATOL)
    line = client_requirements([Component("aggregator", "flower", simulator.algorithm.aggregator)])
    assert line is not None and "'train_loss'" in line and "Flower's quickstart" in line


def test_fedplug_loss_reports_the_mean_loss_when_the_server_asks():
    pytest.importorskip("flwr")
    from fedplug.adapters.flower import FedplugLoss
    from fedplug.adapters.flower.loopback import ensure_task_identity
    from fedplug.adapters.flower.records import CONFIG_KEY, ROUND, model_record
    from fedplug.adapters.flower.records import REPLY_METRICS as ASK
    from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

    ensure_task_identity()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    inputs, labels = torch.randn(6, 3), torch.tensor([0, 1, 0, 1, 1, 0])

    def one_round(config: dict[str, Any]) -> tuple[RecordDict, list[float]]:
        message = Message(
            RecordDict({"arrays": model_record(model), CONFIG_KEY: ConfigRecord(config)}),
            dst_node_id=1,
            message_type=MessageType.TRAIN,
        )
        context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        criterion = FedplugLoss().begin_round(message, context, model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for batch in (slice(0, 4), slice(4, 6)):
            loss = criterion(model(inputs[batch]), labels[batch])
            losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        content = RecordDict(
            {"arrays": model_record(model), "metrics": MetricRecord({"num-examples": 6})}
        )
        criterion.finish_round(content, optimizer)
        return content, losses

    asked, losses = one_round({ROUND: 1, ASK: [TRAIN_LOSS]})
    assert asked["metrics"][TRAIN_LOSS] == pytest.approx(sum(losses) / 2, abs=1e-7)
    not_asked, _ = one_round({ROUND: 2})
    assert TRAIN_LOSS not in not_asked["metrics"]


# ------------------------------------------------------------------ FedML


def test_fedml_workers_carry_the_loss_to_the_server(small_experiment):
    pytest.importorskip("fedml", reason="FedML lives in .venv-fedml: run `make test-fedml`")
    from types import SimpleNamespace

    from fedplug.adapters.fedml.coordinator import Coordinator
    from fedplug.adapters.fedml.fedml_components import (
        FedplugClientTrainer,
        FedplugServerAggregator,
    )
    from fedplug.adapters.fedml.protocol import plan_rounds
    from fedplug.adapters.fedml.runtime import fedml_dataset
    from fedplug.adapters.fedml.worker import Worker

    from fedplug.run.model import build_model

    registry = loss_registry()
    small_experiment["train"].update(client_fraction=1.0, aggregator={"name": "loss_weighted"})
    config = validate_experiment(small_experiment, registry)
    federation = build_federation(config.data, registry)
    simulator = Simulator(config.train, federation, registry)
    simulator.run(resume=False)
    workers = 2
    schedule = plan_rounds(config.train, registry, federation.class_counts)
    coordinator = Coordinator(config.train, federation, registry, schedule, workers)
    server = FedplugServerAggregator(coordinator.model, SimpleNamespace(), coordinator)
    trainers = []
    for slot in range(workers):
        model = build_model(config.train, registry, federation, federation.device)
        worker = Worker(config.train, federation, registry, model, slot, workers)
        trainers.append(FedplugClientTrainer(model, SimpleNamespace(), worker))
    owned = fedml_dataset(federation, workers, eval_batch_size=100)[5]
    message = server.get_model_params()
    for step in range(schedule.fedml_rounds):
        replies = []
        for slot, trainer in enumerate(trainers):
            trainer.set_model_params(message[slot])
            trainer.train(owned[slot], "cpu", SimpleNamespace(round_idx=step))
            replies.append((0.0, trainer.get_model_params()))
        message = server.aggregate(replies)
        server.set_model_params(message)
    assert coordinator.finished
    seen = coordinator.core.aggregator.seen
    assert seen == simulator.algorithm.aggregator.seen
    assert len(seen) == 3 and all(len(losses) == 6 for losses in seen)
    assert torch.equal(coordinator.global_vector, simulator.final_vector)
