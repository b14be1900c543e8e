"""The FedML adapter (``fedplug.adapters.fedml``), run from the FedML environment only.

``make test-fedml`` builds ``.venv-fedml`` and runs this file; in the main environment
(no FedML) the whole module is skipped.

Two independent paths are compared throughout: fedplug's built-in simulator, and the
adapter's server (``Coordinator`` inside FedML's ``ServerAggregator``) plus workers
(``Worker`` inside FedML's ``ClientTrainer``). In-process tests drive the two FedML
subclasses in the order FedML's cross-silo managers call them; the ``slow`` tests start
real FedML runs with ``mpirun`` (1 server + 2 worker ranks, loopback).
"""

from __future__ import annotations

import copy
import re
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

fedml = pytest.importorskip("fedml", reason="FedML lives in .venv-fedml: run `make test-fedml`")
pytest.importorskip("mpi4py", reason="FedML's MPI backend needs mpi4py: run `make test-fedml`")

from fedplug.adapters.fedml import guard
from fedplug.adapters.fedml.coordinator import Coordinator
from fedplug.adapters.fedml.fedml_components import FedplugClientTrainer, FedplugServerAggregator
from fedplug.adapters.fedml.launcher import run_fedml
from fedplug.adapters.fedml.protocol import Schedule, TaskResult, owner_of, plan_rounds, reply
from fedplug.adapters.fedml.runtime import check_supported, fedml_config, fedml_dataset
from fedplug.adapters.fedml.worker import Worker

from fedplug.components import RoundPlan, WeightedMean
from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.errors import ConfigError, TrainingError
from fedplug.plugins import default_registry
from fedplug.run.model import build_model
from fedplug.run.results import RunResult
from fedplug.simulation.simulator import Simulator

FEDGSP = {
    "name": "fedgsp",
    "mode": "fedgsp",
    "growth": "log",
    "alpha": 2.0,
    "beta": 1.0,
    "group_fraction": 1.0,
}

ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "iwds": {"sampler": {"name": "iwds"}},
    "fedshift": {"loss_transform": {"name": "fedshift"}},
    "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.9}},
    "scaffold": {"aggregator": {"name": "scaffold"}, "client_fraction": 1.0},
    "fedgsp": {"grouper": FEDGSP, "client_fraction": 1.0},
}

COMPARED_FIELDS = (
    "round",
    "accuracy",
    "loss",
    "client_accuracy_mean",
    "client_accuracy_std",
    "bytes_up",
    "bytes_down",
    "cumulative_bytes",
    "participants",
    "failures",
    "cpd_median",
    "cpd_mean",
)


def experiment(base: dict[str, Any], **train: Any) -> Any:
    data = copy.deepcopy(base)
    data["train"].update(train)
    return validate_experiment(data)


def simulate(config: Any) -> tuple[Simulator, RunResult]:
    registry = default_registry()
    simulator = Simulator(config.train, build_federation(config.data, registry), registry)
    return simulator, simulator.run()


def coordinator_for(config: Any, workers: int) -> Coordinator:
    registry = default_registry()
    federation = build_federation(config.data, registry)
    schedule = plan_rounds(config.train, registry, federation.class_counts)
    return Coordinator(config.train, federation, registry, schedule, workers)


def workers_for(config: Any, coordinator: Coordinator, workers: int) -> list[FedplugClientTrainer]:
    registry = default_registry()
    federation = coordinator.federation
    trainers = []
    for slot in range(workers):
        model = build_model(config.train, registry, federation, federation.device)
        worker = Worker(config.train, federation, registry, model, slot, workers)
        trainers.append(FedplugClientTrainer(model, SimpleNamespace(), worker))
    return trainers


