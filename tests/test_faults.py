"""Faults on demand (``train.faults``): validation, determinism, the hand-checked effect of
each fault, resume, and the same injection on the simulator and on Flower."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT

from fedplug.components import ClientUpdate, RoundPlan
from fedplug.config import validate_experiment, validate_section
from fedplug.cost_model import LinkAndDevice, chain_training_seconds
from fedplug.errors import ConfigError, DataError, TrainingError
from fedplug.experiment import run_experiment
from fedplug.faults import DROPOUT_STREAM, Faults, corruption_draws, read_trace
from fedplug.plugins import default_registry
from fedplug.run.components import Components
from fedplug.run.federated_round import Evaluation, RoundCore
from fedplug.run.results import RoundRecord
from fedplug.run.round_plan import clients_per_round, plan_round, sample_clients

FAULT_FIELDS = ("faults_dropout", "faults_stragglers", "faults_straggler_timeouts", "faults_corrupted")


def experiment(**train: Any) -> dict[str, Any]:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["train"].update(train)
    return data


def train_config(**train: Any) -> Any:
    return validate_experiment(experiment(**train)).train


def write_trace(path: Path, rows: list[str]) -> Path:
    path.write_text("round,clients\n" + "".join(row + "\n" for row in rows))
    return path


def faults_of(record: RoundRecord) -> tuple[Any, ...]:
    return tuple(getattr(record, key) for key in FAULT_FIELDS) + (record.dropped,)


# ------------------------------------------------------------------------ validation


def test_no_faults_section_means_no_faults() -> None:
    faults = train_config().faults
    assert faults.dropout.probability == 0 and faults.dropout.trace is None
    assert faults.stragglers.fraction == 0 and not faults.stragglers.factors
    assert faults.corruption.probability == 0


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ({"dropout": {"probability": 1.0}}, "train.faults.dropout.probability: Input should be less than 1"),
        ({"dropout": {"probabilty": 0.1}}, "train.faults.dropout.probabilty: unknown key"),
        ({"stragglers": {"fraction": 0.2, "factor": 0.5}}, "train.faults.stragglers.factor: Input should be greater than or equal to 1"),
        ({"stragglers": {"factors": {1: 0.5}}}, "Input should be greater than or equal to 1"),
        ({"stragglers": {"fraction": 0.2, "factor": 3, "factors": {1: 2}}}, "train.faults.stragglers: give either fraction and factor, or factors"),
        ({"stragglers": {"deadline_seconds": 0}}, "train.faults.stragglers.deadline_seconds: Input should be greater than 0"),
        ({"corruption": {"kind": "scale"}}, "train.faults.corruption: kind 'scale' needs factor"),
        ({"corruption": {"kind": "nan", "factor": 2}}, "factor applies to kind 'scale' only"),
        ({"corruption": {"kind": "flip"}}, "train.faults.corruption.kind: Input should be 'nan', 'shape' or 'scale'"),
        ({"corruption": {"probability": 1.5}}, "train.faults.corruption.probability: Input should be less than or equal to 1"),
    ],
)
def test_bad_faults_are_refused_naming_the_path(faults: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as error:
        train_config(faults=faults)
    assert message in str(error.value)


def test_the_config_fingerprint_sees_the_faults(tmp_path: Path) -> None:
    # Prepare: a finished run without faults in tmp_path.
    run_experiment(validate_experiment(experiment(rounds=1)), tmp_path)
    # Execute / Assert: the same run with faults does not resume that checkpoint (the
    # folder's marker, which holds the config's fingerprint too, refuses it first).
    with pytest.raises((ConfigError, TrainingError), match="belongs to a different config"):
        run_experiment(validate_experiment(experiment(rounds=1, faults={"dropout": {"probability": 0.5}})), tmp_path)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["1,0 1", "2,0 9"], "{path} line 3: client 9 is out of range; the run has 6 clients (ids 0-5)"),
        (["1,0 1"], "{path}: no line for round 2 (the run has 2 rounds); add one line per round"),
        (["1,0 1", "1,2"], "{path} line 3: round 1 is listed twice"),
        (["1,0 x", "2,1"], "{path} line 2: expected a round number and space-separated client ids, got '1,0 x'"),
        (["1,0,1", "2,1"], "{path} line 2: expected 'round,clients' (2 fields), got 3"),
        (["0,1", "2,1"], "{path} line 2: round 0 is not a round (rounds start at 1)"),
    ],
)
def test_a_trace_that_does_not_fit_the_run_names_file_and_line(tmp_path: Path, rows: list[str], message: str) -> None:
    path = write_trace(tmp_path / "trace.csv", rows)
    with pytest.raises(DataError) as raised:
        read_trace(path, num_clients=6, rounds=2)
    assert str(raised.value) == message.format(path=path)


def test_a_trace_without_its_header_or_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bare.csv").write_text("1,0 1\n")
    with pytest.raises(DataError, match=r"bare.csv line 1: expected the header 'round,clients'"):
        read_trace(tmp_path / "bare.csv", 6, 1)
    with pytest.raises(ConfigError, match=r"train.faults.dropout.trace: file '.*absent.csv' does not exist"):
        read_trace(tmp_path / "absent.csv", 6, 1)


def test_a_straggler_the_run_does_not_have_is_refused_before_training() -> None:
    config = validate_experiment(experiment(faults={"stragglers": {"factors": {6: 2.0}}}))
    with pytest.raises(ConfigError, match=r"stragglers.factors: client 6 is out of range; the run has 6 clients"):
        run_experiment(config, None)


# ---------------------------------------------------------------------- determinism


def dropout_plans(seed: int, probability: float, rounds: int = 20) -> list[tuple[list[int], tuple[int, ...]]]:
    config = train_config(seed=seed, rounds=rounds, client_fraction=0.5, faults={"dropout": {"probability": probability}})
    registry = default_registry()
    grouper = registry.build("groupers", config.grouper)
    faults = Faults.for_run(config, 6)
    plans = [plan_round(config, grouper, 6, index, faults) for index in range(rounds)]
    return [([client for chain in plan.chains for client in chain], dropout.dropped) for plan, dropout in plans]


def test_dropout_is_a_function_of_the_seed_and_round() -> None:
    assert dropout_plans(0, 0.4) == dropout_plans(0, 0.4)
    assert dropout_plans(0, 0.4) != dropout_plans(1, 0.4)


def test_dropout_removes_exactly_the_sampled_clients_whose_draw_falls_below_p() -> None:
    # Prepare: the clients sampling picks without faults, and each client's dropout draw.
    probability = 0.4
    expected = []
    for index in range(20):
        sampled = sample_clients(6, clients_per_round(6, 0.5), 0, index).tolist()
        draws = np.random.default_rng([0, index, DROPOUT_STREAM]).random(6)
        expected.append(([k for k in sampled if draws[k] >= probability], tuple(k for k in sampled if draws[k] < probability)))
    # Execute
    plans = dropout_plans(0, probability)
    # Assert: dropout only removes, and some round lost clients (the test means something).
    assert plans == expected
    assert any(dropped for _, dropped in plans)


def test_probability_zero_injects_nothing() -> None:
    plans = dropout_plans(0, 0.0)
    assert all(dropped == () for _, dropped in plans)
    assert [taking_part for taking_part, _ in plans] == [sample_clients(6, clients_per_round(6, 0.5), 0, index).tolist() for index in range(20)]


def test_a_trace_is_respected_exactly_and_an_empty_round_keeps_the_model(tmp_path: Path, caplog: Any) -> None:
    # Prepare: round 1 offers clients 0, 2, 5; round 2 nobody; round 3 clients 1 and 4.
    trace = write_trace(tmp_path / "trace.csv", ["1,0 2 5", "2,", "3,1 4"])
    config = validate_experiment(experiment(client_fraction=0.5, faults={"dropout": {"trace": str(trace)}}))
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedplug.round"):
        result, _ = run_experiment(config, None)
    # Assert: 3 of 6 are sampled among those available (all of them in rounds 1 and 3).
    history = result.history
    assert [record.participants for record in history] == [3, 0, 2]
    assert [record.faults_dropout for record in history] == [3, 6, 4]
    assert history[0].dropped == [{"clients": [1, 3, 4], "reason": f"dropout: unavailable in round 1 of {trace}"}]
    assert history[2].dropped[0]["clients"] == [0, 2, 3, 5]
    assert history[1].accuracy == history[0].accuracy and history[1].loss == history[0].loss
    assert (history[1].bytes_up, history[1].failures) == (0, 0)
    assert "round 2: no client is left to train" in caplog.text


# ------------------------------------------------------------ the round core, by hand


def core_for(num_clients: int, sizes: list[int], link: LinkAndDevice | None = None, **train: Any) -> RoundCore:
    config = train_config(**train)
    registry = default_registry()
    return RoundCore(
        config,
        components=Components.build(config, registry, num_clients),
        num_clients=num_clients,
        class_counts=None,
        client_sizes=np.array(sizes),
        model_bytes=8,
        train_flops=1,
        link=link,
    )


def two_updates(plan_chains: list[list[int]], vectors: list[list[float]], sizes: list[int]) -> list[ClientUpdate]:
    return [
        ClientUpdate(client_id=chain[-1], vector=torch.tensor(vector), weight=float(sizes[chain[-1]]), num_steps=1, chain=chain)
        for chain, vector in zip(plan_chains, vectors)
    ]


CHAINS = [[0], [1]]
VECTORS = [[1.0, 2.0], [4.0, -1.0]]


def run_core(core: RoundCore, sizes: list[int]) -> Any:
    return core.run(0, torch.zeros(2), RoundPlan(chains=CHAINS), lambda attempt: two_updates(CHAINS, VECTORS, sizes))


def record_of(core: RoundCore, attempt: Any) -> RoundRecord:
    return core.record(0, RoundPlan(chains=CHAINS), attempt, Evaluation(), payload_bytes=0, bytes_so_far=0, started=0.0)


def seed_where_corrupted(pattern: list[bool], probability: float = 0.5) -> int:
    """A seed whose round-1 corruption draws of clients 0, 1 are ``pattern``."""
    return next(seed for seed in range(1000) if corruption_draws(probability, seed, 0, 2).tolist() == pattern)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("nan", "returned non-finite (NaN/Inf) parameters"), ("shape", "returned (1,) parameters, expected (2,)")],
)
def test_a_corrupted_update_is_dropped_by_the_screen_with_its_reason(kind: str, reason: str) -> None:
    # Prepare: client 0's update is corrupted, client 1's is not.
    seed = seed_where_corrupted([True, False])
    core = core_for(2, [1, 3], seed=seed, faults={"corruption": {"probability": 0.5, "kind": kind}})
    # Execute
    attempt = run_core(core, [1, 3])
    # Assert: FedAvg of client 1 alone.
    assert attempt.tally.dropped == [([0], reason)]
    assert (attempt.tally.failures, attempt.tally.corrupted) == (1, 1)
    assert attempt.vector.tolist() == [4.0, -1.0]


def test_a_scaled_update_passes_the_screen_and_moves_fedavg_by_the_hand_computed_amount() -> None:
    # Prepare: global 0; client 0 (1 sample) sends [1, 2], client 1 (3 samples) [4, -1];
    # only client 0's change is scaled, by 3.
    seed = seed_where_corrupted([True, False])
    core = core_for(2, [1, 3], seed=seed, faults={"corruption": {"probability": 0.5, "kind": "scale", "factor": 3.0}})
    # Execute
    attempt = run_core(core, [1, 3])
    # Assert: (1 * 3 * [1, 2] + 3 * [4, -1]) / 4 = [15/4, 3/4]; without it [13/4, -1/4].
    assert attempt.tally.failures == 0 and attempt.tally.corrupted == 1
    torch.testing.assert_close(attempt.vector, torch.tensor([15 / 4, 3 / 4]), rtol=0, atol=1e-6)


def test_straggler_factors_multiply_the_modelled_time_and_trip_the_timeout() -> None:
    # Prepare: 1000 FLOP/s, 1 FLOP per sample; client 0 has 100 samples and factor 10
    # (1.0 s), client 1 300 samples (0.3 s); the deadline is 0.5 s.
    link = LinkAndDevice(device_flops=1000.0, server_flops=1e30)
    sizes = [100, 300]
    faults = {"stragglers": {"factors": {0: 10.0}}}
    slow = core_for(2, sizes, link, faults=faults, failures={"client_timeout_seconds": 0.5})
    untimed = core_for(2, sizes, link, faults=faults)
    plain = core_for(2, sizes, link)
    # Execute
    attempt = run_core(slow, sizes)
    records = {name: record_of(core, run_core(core, sizes)) for name, core in (("untimed", untimed), ("plain", plain))}
    # Assert: a chain's time is its members' sum, each times its factor.
    assert chain_training_seconds([0, 1], np.array(sizes), 1, 1, link, slow.faults.speed_factors) == pytest.approx(1.3)
    assert slow.chain_seconds([0]) == pytest.approx(1.0) and slow.chain_seconds([1]) == pytest.approx(0.3)
    assert records["untimed"].compute_seconds_model == pytest.approx(1.0)
    assert records["plain"].compute_seconds_model == pytest.approx(0.3)
    assert records["untimed"].faults_stragglers == 1 and records["plain"].faults_stragglers == 0
    # ... and the 1.0 s straggler is dropped as a timeout; FedAvg keeps client 1 alone.
    assert attempt.tally.dropped == [([0], "straggler: modelled 1 s over train.failures.client_timeout_seconds=0.5")]
    assert attempt.tally.straggler_timeouts == 1 and attempt.vector.tolist() == [4.0, -1.0]
    record = record_of(slow, attempt)
    assert record.compute_seconds_model == pytest.approx(0.5)  # the server waits until the deadline
    assert (record.faults_straggler_timeouts, record.failures) == (1, 1)


def test_a_modelled_deadline_of_its_own_leaves_the_real_timeout_alone() -> None:
    link = LinkAndDevice(device_flops=1000.0, server_flops=1e30)
    core = core_for(2, [100, 300], link, faults={"stragglers": {"factors": {0: 10.0}, "deadline_seconds": 0.5}})
    attempt = run_core(core, [100, 300])
    assert attempt.tally.dropped == [([0], "straggler: modelled 1 s over train.faults.stragglers.deadline_seconds=0.5")]
    assert core.config.failures.client_timeout_seconds is None


def test_a_fraction_of_stragglers_is_drawn_once_per_run_from_the_seed() -> None:
    def factors(seed: int) -> list[float]:
        config = train_config(seed=seed, faults={"stragglers": {"fraction": 0.5, "factor": 4.0}})
        return Faults.for_run(config, 6).speed_factors.tolist()

    assert sorted(factors(0)) == [1.0, 1.0, 1.0, 4.0, 4.0, 4.0]
    assert factors(0) == factors(0)
    assert any(factors(seed) != factors(0) for seed in range(1, 5))


# ------------------------------------------------------------- reporting and resume

FAULTS = {
    "dropout": {"probability": 0.3},
    # Client 1 straggles; any modelled time of it is over the deadline.
    "stragglers": {"factors": {1: 50.0}, "deadline_seconds": 1e-7},
    "corruption": {"probability": 0.3, "kind": "nan"},
}


def faulty_config(**train: Any) -> Any:
    settings = {"rounds": 4, "client_fraction": 1.0, "faults": FAULTS, "failures": {"max_failed_fraction": 1.0}}
    return validate_experiment(experiment(**{**settings, **train}))


def test_each_round_reports_what_was_injected_and_dropped_and_why() -> None:
    result, _ = run_experiment(faulty_config(), None)
    history = result.history
    # Assert: every kind of fault happened somewhere, and each is explained.
    for key in FAULT_FIELDS:
        assert any(getattr(record, key) for record in history), key
    for record in history:
        reasons = [entry["reason"] for entry in record.dropped]
        assert sum(reason.startswith("straggler:") for reason in reasons) == record.faults_straggler_timeouts
        assert record.failures == sum(not reason.startswith("dropout:") for reason in reasons)
        dropped_out = [entry["clients"] for entry in record.dropped if entry["reason"].startswith("dropout:")]
        assert sum(map(len, dropped_out)) == record.faults_dropout
        assert record.participants + record.faults_dropout == 6
    # ... in metrics.json's form, which reads back the same.
    assert [RoundRecord.from_dict(record.as_dict()) for record in history] == history


def test_a_resumed_run_injects_the_same_faults(tmp_path: Path) -> None:
    # Prepare: an uninterrupted run, and one stopped after round 2 (its checkpoint kept).
    config = faulty_config()
    reference, reference_simulator = run_experiment(config, None)

    class Stopped(Exception):
        pass

    def stop_after_round_2(record: RoundRecord) -> None:
        if record.round == 2:
            raise Stopped

    with pytest.raises(Stopped):
        run_experiment(config, tmp_path, observers=[stop_after_round_2])
    # Execute: the same command again resumes from round 3.
    resumed, resumed_simulator = run_experiment(config, tmp_path)
    # Assert
    assert [faults_of(record) for record in resumed.history] == [faults_of(record) for record in reference.history]
    assert [record.accuracy for record in resumed.history] == [record.accuracy for record in reference.history]
    assert torch.equal(resumed_simulator.final_vector, reference_simulator.final_vector)


def test_the_fault_counts_are_mlflow_round_metrics() -> None:
    from fedplug.tracking import round_metrics

    result, _ = run_experiment(faulty_config(rounds=2), None)
    metrics = round_metrics(result.history[0])
    assert {key: metrics[key] for key in FAULT_FIELDS} == {key: float(getattr(result.history[0], key)) for key in FAULT_FIELDS}
    assert "dropped" not in metrics  # a list, kept to metrics.json


@pytest.mark.slow
def test_the_fault_counts_reach_an_mlflow_store(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from fedplug.tracking import open_tracker

    config = faulty_config(rounds=2)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = open_tracker(config, tmp_path / "run", run_name="faults", enabled=True, uri=uri, experiment_name="faults")
    with tracker:
        result, _ = run_experiment(config, tmp_path / "run", observers=[tracker.log_round])
        tracker.log_result(result)
    client = MlflowClient(uri)
    for key in FAULT_FIELDS:
        logged = sorted(client.get_metric_history(tracker.run_id, key), key=lambda metric: metric.step)
        assert [(metric.step, metric.value) for metric in logged] == [(r.round, float(getattr(r, key))) for r in result.history]


# ---------------------------------------------------------- the same on Flower


def test_flower_injects_the_same_faults_as_the_simulator(tmp_path: Path) -> None:
    from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid

    # Prepare: a trace (round 3: nobody), dropout, stragglers and corruption together.
    trace = write_trace(tmp_path / "trace.csv", ["1,0 1 2 3 5", "2,0 1 2 3 4 5", "3,", "4,1 2 3 4"])
    faults = {**FAULTS, "dropout": {"probability": 0.3, "trace": str(trace)}}
    config = faulty_config(faults=faults)
    # Execute
    simulated, simulator = run_experiment(config, None)
    flower, strategy = run_on_grid(LoopbackGrid(make_client_app(), 6), config, federated_evaluation=False)
    # Assert: the same faults, drops and reasons every round; the same model.
    assert [faults_of(record) for record in flower.history] == [faults_of(record) for record in simulated.history]
    for ours, theirs in zip(flower.history, simulated.history):
        assert (ours.participants, ours.failures) == (theirs.participants, theirs.failures)
        assert ours.compute_seconds_model == pytest.approx(theirs.compute_seconds_model, rel=1e-12)
        assert ours.accuracy == pytest.approx(theirs.accuracy, abs=1e-5)
    assert simulated.history[2].participants == 0
    assert sum(record.faults_corrupted + record.faults_straggler_timeouts for record in simulated.history) > 0
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-5)


# -------------------------------------------------------------------- the study


def test_no_round_of_the_fault_study_loses_every_update() -> None:
    """``pipelines/studies/faults.yaml`` keeps going with whatever updates arrive
    (``max_failed_fraction: 1.0``), but a round where every sampled client that did not
    drop out straggles (each times out) would stop the run: none of its runs has one."""
    import itertools

    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "pipelines/studies/faults.yaml").read_text())
    base = spec["base"]
    num_clients, fraction, rounds = base["data"]["num_clients"], base["train"]["client_fraction"], base["train"]["rounds"]
    cells = list(itertools.product(spec["grid"]["dropout"].values(), spec["grid"]["stragglers"].values()))
    assert len(cells) == 9
    for (dropout, stragglers), seed in itertools.product(cells, spec["seeds"]):
        overrides = {**dropout, **stragglers}
        faults = {
            "dropout": {"probability": overrides["train.faults.dropout.probability"]},
            "stragglers": {
                "fraction": overrides["train.faults.stragglers.fraction"],
                "factor": overrides.get("train.faults.stragglers.factor", 1.0),
            },
        }
        config = validate_section("train", {**base["train"], "seed": seed, "faults": faults})
        run_faults = Faults.for_run(config, num_clients)
        for index in range(rounds):
            sampled = sample_clients(num_clients, clients_per_round(num_clients, fraction), seed, index)
            taking_part, _ = run_faults.drop_out(sampled, (), index)
            on_time = [client for client in taking_part if run_faults.speed_factors[client] == 1]
            assert on_time or not len(taking_part), (overrides, seed, index + 1)
