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
from fedplug.simulation.results import RunResult
from fedplug.simulation.simulator import Simulator, build_model

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