def drive_in_process(config: Any, workers: int) -> Coordinator:
    """The adapter's server and workers wired by hand and called as FedML's cross-silo
    managers call them: ``get_model_params`` once, then each step ``set_model_params`` /
    ``train`` / ``get_model_params`` on every worker, ``aggregate`` and
    ``set_model_params`` on the server."""
    coordinator = coordinator_for(config, workers)
    server = FedplugServerAggregator(coordinator.model, SimpleNamespace(), coordinator)
    trainers = workers_for(config, coordinator, workers)
    owned = fedml_dataset(coordinator.federation, workers, eval_batch_size=100)[5]
    message = server.get_model_params()
    for step in range(coordinator.schedule.fedml_rounds):
        replies = []
        for slot, trainer in enumerate(trainers):
            trainer.set_model_params(message[slot])
            trainer.train(owned[slot], "cpu", SimpleNamespace(round_idx=step))
            replies.append((0.0, trainer.get_model_params()))
        message = server.aggregate(replies)
        server.set_model_params(message)
    return coordinator


def assert_same_history(ours: RunResult, reference: RunResult, tolerance: float = 0.0) -> None:
    assert len(ours.history) == len(reference.history)
    for mine, theirs in zip(ours.history, reference.history):
        mine_values, their_values = mine.as_dict(), theirs.as_dict()
        for key in COMPARED_FIELDS:
            assert mine_values[key] == pytest.approx(their_values[key], abs=tolerance), key


# ------------------------------------------------------------------ in-process protocol


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_server_and_workers_reproduce_the_simulator_bit_for_bit(small_experiment, algorithm):
    # Prepare: one config for both paths.
    config = experiment(small_experiment, rounds=2, local_epochs=2, **ALGORITHMS[algorithm])

    # Execute
    simulator, reference = simulate(config)
    coordinator = drive_in_process(config, workers=2)

    # Assert: the same float32 operations in the same order give the same bits.
    assert coordinator.finished
    assert torch.equal(coordinator.global_vector, simulator.final_vector)
    assert_same_history(coordinator.result, reference)


def test_fedgsp_chains_take_one_fedml_round_per_member(small_experiment):
    # Prepare: FedGSP's log growth with alpha 2 gives M = f(1) = 1 group of all 6 clients
    # in round 1 (a chain of 6) and M = floor(2 ln 2 + 1) = 2 groups of 3 in round 2.
    config = experiment(small_experiment, rounds=2, grouper=FEDGSP, client_fraction=1.0)

    # Execute
    registry = default_registry()
    schedule = plan_rounds(
        config.train, registry, build_federation(config.data, registry).class_counts
    )

    # Assert
    assert [len(chain) for chain in schedule.plans[0].chains] == [6]
    assert [len(chain) for chain in schedule.plans[1].chains] == [3, 3]
    assert schedule.steps_per_round == [6, 3]
    assert schedule.fedml_rounds == 9


def test_schedule_maps_fedml_rounds_to_round_and_chain_position():
    # Prepare: chains of lengths (3), (1, 1), (2, 1) -> 3 + 1 + 2 FedML rounds.
    schedule = Schedule([RoundPlan([[0, 1, 2]]), RoundPlan([[3], [4]]), RoundPlan([[5, 0], [1]])])

    # Execute
    located = [schedule.locate(step) for step in range(7)]

    # Assert
    assert schedule.fedml_rounds == 6
    assert located == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1), (3, 0)]


def test_each_worker_gets_only_the_clients_it_owns(small_experiment):
    # Prepare: 6 clients on 2 workers, all sampled.
    config = experiment(small_experiment, client_fraction=1.0)
    coordinator = coordinator_for(config, workers=2)

    # Execute
    message = coordinator.message

    # Assert: client k goes to worker k mod 2, with the global model, once.
    assert [task.client_id for task in message[0].tasks] == [0, 2, 4]
    assert [task.client_id for task in message[1].tasks] == [1, 3, 5]
    assert all(task.start_vector is None for slot in (0, 1) for task in message[slot].tasks)
    assert torch.equal(message[0].global_vector, coordinator.global_vector)
    assert [owner_of(k, 2) for k in range(6)] == [0, 1, 0, 1, 0, 1]


