"""Conformance of the FedML adapter: the simulator and FedML's path give the same rounds.

Run by ``make test-fedml`` in ``.venv-fedml``; skipped in the main environment (no
FedML). FedML's paths are called in process in the order FedML's cross-silo managers call
them (the real ``mpirun`` runs are in tests/test_fedml.py):

- the adapter's own run: its server (``Coordinator`` inside FedML's ``ServerAggregator``)
  and workers (``Worker`` inside FedML's ``ClientTrainer``);
- the drop-in: ``FedplugAggregator`` next to a FedML user's own ``ClientTrainer`` whose
  replies are FedML's plain ``(sample count, state dict)`` (here each silo trains as the
  simulator trains that client).

Covered, each on a tiny synthetic federation (6 clients, 3 sampled, 2 rounds; FedGSP
sees all six, in chains of 6 and then 3):

- every combination of the built-in aggregators x loss transforms x samplers x groupers
  that the config accepts and :func:`~fedplug.adapters.fedml.runtime.check_supported`
  lets through, and the loss transforms composed in one slot (:data:`COMPOSED_LOSSES`:
  FedShift + FedProx, FedDisk + FedProx) with the other slots at their defaults;
- the test-only plugins of ``tests/conformance_plugins.py`` (a stateful aggregator with
  a payload and a reply extra, a loss transform with a two-step setup phase, a grouper
  with its own round metrics), together;
- faults injected into one client's local training on both paths: a NaN model, a model
  of the wrong shape, and every client failing (the simulator retries then stops,
  FedML stops at once, saying it cannot replay a round);
- the drop-in: every combination above that a plain ClientTrainer can serve, and
  ``train.faults.dropout`` (rounds that nobody is left to train included), on a
  federation without local test splits (a FedML server evaluates on central test data
  only).

"The same" means: the same final model (within 1e-5; in one process it is bit for bit),
and the whole result summary (``metrics.json``) but the wall times: round records with
accuracy and loss within 1e-5 and every other field (failures, participants, bytes, cost
model, the components' metrics) equal, the same setup phase cost and setup report, and
the same derived params apart from each runtime's own entries. The adapter's own run
also measures its setup's wall time, as the simulator does.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("fedml", reason="FedML lives in .venv-fedml: run `make test-fedml`")

from conformance_checks import METRIC_TOLERANCE, assert_same_summary
from conformance_plugins import AGGREGATOR, GROUPER, LOSS_TRANSFORM, conformance_registry
from fedml.core import ClientTrainer
from fedplug.adapters.fedml import drop_in
from fedplug.adapters.fedml import worker as worker_module
from fedplug.adapters.fedml.coordinator import ENGINE_NAME, Coordinator
from fedplug.adapters.fedml.drop_in import FedplugAggregator, unmet_needs
from fedplug.adapters.fedml.fedml_components import FedplugClientTrainer, FedplugServerAggregator
from fedplug.adapters.fedml.protocol import Schedule, Task, WorkerInstructions, plan_rounds
from fedplug.adapters.fedml.runtime import check_supported, fedml_dataset
from fedplug.adapters.fedml.worker import Worker

from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.data.federation import Federation
from fedplug.errors import ConfigError, TrainingError
from fedplug.plugins import default_registry
from fedplug.run import local_training
from fedplug.run.federated_round import client_needs
from fedplug.run.model import build_model
from fedplug.run.results import RunResult
from fedplug.run.round_plan import participants
from fedplug.run.vectors import model_to_vector, vector_to_model
from fedplug.simulation import sequential
from fedplug.simulation.simulator import Simulator

REGISTRY = conformance_registry()
"""The built-in components and the test-only plugins."""

WORKERS = 2

BASE: dict[str, Any] = {
    "study": {"name": "conformance-fedml", "target_accuracy": 0.5},
    "data": {
        "dataset": {
            "name": "synthetic",
            "num_train": 360,
            "num_test": 120,
            "num_features": 8,
            "num_classes": 3,
        },
        "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10},
        "num_clients": 6,
        "local_test_fraction": 0.2,
        "seed": 0,
    },
    "train": {
        "model": {"name": "mlp", "hidden": [8]},
        "client_fraction": 0.5,
        "rounds": 2,
        "local_epochs": 1,
        "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.3},
        "seed": 0,
        "engine": "sequential",
    },
}

SETTINGS: dict[str, dict[str, Any]] = {
    "fedprox": {"mu": 0.1},
    "fedavgm": {"momentum": 0.9},
    # FedDisk's density models, small.
    "feddisk": {
        "made_hidden": 8,
        "made_max_epochs": 1,
        "global_rounds": 1,
        "classifier_hidden": 8,
        "classifier_epochs": 1,
    },
    "feddisk_ab": {"classifier_hidden": 8, "classifier_epochs": 1},
    # ICG groups; with every client sampled: one chain of 6 in round 1, chains of 3 in round 2.
    "fedgsp": {"mode": "fedgsp", "growth": "log", "alpha": 2.0, "beta": 1.0, "group_fraction": 1.0},
}
"""Settings that make a component do something worth comparing (FedGSP's chains) or keep
it fast (FedDisk); a key the component's config no longer has is left out, any other
component runs with its defaults."""

CLIENT_FRACTION = {"fedgsp": 1.0}
"""FedGSP samples groups itself, so it sees every client."""

COMPOSED_LOSSES: dict[str, list[Any]] = {
    "fedshift+fedprox": ["fedshift", {"name": "fedprox", **SETTINGS["fedprox"]}],
    "feddisk+fedprox": [{"name": "feddisk", **SETTINGS["feddisk"]}, {"name": "fedprox", **SETTINGS["fedprox"]}],
}
"""Loss transforms composed in the one slot (``loss_transform: [a, b]``, the ``composite``
loss transform), by row label; the bare name ``composite`` has no parts and no row."""

SLOTS = {
    "sampler": "samplers",
    "loss_transform": "loss_transforms",
    "aggregator": "aggregators",
    "grouper": "groupers",
}
SLOT_NAMES = list(SLOTS)

CENTRAL_TEST_ONLY = {"local_test_fraction": 0.0}
"""The drop-in's data: a FedML server evaluates on its own test data, so no client
accuracies."""
DROPOUT = {"faults": {"dropout": {"probability": 0.7}}, "rounds": 4}
"""A dropout that empties some of the 4 rounds (3 of 6 clients sampled) and not others."""


def component(kind: str, name: str) -> Any:
    if name in COMPOSED_LOSSES:
        return COMPOSED_LOSSES[name]
    fields = REGISTRY.get(kind, name).config_class.model_fields
    settings = {key: value for key, value in SETTINGS.get(name, {}).items() if key in fields}
    return {"name": name, **settings}


def experiment(
    data_changes: dict[str, Any] | None = None, train_changes: dict[str, Any] | None = None, **slots: str
) -> Any:
    """The base experiment with the named components (``sampler="iwds"``, ...), and
    ``data`` and ``train`` entries replaced by those of the changes (default none)."""
    data = copy.deepcopy(BASE)
    data["data"].update(data_changes or {})
    data["train"].update(train_changes or {})
    for slot, name in slots.items():
        data["train"][slot] = component(SLOTS[slot], name)
        if name in CLIENT_FRACTION:
            data["train"]["client_fraction"] = CLIENT_FRACTION[name]
    return validate_experiment(data, REGISTRY)


def supported_combinations() -> list[tuple[str, str, str, str]]:
    """Every built-in (sampler, loss transform, aggregator, grouper) FedML can run."""
    builtin = default_registry()
    combinations = []
    composed = [
        ("uniform", label, "fedavg", "none") for label in COMPOSED_LOSSES
    ]
    for names in [*itertools.product(*(builtin.names(kind) for kind in SLOTS.values())), *composed]:
        if "composite" in names:
            continue  # no parts: its rows are the composed ones
        try:
            config = experiment(**dict(zip(SLOTS, names)))
            check_supported(config)
        except ConfigError as error:
            refused = ("incompatible combination", "cannot run under FedML")
            if not any(reason in str(error) for reason in refused):
                raise
            continue
        combinations.append(names)
    return combinations


COMBINATIONS = supported_combinations()


def drop_in_combinations() -> list[tuple[str, str, str, str]]:
    """Those of :data:`COMBINATIONS` that ``FedplugAggregator`` runs next to a plain FedML
    ClientTrainer (given the class counts): no need beyond a model and a sample count."""
    accepted = []
    for names in COMBINATIONS:
        train = experiment(**dict(zip(SLOTS, names))).train
        needs = client_needs(
            REGISTRY.build("samplers", train.sampler),
            REGISTRY.build("loss_transforms", train.loss_transform),
            REGISTRY.build("aggregators", train.aggregator, BASE["data"]["num_clients"]),
            REGISTRY.build("groupers", train.grouper),
        )
        if not unmet_needs(needs, class_counts_given=True):
            accepted.append(names)
    return accepted


DROP_IN_COMBINATIONS = drop_in_combinations()


@pytest.fixture(scope="module")
def federation() -> Federation:
    """One federation for every run (neither path changes it)."""
    return build_federation(experiment().data, REGISTRY)


@pytest.fixture(scope="module")
def central_federation() -> Federation:
    """The federation of the drop-in's runs: the same, without local test splits."""
    return build_federation(experiment(CENTRAL_TEST_ONLY).data, REGISTRY)


# ---------------------------------------------------------------------------- the paths


def simulate(config: Any, federation: Federation) -> tuple[RunResult, Tensor]:
    simulator = Simulator(config.train, federation, REGISTRY)
    result = simulator.run()
    return result, simulator.final_vector


def run_on_fedml(config: Any, federation: Federation) -> tuple[RunResult, Tensor]:
    """The adapter's server and workers, called as FedML's cross-silo managers call them:
    ``get_model_params`` once, then each step ``set_model_params`` / ``train`` /
    ``get_model_params`` on every worker, ``aggregate`` and ``set_model_params`` on the
    server."""
    check_supported(config)
    schedule = plan_rounds(config.train, REGISTRY, federation.class_counts)
    coordinator = Coordinator(config.train, federation, REGISTRY, schedule, WORKERS)
    server = FedplugServerAggregator(coordinator.model, SimpleNamespace(), coordinator)
    trainers = [trainer_for(config, federation, slot) for slot in range(WORKERS)]
    owned = fedml_dataset(federation, WORKERS, eval_batch_size=100)[5]
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
    return coordinator.result, coordinator.global_vector


def trainer_for(config: Any, federation: Federation, slot: int) -> FedplugClientTrainer:
    model = build_model(config.train, REGISTRY, federation, federation.device)
    worker = Worker(config.train, federation, REGISTRY, model, slot, WORKERS)
    return FedplugClientTrainer(model, SimpleNamespace(), worker)


def run_drop_in(config: Any, federation: Federation) -> tuple[RunResult, Tensor]:
    """``FedplugAggregator`` next to one :class:`SiloTrainer` per client (silo ``k`` is
    client ``k``), called as FedML's cross-silo managers call them: the server's
    ``get_model_params`` once, then each FedML round every silo trains from what it was
    sent (one model for all, or a plain dict of one per silo) and replies
    ``(sample count, state dict)``, and the server aggregates and stores the result."""
    model = build_model(config.train, REGISTRY, federation, federation.device)
    batch = config.train.eval_batch_size
    aggregator = FedplugAggregator(
        model,
        SimpleNamespace(),
        config.train,
        num_clients=federation.num_clients,
        class_counts=federation.class_counts,
        test_data=[
            (federation.test_x[start : start + batch], federation.test_y[start : start + batch])
            for start in range(0, len(federation.test_y), batch)
        ],
        registry=REGISTRY,
    )
    schedule = Schedule(aggregator.plans)
    silos = [SiloTrainer(config, federation, silo) for silo in range(federation.num_clients)]
    message: Any = aggregator.get_model_params()
    for step in range(aggregator.comm_round):
        round_index, position = schedule.locate(step)
        replies = []
        for silo, trainer in enumerate(silos):
            trainer.set_model_params(message[silo] if type(message) is dict else message)
            trainer.train(None, "cpu", SimpleNamespace(round_idx=round_index, position=position))
            replies.append((trainer.samples, copy.deepcopy(trainer.get_model_params())))
        message = aggregator.aggregate(replies)
        aggregator.set_model_params(message)
    return aggregator.result, aggregator.vector


class SiloTrainer(ClientTrainer):
    """A FedML user's ClientTrainer, as far as the drop-in can tell (it replies FedML's
    default state dict and a sample count), that trains its silo as the simulator trains
    that client: through fedplug's :class:`Worker`, owning this one client."""

    def __init__(self, config: Any, federation: Federation, silo: int) -> None:
        model = build_model(config.train, REGISTRY, federation, federation.device)
        super().__init__(model, SimpleNamespace())
        self.silo = silo
        self.worker = Worker(config.train, federation, REGISTRY, model, silo, federation.num_clients)
        self.samples = 0

    def get_model_params(self) -> Any:
        return self.model.state_dict()

    def set_model_params(self, model_parameters: Any) -> None:
        self.model.load_state_dict(model_parameters)

    def train(self, train_data: Any, device: Any, args: Any) -> None:
        task = Task(self.silo, 0, model_to_vector(self.model).detach().clone())
        self.worker.receive(
            WorkerInstructions(0, args.round_idx, args.position, None, payload={}, tasks=[task])
        )
        (result,) = self.worker.train()["results"]
        vector_to_model(result.vector, self.model)
        self.samples = result.num_samples


def assert_conform(config: Any, federation: Federation) -> tuple[RunResult, RunResult]:
    """Run both paths and assert they agree; return ``(simulator's, FedML's)`` results."""
    reference, reference_vector = simulate(config, federation)
    result, vector = run_on_fedml(config, federation)
    assert torch.allclose(vector, reference_vector, rtol=0.0, atol=METRIC_TOLERANCE)
    assert len(result.history) == config.train.rounds
    assert_same_summary(result.summary(), reference.summary())
    # Both time their setup (the loss transform's preparation and phase), however short.
    assert result.setup_seconds > 0 and reference.setup_seconds > 0
    assert result.derived_params["engine"] == ENGINE_NAME
    return reference, result


# ------------------------------------------------------------------------ combinations


def test_every_built_in_slot_value_is_covered():
    # A component FedML refuses in every combination would vanish from the list silently.
    builtin = default_registry()
    for position, kind in enumerate(SLOTS.values()):
        covered = {"composite" if names[position] in COMPOSED_LOSSES else names[position] for names in COMBINATIONS}
        assert covered == set(builtin.names(kind)), kind


@pytest.mark.parametrize(
    ("sampler", "loss_transform", "aggregator", "grouper"),
    COMBINATIONS,
    ids=["-".join(names) for names in COMBINATIONS],
)
def test_fedml_conforms_to_the_simulator(federation, sampler, loss_transform, aggregator, grouper):
    # Prepare
    config = experiment(
        sampler=sampler, loss_transform=loss_transform, aggregator=aggregator, grouper=grouper
    )

    # Execute / Assert
    assert_conform(config, federation)


def test_test_only_plugins_conform(federation):
    # Prepare: the stateful aggregator, the loss transform with a setup phase and the
    # grouper with its own metrics, none of which fedplug knows by name.
    config = experiment(aggregator=AGGREGATOR, loss_transform=LOSS_TRANSFORM, grouper=GROUPER)

    # Execute
    reference, result = assert_conform(config, federation)

    # Assert: the setup phase ran (two steps, weighting all 6 clients) and the plugins'
    # own reports arrived.
    assert result.setup_rounds == 2
    assert result.setup_report["weighted_clients"] == 6
    assert "conformance_effective_lr" in result.derived_params
    assert {"chain_count", "largest_chain"} <= result.history[0].metrics.keys()
    assert result.history[0].metrics["largest_chain"] == 2


# ----------------------------------------------------------------------------- drop-in


def assert_drop_in_conforms(config: Any, federation: Federation) -> tuple[RunResult, RunResult]:
    """Run the simulator and the drop-in and assert they agree; return ``(simulator's,
    the drop-in's)`` results."""
    reference, reference_vector = simulate(config, federation)
    result, vector = run_drop_in(config, federation)
    assert torch.allclose(vector, reference_vector, rtol=0.0, atol=METRIC_TOLERANCE)
    assert len(result.history) == config.train.rounds
    assert_same_summary(result.summary(), reference.summary())
    assert result.derived_params["engine"] == drop_in.ENGINE_NAME
    return reference, result


def test_the_drop_in_covers_every_aggregator_a_plain_trainer_serves():
    # A combination that stops passing the drop-in's check would vanish silently.
    assert {names[SLOT_NAMES.index("aggregator")] for names in DROP_IN_COMBINATIONS} >= {
        "fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad",
    }
    assert {names[SLOT_NAMES.index("grouper")] for names in DROP_IN_COMBINATIONS} >= {"none", "fedgsp"}


@pytest.mark.parametrize(
    ("sampler", "loss_transform", "aggregator", "grouper"),
    DROP_IN_COMBINATIONS,
    ids=["-".join(names) for names in DROP_IN_COMBINATIONS],
)
def test_the_drop_in_conforms_to_the_simulator(central_federation, sampler, loss_transform, aggregator, grouper):
    # Prepare
    config = experiment(
        CENTRAL_TEST_ONLY,
        sampler=sampler,
        loss_transform=loss_transform,
        aggregator=aggregator,
        grouper=grouper,
    )

    # Execute / Assert
    assert_drop_in_conforms(config, central_federation)


def test_the_drop_in_conforms_under_dropout(central_federation):
    # Prepare: dropout that empties some rounds (the drop-in once crashed on those).
    config = experiment(CENTRAL_TEST_ONLY, DROPOUT)

    # Execute
    _, result = assert_drop_in_conforms(config, central_federation)

    # Assert: the row has rounds that nobody trained and rounds that somebody did, and
    # every sampled client either trained or dropped out.
    participants_per_round = [record.participants for record in result.history]
    assert 0 in participants_per_round and max(participants_per_round) > 0
    assert all(record.participants + record.faults_dropout == 3 for record in result.history)


# ------------------------------------------------------------------------------ faults


def corrupt_training(
    monkeypatch: pytest.MonkeyPatch,
    federation: Federation,
    clients: set[int],
    round_index: int,
    corrupt: Callable[[Tensor], Tensor],
) -> None:
    """Make ``clients``' local training in round ``round_index`` return ``corrupt(model)``,
    on both paths: the simulator's chains and the FedML workers call the same
    ``train_locally``, patched where each looks it up."""
    original = local_training.train_locally
    victims = {id(federation.clients[client].train_x) for client in clients}

    def train_locally(model: Any, start: Tensor, train_x: Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(model, start, train_x, *args, **kwargs)
        if kwargs["round_index"] == round_index and id(train_x) in victims:
            return dataclasses.replace(result, vector=corrupt(result.vector))
        return result

    monkeypatch.setattr(sequential, "train_locally", train_locally)
    monkeypatch.setattr(worker_module, "train_locally", train_locally)


def first_round_clients(config: Any, federation: Federation) -> list[int]:
    return participants(plan_rounds(config.train, REGISTRY, federation.class_counts).plans[0])


def nan_model(vector: Tensor) -> Tensor:
    return torch.full_like(vector, float("nan"))


def misshapen_model(vector: Tensor) -> Tensor:
    return vector[:-1].clone()


@pytest.mark.parametrize("corrupt", [nan_model, misshapen_model], ids=["nan", "misshapen"])
def test_a_corrupted_update_is_dropped_the_same_way(monkeypatch, federation, corrupt):
    # Prepare: one of round 1's three clients sends a NaN (or too short) model.
    config = experiment()
    victim = first_round_clients(config, federation)[1]
    corrupt_training(monkeypatch, federation, {victim}, 0, corrupt)

    # Execute
    reference, result = assert_conform(config, federation)

    # Assert: dropped and counted in round 1 on both paths, nothing dropped in round 2.
    assert [record.failures for record in result.history] == [1, 0]
    assert [record.failures for record in reference.history] == [1, 0]


def test_a_round_where_every_client_fails_stops_fedml_at_once(monkeypatch, federation):
    # Prepare: every client of round 1 sends a NaN model (also on the simulator's retry).
    config = experiment()
    corrupt_training(monkeypatch, federation, set(range(federation.num_clients)), 0, nan_model)

    # Execute / Assert: the simulator retries, then stops; FedML stops at once, saying why.
    with pytest.raises(TrainingError, match="3 of 3 client updates failed in each of 2 attempts"):
        simulate(config, federation)
    with pytest.raises(
        TrainingError, match="3 of 3 client updates failed and FedML cannot replay a round"
    ):
        run_on_fedml(config, federation)


def test_the_fault_injection_reaches_both_paths(monkeypatch, federation):
    # The fault tests above mean something only if the patched function is what both
    # paths call.
    original = local_training.train_locally
    counted = []

    def train_locally(*args: Any, **kwargs: Any) -> Any:
        counted.append(kwargs["round_index"])
        return original(*args, **kwargs)

    monkeypatch.setattr(sequential, "train_locally", train_locally)
    monkeypatch.setattr(worker_module, "train_locally", train_locally)
    config = experiment()

    simulate(config, federation)
    run_on_fedml(config, federation)

    # Assert: 3 clients in each of 2 rounds, on each path.
    assert counted == [0, 0, 0, 1, 1, 1] * 2