def test_a_worker_refuses_a_client_it_does_not_own(small_experiment):
    # Prepare: worker 1's instructions handed to worker 0.
    config = experiment(small_experiment, client_fraction=1.0)
    coordinator = coordinator_for(config, workers=2)
    trainer = workers_for(config, coordinator, workers=2)[0]
    trainer.set_model_params(coordinator.message[1])

    # Execute / Assert
    with pytest.raises(TrainingError, match="worker 0 received client 1, which worker 1 owns"):
        trainer.train([0, 2, 4], "cpu", SimpleNamespace(round_idx=0))


def test_fedml_data_that_is_not_the_workers_own_is_refused(small_experiment):
    config = experiment(small_experiment, client_fraction=1.0)
    coordinator = coordinator_for(config, workers=2)
    trainer = workers_for(config, coordinator, workers=2)[0]
    trainer.set_model_params(coordinator.message[0])

    with pytest.raises(TrainingError, match="handed it the data of clients \\[1, 3, 5\\]"):
        trainer.train([1, 3, 5], "cpu", SimpleNamespace(round_idx=0))


def test_a_reply_for_another_step_stops_the_run(small_experiment):
    config = experiment(small_experiment, client_fraction=1.0)
    coordinator = coordinator_for(config, workers=2)

    with pytest.raises(
        TrainingError, match="worker 0 replied for step 3 while the server is at step 0"
    ):
        coordinator.handle_replies([reply(3, []), reply(0, [])])


def test_a_missing_task_result_stops_the_run(small_experiment):
    config = experiment(small_experiment, client_fraction=1.0)
    coordinator = coordinator_for(config, workers=2)

    with pytest.raises(TrainingError, match="answered for tasks"):
        coordinator.handle_replies([reply(0, []), reply(0, [])])


def failing_replies(
    coordinator: Coordinator, trainers: list[FedplugClientTrainer], failing_client: int
) -> list[dict]:
    """Every worker's real reply to step 0, with ``failing_client``'s result replaced by
    an error."""
    replies = []
    for slot, trainer in enumerate(trainers):
        trainer.set_model_params(coordinator.message[slot])
        answer = trainer.worker.train(0)
        answer["results"] = [
            TaskResult(result.client_id, result.chain_index, error="RuntimeError: out of memory")
            if result.client_id == failing_client
            else result
            for result in answer["results"]
        ]
        replies.append(answer)
    return replies


def test_a_failed_client_is_dropped_and_the_rest_averaged(small_experiment):
    # Prepare: 6 clients, client 3 fails; 1 of 6 is under max_failed_fraction 0.5.
    config = experiment(small_experiment, rounds=1, client_fraction=1.0)
    coordinator = coordinator_for(config, workers=2)
    replies = failing_replies(coordinator, workers_for(config, coordinator, 2), failing_client=3)
    mean = WeightedMean()
    for answer in replies:
        for result in answer["results"]:
            if result.error is None:
                mean.add(result.vector, result.num_samples)

    # Execute
    coordinator.handle_replies(replies)

    # Assert: FedAvg of the five others, weighted by their samples; one failure counted.
    assert torch.equal(coordinator.global_vector, mean.mean())
    assert coordinator.result.history[0].failures == 1
    assert coordinator.result.history[0].participants == 6


def test_too_many_failures_stop_the_run_since_fedml_cannot_replay_a_round(small_experiment):
    # Prepare: 2 clients per round, one fails: 1/2 > max_failed_fraction 0.4.
    small_experiment["train"]["failures"] = {"max_failed_fraction": 0.4}
    config = experiment(small_experiment, rounds=1, client_fraction=1.0 / 3.0)
    coordinator = coordinator_for(config, workers=2)
    sampled = [task.client_id for slot in (0, 1) for task in coordinator.message[slot].tasks]
    replies = failing_replies(
        coordinator, workers_for(config, coordinator, 2), failing_client=sampled[0]
    )

    # Execute / Assert
    with pytest.raises(
        TrainingError, match="1 of 2 client updates failed.*cannot\\s+replay a round"
    ):
        coordinator.handle_replies(replies)


def test_a_round_where_every_client_fails_stops_the_run_since_fedml_cannot_replay(small_experiment):
    # Prepare: 2 sampled clients, both fail. The aggregator raises TrainingError on an
    # empty round (before the round core, only ValueError was caught and the run
    # crashed with the aggregator's message instead).
    config = experiment(small_experiment, rounds=1, client_fraction=1.0 / 3.0)
    coordinator = coordinator_for(config, workers=2)
    trainers = workers_for(config, coordinator, 2)
    replies = []
    for slot, trainer in enumerate(trainers):
        trainer.set_model_params(coordinator.message[slot])
        answer = trainer.worker.train(0)
        answer["results"] = [
            TaskResult(result.client_id, result.chain_index, error="RuntimeError: out of memory")
            for result in answer["results"]
        ]
        replies.append(answer)

    # Execute / Assert
    with pytest.raises(
        TrainingError, match="2 of 2 client updates failed and FedML cannot replay a round"
    ):
        coordinator.handle_replies(replies)


def test_effective_learning_rate_is_the_simulators(small_experiment):
    # Prepare: FedAvgM with momentum 0.9, client lr 0.5, server lr 1.0.
    config = experiment(small_experiment, aggregator={"name": "fedavgm", "momentum": 0.9})
    registry = default_registry()
    simulator = Simulator(config.train, build_federation(config.data, registry), registry)

    # Execute
    derived = coordinator_for(config, workers=2).result.derived_params

    # Assert: client lr x server lr / (1 - momentum) = 0.5 x 1.0 / 0.1, under the same key.
    expected = simulator.derived_params()["effective_learning_rate"]
    assert derived["effective_learning_rate"] == expected == pytest.approx(0.5 * 1.0 / (1 - 0.9))


def test_loss_transform_state_travels_with_the_first_step_only(small_experiment):
    # Prepare: FedShift's prior is computed on the server (prepare) and shipped.
    config = experiment(small_experiment, client_fraction=1.0, loss_transform={"name": "fedshift"})
    coordinator = coordinator_for(config, workers=2)
    first = coordinator.message
    trainers = workers_for(config, coordinator, 2)

    # Execute
    replies = []
    for slot, trainer in enumerate(trainers):
        trainer.set_model_params(first[slot])
        replies.append(trainer.worker.train(0))
    second = coordinator.handle_replies(replies)

    # Assert: the workers' prior is the server's; the second step does not resend it.
    server_prior = coordinator.loss_transform.state_dict()["prior"]
    for trainer in trainers:
        assert (
            trainer.worker.context.algorithm.loss_transform.state_dict()["prior"] == server_prior
        ).all()
    assert first[0].loss_transform_state is not None
    assert second[0].loss_transform_state is None


# ------------------------------------------------------------ FedML config and dataset


def test_fedml_config_makes_fedml_sampling_the_identity(small_experiment):
    config = experiment(small_experiment)

    fedml_yaml = fedml_config(config, workers=3)

    assert fedml_yaml["common_args"]["training_type"] == "cross_silo"
    assert fedml_yaml["comm_args"]["backend"] == "MPI"
    assert fedml_yaml["train_args"]["client_num_in_total"] == 3
    assert fedml_yaml["train_args"]["client_num_per_round"] == 3
    assert fedml_yaml["device_args"]["worker_num"] == 3
    assert fedml_yaml["common_args"]["using_mlops"] is False
    assert fedml_yaml["tracking_args"]["enable_wandb"] is False


def test_fedml_dataset_is_keyed_by_worker_with_owned_clients(small_experiment):
    # Prepare
    config = experiment(small_experiment)
    federation = build_federation(config.data, default_registry())
    sizes = [client.num_samples for client in federation.clients]

    # Execute
    train_num, test_num, _, test_loader, local_num, local_train, local_test, classes = (
        fedml_dataset(federation, 2, 50)
    )

    # Assert: worker 0 owns clients 0, 2, 4 and their samples.
    assert local_train == {0: [0, 2, 4], 1: [1, 3, 5]} == local_test
    assert local_num == {0: sizes[0] + sizes[2] + sizes[4], 1: sizes[1] + sizes[3] + sizes[5]}
    assert train_num == sum(sizes)
    assert test_num == 200 == sum(len(y) for _, y in test_loader)
    assert classes == 4


def test_vectorized_engine_is_refused(small_experiment):
    config = experiment(small_experiment, engine="vectorized")

    with pytest.raises(ConfigError, match="train.engine 'vectorized' cannot run under FedML"):
        check_supported(config)


# --------------------------------------------------------------------- loopback guard


def test_guard_allows_loopback_and_unix_sockets():
    loopback = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert guard.is_allowed("socket.connect", (loopback, ("127.0.0.1", 80)))
        assert guard.is_allowed("socket.connect", (loopback, ("127.8.9.10", 5000)))
        assert guard.is_allowed("socket.connect", (loopback, ("::1", 80, 0, 0)))
        assert guard.is_allowed("socket.connect", (local, "/tmp/some.sock"))
        assert guard.is_allowed("socket.getaddrinfo", ("localhost", 80, 0, 0, 0))
        assert guard.is_allowed("socket.getaddrinfo", (None, 80, 0, 0, 0))
    finally:
        loopback.close()
        local.close()


def test_guard_refuses_every_other_address_before_any_packet_leaves():
    # Prepare: an unconnected socket; the hook is called as Python's audit would call it
    # (the hook runs before the system call, so nothing is sent).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    before = len(guard.blocked())
    try:
        # Execute / Assert
        assert not guard.is_allowed("socket.connect", (sock, ("192.0.2.1", 80)))
        assert not guard.is_allowed("socket.sendto", (sock, ("198.51.100.7", 123)))
        assert not guard.is_allowed("socket.getaddrinfo", ("open.fedml.ai", 443, 0, 0, 0))
        with pytest.raises(ConnectionRefusedError, match="keeps traffic on loopback"):
            guard._hook("socket.connect", (sock, ("192.0.2.1", 80)))
    finally:
        sock.close()
    assert guard.blocked()[before:] == ["socket.connect ('192.0.2.1', 80)"]


def test_fedml_environment_points_fedml_and_open_mpi_at_loopback(tmp_path):
    environment = guard.fedml_environment(str(tmp_path), threads=1)

    assert environment["HOME"] == str(tmp_path)
    assert environment["FEDML_ENV_VERSION"] == "local"
    assert environment["FEDML_ENV_LOCAL_ON_PREMISE_PLATFORM_HOST"] == "127.0.0.1"
    assert environment["OMPI_MCA_btl_tcp_if_include"] == "lo"
    assert environment["OMPI_MCA_oob_tcp_if_include"] == "lo"


# ------------------------------------------------------------------ real FedML over MPI

MPI_ALGORITHMS = {
    "fedavg": {},
    "iwds+fedshift": {"sampler": {"name": "iwds"}, "loss_transform": {"name": "fedshift"}},
    "fedgsp": {"grouper": FEDGSP, "client_fraction": 1.0},
}

PARAMETER_TOLERANCE = 1e-5
"""Both paths run the same float32 operations in the same order (same local loop, same
generators, same plan-order aggregation in float64), so they agree bit for bit when the
math library picks the same kernels; they run in different processes (one thread each),
where a different kernel choice could round differently by a few float32 ulps (1.2e-7
relative) per operation. Over the ~50 SGD steps of these runs such differences stay far
below 1e-5 on parameters of size about 1; a real protocol error (a wrong client, order,
weight or generator) moves parameters by 1e-2 or more."""

METRIC_TOLERANCE = 1e-4
"""Accuracy moves in steps of 1/200 (200 test samples) and the loss by O(1e-2) when one
prediction changes; parameters within PARAMETER_TOLERANCE change no prediction here."""


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(MPI_ALGORITHMS))
def test_fedml_over_mpi_matches_the_simulator(small_experiment, tmp_path, algorithm):
    # Prepare: 6 clients, 2 rounds, 2 worker ranks + 1 server rank.
    config = experiment(small_experiment, rounds=2, local_epochs=2, **MPI_ALGORITHMS[algorithm])
    simulator, reference = simulate(config)

    # Execute: a real FedML cross-silo run over MPI on loopback.
    run = run_fedml(config, tmp_path / "run", workers=2, timeout=540)

    # Assert
    final_state = torch.load(tmp_path / "run" / "model.pt")
    reference_state = simulator.model.state_dict()
    assert final_state.keys() == reference_state.keys()
    for name, tensor in reference_state.items():
        assert torch.allclose(final_state[name], tensor, rtol=0.0, atol=PARAMETER_TOLERANCE), name
    assert_same_history(run.result, reference, tolerance=METRIC_TOLERANCE)
    assert (
        run.result.derived_params["fedml_rounds"]
        == plan_rounds(
            config.train, default_registry(), simulator.federation.class_counts
        ).fedml_rounds
    )
    assert run.blocked_network == {0: [], 1: [], 2: []}
    assert (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.slow
def test_a_rank_that_fails_ends_the_whole_job_with_its_error(small_experiment, tmp_path):
    # Prepare: CIFAR-10 in an empty folder with downloads off: every rank's data loading
    # fails after mpirun has started them.
    small_experiment["data"]["dataset"] = {"name": "cifar10", "download": False}
    small_experiment["data"]["root"] = str(tmp_path / "empty")
    config = validate_experiment(small_experiment)

    # Execute / Assert: the launcher reports the rank's DataError instead of hanging.
    with pytest.raises(TrainingError, match="rank \\d failed: DataError"):
        run_fedml(config, tmp_path / "run", workers=2, timeout=300)
    assert list(Path(tmp_path / "run").glob("error-rank*.json"))


# ---------------------------------------------------- drop-in: the user's ClientTrainer

from fedml.core import ClientTrainer  # noqa: E402
from fedplug.adapters.fedml.drop_in import FedplugAggregator, class_counts_of  # noqa: E402


class UserTrainer(ClientTrainer):
    """A FedML user's own ClientTrainer: their loop (plain SGD on cross-entropy), FedML's
    default reply (the state dict); nothing of fedplug."""

    def __init__(self, model: torch.nn.Module, args: Any) -> None:
        super().__init__(model, args)
        self.received: list[torch.Tensor] = []

    def get_model_params(self) -> Any:
        return self.model.cpu().state_dict()

    def set_model_params(self, model_parameters: Any) -> None:
        self.model.load_state_dict(model_parameters)
        self.received.append(torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]))

    def train(self, train_data: Any, device: Any, args: Any) -> None:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        for inputs, labels in train_data:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(self.model(inputs), labels).backward()
            optimizer.step()

    def test(self, test_data: Any, device: Any, args: Any) -> None:
        return None


def user_app(num_silos: int = 3) -> tuple[torch.nn.Module, dict[int, list[Any]]]:
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    data = {
        silo: [
            (torch.randn(5 + silo, 4, generator=generator), torch.randint(0, 3, (5 + silo,), generator=generator))
        ]
        for silo in range(num_silos)
    }
    return model, data


def drive_like_fedml_cross_silo(
    aggregator: FedplugAggregator, trainers: list[UserTrainer], data: dict[int, list[Any]]
) -> None:
    """What FedML's cross-silo server and clients do each round: send the model (one
    for all, or a plain dict per silo), train, collect (sample count, state dict),
    aggregate."""
    sent: Any = aggregator.get_model_params()
    for _ in range(aggregator.comm_round):
        replies = []
        for silo, trainer in enumerate(trainers):
            trainer.set_model_params(sent[silo] if type(sent) is dict else sent)
            trainer.train(data[silo], "cpu", None)
            samples = sum(len(labels) for _, labels in data[silo])
            replies.append((samples, copy.deepcopy(trainer.get_model_params())))
        sent = aggregator.aggregate(replies)
        aggregator.set_model_params(sent)


def test_fedplug_aggregator_averages_the_users_own_trainers_by_samples() -> None:
    # Prepare: the user's model and trainer, fedplug's FedAvg over all 3 silos, 1 round.
    model, data = user_app()
    trainers = [UserTrainer(copy.deepcopy(model), None) for _ in range(3)]
    aggregator = FedplugAggregator(
        copy.deepcopy(model),
        None,
        {"model": {"name": "mlp"}, "rounds": 1, "client_fraction": 1.0, "seed": 0},
        num_clients=3,
        test_data=data[0],
    )
    # Execute
    drive_like_fedml_cross_silo(aggregator, trainers, data)
    # Assert: (w0 * 5 + w1 * 6 + w2 * 7) / 18, by hand.
    expected = {}
    for silo in range(3):
        local = copy.deepcopy(model)
        UserTrainer(local, None).train(data[silo], "cpu", None)
        for name, value in local.state_dict().items():
            expected[name] = expected.get(name, 0) + value * (5 + silo) / 18
    for name, value in aggregator.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
    assert aggregator.comm_round == 1
    assert [record.round for record in aggregator.result.history] == [1]
    assert 0 <= aggregator.test(None, "cpu", None)["accuracy"] <= 1


def test_fedplug_aggregator_runs_fedgsp_chains_over_the_users_trainers() -> None:
    # Prepare: FedGSP's random groups of 3 silos (a chain trains in sequence).
    model, data = user_app(4)
    trainers = [UserTrainer(copy.deepcopy(model), None) for _ in range(4)]
    train = {
        "model": {"name": "mlp"},
        "rounds": 2,
        "client_fraction": 1.0,
        "grouper": {**FEDGSP, "mode": "naive", "fixed_groups": 2},
        "seed": 0,
    }
    aggregator = FedplugAggregator(
        copy.deepcopy(model),
        None,
        train,
        num_clients=4,
        class_counts=class_counts_of(data, 3),
    )
    chains = [plan.chains for plan in aggregator.plans]
    # Execute
    drive_like_fedml_cross_silo(aggregator, trainers, data)
    # Assert: one FedML round per chain position; each next member started from the
    # model its predecessor returned (what the user's trainer received).
    assert aggregator.comm_round == sum(max(map(len, round_chains)) for round_chains in chains)
    assert any(len(chain) > 1 for round_chains in chains for chain in round_chains)
    assert [record.round for record in aggregator.result.history] == [1, 2]
    first_chain = next(chain for chain in chains[0] if len(chain) > 1)
    before, after = first_chain[0], first_chain[1]
    local = copy.deepcopy(model)
    UserTrainer(local, None).train(data[before], "cpu", None)
    handed = torch.cat([p.detach().reshape(-1) for p in local.parameters()])
    torch.testing.assert_close(trainers[after].received[1], handed, rtol=0, atol=1e-6)


def test_fedplug_aggregator_runs_rounds_that_everyone_dropped_out_of() -> None:
    # Regression: with train.faults.dropout 0.9 some rounds have no chain, and the
    # drop-in's comm_round raised "max() arg is an empty sequence".
    # Prepare
    model, data = user_app()
    trainers = [UserTrainer(copy.deepcopy(model), None) for _ in range(3)]
    train = {
        "model": {"name": "mlp"},
        "rounds": 6,
        "client_fraction": 1.0,
        "faults": {"dropout": {"probability": 0.9}},
        "seed": 0,
    }
    aggregator = FedplugAggregator(copy.deepcopy(model), None, train, num_clients=3)
    # Execute
    drive_like_fedml_cross_silo(aggregator, trainers, data)
    # Assert: one FedML round per fedplug round, the empty ones included; every sampled
    # client either trained or dropped out.
    history = aggregator.result.history
    assert aggregator.comm_round == 6
    assert [record.round for record in history] == [1, 2, 3, 4, 5, 6]
    assert any(record.participants == 0 for record in history)
    assert all(record.participants + record.faults_dropout == 3 for record in history)
    assert aggregator.result.derived_params["fedml_rounds"] == 6


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"sampler": {"name": "iwds"}}, "fedplug's client side"),
        ({"aggregator": {"name": "scaffold"}}, "delta_c"),
        ({"grouper": FEDGSP}, "class counts (pass class_counts=)"),
    ],
)
def test_fedplug_aggregator_names_what_a_plain_trainer_lacks(change: dict[str, Any], named: str) -> None:
    model, _ = user_app()
    with pytest.raises(ConfigError, match=re.escape(named)):
        FedplugAggregator(model, None, {"model": {"name": "mlp"}, **change}, num_clients=3)


# ----------------------------------------------------------------------------- tracking


@pytest.mark.slow
@pytest.mark.parametrize("store", ["server", "sqlite"])
def test_a_fedml_run_round_trips_through_mlflow(small_experiment, tmp_path, monkeypatch, store):
    """The launcher logs a FedML run as ``fedplug run`` does (params, tags, every round at
    its step, the model as an MLflow model), into a real ``mlflow server`` on 127.0.0.1 or
    the project's sqlite store."""
    pytest.importorskip("mlflow", reason="tracking needs mlflow in .venv-fedml (make fedml-venv)")
    import contextlib

    import mlflow
    import mlflow.pytorch
    from mlflow.tracking import MlflowClient
    from mlflow_server import QUIET_ENV, running_mlflow_server

    from fedplug.data.build import load_dataset
    from fedplug.tracking import local_tracking_uri

    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    # Prepare: a 2-round FedavgM run on 2 worker ranks, tracking on.
    small_experiment["study"]["name"] = "fedml-tracking"
    server_folder = tmp_path / "mlflow-server"
    server_folder.mkdir()
    serving = running_mlflow_server(server_folder) if store == "server" else contextlib.nullcontext()
    with serving as server:
        uri = server if store == "server" else local_tracking_uri(tmp_path)
        small_experiment["tracking"] = {"enabled": True, "uri": uri}
        config = experiment(
            small_experiment, rounds=2, aggregator={"name": "fedavgm", "momentum": 0.9}
        )
        # Execute
        run = run_fedml(config, tmp_path / "run", workers=2, timeout=540, project_root=tmp_path)
        # Assert: one finished run with the config, the tags, both rounds, the model.
        client = MlflowClient(uri)
        found = client.search_runs([client.get_experiment_by_name("fedml-tracking").experiment_id])
        assert [each.info.run_id for each in found] == [run.mlflow_run_id]
        tracked = found[0]
        assert tracked.info.status == "FINISHED"
        assert tracked.info.run_name.startswith("fedavgm-seed0-") and tracked.info.run_name.endswith("-synthetic")
        tags = tracked.data.tags
        assert (tags["fedplug.runtime"], tags["dataset"], tags["aggregator"]) == (
            "fedml",
            "synthetic",
            "fedavgm",
        )
        assert tracked.data.params["train.aggregator.momentum"] == "0.9"
        assert tracked.data.params["train.rounds"] == "2"
        for key in ("accuracy", "loss", "cumulative_bytes"):
            history = sorted(client.get_metric_history(run.mlflow_run_id, key), key=lambda m: m.step)
            assert [point.step for point in history] == [1, 2], key
            assert [point.value for point in history] == pytest.approx(
                [getattr(record, key) for record in run.result.history]
            ), key
        final = tracked.data.metrics["final_accuracy"]
        assert final == pytest.approx(run.result.final_accuracy)
        mlflow.set_tracking_uri(uri)
        model = mlflow.pytorch.load_model(run.model_uri, map_location="cpu")
        dataset = load_dataset(config.data, default_registry())
        with torch.no_grad():
            logits = model(torch.as_tensor(dataset.test_x, dtype=torch.float32))
        accuracy = float((logits.argmax(1) == torch.as_tensor(dataset.test_y)).float().mean())
        assert accuracy == pytest.approx(final, abs=1e-6)
