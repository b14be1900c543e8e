"""The simulator: determinism, resume after a crash, failing clients, divergence,
accounting, and the equivalences that pin its maths down."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
import yaml

from fedplug.algorithms.fedavg import FedAvg, FedAvgConfig
from fedplug.components import ComponentConfig, LossTransform
from fedplug.config import validate_experiment
from fedplug.errors import ConfigError, TrainingError
from fedplug.experiment import run_experiment
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.run.round_plan import clients_per_round, sample_clients

VOLATILE = {"seconds"}


def _history(result):
    return [{k: v for k, v in record.as_dict().items() if k not in VOLATILE} for record in result.history]


def test_same_config_and_seed_give_identical_metrics(small_experiment):
    config = validate_experiment(small_experiment)
    first, simulator_a = run_experiment(config, None)
    second, simulator_b = run_experiment(config, None)
    assert _history(first) == _history(second)
    assert torch.equal(simulator_a.final_vector, simulator_b.final_vector)


def test_a_different_seed_changes_the_run(small_experiment):
    first, _ = run_experiment(validate_experiment(small_experiment), None)
    small_experiment["train"]["seed"] = 1
    second, _ = run_experiment(validate_experiment(small_experiment), None)
    assert _history(first) != _history(second)


def test_training_learns_the_synthetic_task(small_experiment):
    small_experiment["train"].update(rounds=8, client_fraction=1.0)
    result, _ = run_experiment(validate_experiment(small_experiment), None)
    assert result.history[0].accuracy < result.best_accuracy
    assert result.best_accuracy > 0.6  # 4 balanced classes: chance is 0.25


def test_round_records_count_bytes_and_participants(small_experiment):
    config = validate_experiment(small_experiment)
    result, simulator = run_experiment(config, None)
    model_bytes = simulator.final_vector.numel() * 4
    participants = max(1, round(0.5 * 6))
    for record in result.history:
        assert record.participants == participants
        assert record.bytes_down == participants * model_bytes
        assert record.bytes_up == participants * model_bytes
        assert record.failures == 0
    assert result.total_bytes == sum(r.bytes_up + r.bytes_down for r in result.history)
    assert result.summary()["rounds"] == config.train.rounds


def test_client_sampling_is_a_fraction_and_depends_only_on_seed_and_round():
    count = clients_per_round(100, 0.1)
    chosen = sample_clients(100, count, seed=3, round_index=7)
    assert count == 10 and len(chosen) == 10 and len(set(chosen.tolist())) == 10
    assert np.array_equal(chosen, sample_clients(100, count, seed=3, round_index=7))
    assert not np.array_equal(chosen, sample_clients(100, count, seed=3, round_index=8))
    assert clients_per_round(5, 0.01) == 1


def test_fedavgm_with_zero_momentum_equals_fedavg(small_experiment):
    plain, simulator_plain = run_experiment(validate_experiment(small_experiment), None)
    small_experiment["train"]["aggregator"] = {"name": "fedavgm", "momentum": 0.0, "server_lr": 1.0}
    momentum, simulator_momentum = run_experiment(validate_experiment(small_experiment), None)
    assert torch.allclose(simulator_plain.final_vector, simulator_momentum.final_vector, atol=1e-6)


def test_evaluation_matches_a_direct_computation(small_experiment):
    config = validate_experiment(small_experiment)
    result, simulator = run_experiment(config, None)
    federation = simulator.federation
    with torch.no_grad():
        logits = simulator.model(federation.test_x)
    accuracy = float((logits.argmax(1) == federation.test_y).float().mean())
    loss = float(torch.nn.functional.cross_entropy(logits, federation.test_y))
    assert result.final_accuracy == pytest.approx(accuracy)
    assert result.history[-1].loss == pytest.approx(loss, rel=1e-5)
    per_client = []
    for client in federation.clients:
        with torch.no_grad():
            per_client.append(float((simulator.model(client.test_x).argmax(1) == client.test_y).float().mean()))
    assert result.history[-1].client_accuracy_mean == pytest.approx(np.mean(per_client))
    assert result.history[-1].client_accuracy_std == pytest.approx(np.std(per_client))


# ------------------------------------------------------------------ failing clients


class FaultyConfig(ComponentConfig):
    """Cross-entropy, except that chosen clients raise or return NaN."""

    name: Literal["faulty"]
    raise_on: tuple[int, ...] = ()
    nan_on: tuple[int, ...] = ()


class Faulty(LossTransform):
    def __init__(self, config: FaultyConfig) -> None:
        self.config = config

    def client_context(self, client_id, class_counts):
        if client_id in self.config.raise_on:
            raise RuntimeError(f"client {client_id} lost its disk")
        return {"poison": torch.tensor(float("nan") if client_id in self.config.nan_on else 0.0)}

    def per_sample_loss(self, logits, targets, sample_ids, context):
        # Multiplying (not adding) makes the NaN reach the gradients and so the model.
        return super().per_sample_loss(logits, targets, sample_ids, context) * (1 + context["poison"])


@pytest.fixture
def faulty_registry():
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register("loss_transforms", "test", "faulty", FaultyConfig, Faulty)
    return registry


def test_failing_clients_are_dropped_and_counted(small_experiment, faulty_registry, caplog):
    small_experiment["train"].update(client_fraction=1.0, rounds=2)
    small_experiment["train"]["loss_transform"] = {"name": "faulty", "raise_on": [1], "nan_on": [4]}
    config = validate_experiment(small_experiment, faulty_registry)
    with caplog.at_level("WARNING", logger="fedplug.simulation"):
        result, _ = run_experiment(config, None, registry=faulty_registry)
    assert [record.failures for record in result.history] == [2, 2]
    assert [record.participants for record in result.history] == [6, 6]
    assert all(math.isfinite(record.accuracy) for record in result.history)
    assert "client 1 lost its disk" in caplog.text
    assert "non-finite" in caplog.text


def test_too_many_failures_stop_the_run_with_a_clear_error(small_experiment, faulty_registry):
    small_experiment["train"].update(client_fraction=1.0, rounds=2)
    small_experiment["train"]["loss_transform"] = {"name": "faulty", "raise_on": [0, 1, 2, 3]}
    small_experiment["train"]["failures"] = {"max_failed_fraction": 0.5, "max_round_retries": 1}
    config = validate_experiment(small_experiment, faulty_registry)
    with pytest.raises(TrainingError, match=r"round 1: 4 of 6 client updates failed in each of 2 attempts"):
        run_experiment(config, None, registry=faulty_registry)


@pytest.mark.parametrize("aggregator", ["fedavg", "scaffold"])
def test_a_round_where_every_client_failed_is_retried_like_any_other(small_experiment, faulty_registry, aggregator):
    """The aggregator has nothing to average (it raises); the failure policy, not that
    error, decides: retry the round, then stop with the failure count."""
    small_experiment["train"].update(client_fraction=1.0, rounds=2)
    small_experiment["train"]["aggregator"] = {"name": aggregator}
    small_experiment["train"]["loss_transform"] = {"name": "faulty", "raise_on": [0, 1, 2, 3, 4, 5]}
    small_experiment["train"]["failures"] = {"max_failed_fraction": 0.9, "max_round_retries": 2}
    config = validate_experiment(small_experiment, faulty_registry)
    with pytest.raises(TrainingError, match=r"round 1: 6 of 6 client updates failed in each of 3 attempts"):
        run_experiment(config, None, registry=faulty_registry)


class ExplodingConfig(ComponentConfig):
    """FedAvg whose result turns to infinity at a chosen round."""

    name: Literal["exploding"]
    at_round: int = 3


class Exploding(FedAvg):
    def __init__(self, config: ExplodingConfig, num_clients: int) -> None:
        super().__init__(FedAvgConfig(name="fedavg"), num_clients)
        self.at_round, self.calls = config.at_round, 0

    def aggregate(self, global_vector, updates):
        self.calls += 1
        result = super().aggregate(global_vector, updates)
        return result * float("inf") if self.calls == self.at_round else result


def test_divergence_stops_at_that_round_and_keeps_the_last_good_checkpoint(small_experiment, tmp_path):
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register("aggregators", "test", "exploding", ExplodingConfig, Exploding)
    small_experiment["train"].update(rounds=6)
    small_experiment["train"]["aggregator"] = {"name": "exploding", "at_round": 3}
    config = validate_experiment(small_experiment, registry)
    with pytest.raises(TrainingError, match=r"non-finite at round 3; the last good state is the checkpoint"):
        run_experiment(config, tmp_path, registry=registry)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert len(checkpoint["history"]) == 2
    assert torch.isfinite(checkpoint["global_vector"]).all()


# ------------------------------------------------------------------ checkpoint and resume


def _write_config(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _fedplug(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "fedplug.cli", *args], env=env, **kwargs)


@pytest.mark.slow
def test_sigkill_mid_run_then_same_command_resumes_to_the_identical_result(small_experiment, tmp_path):
    small_experiment["train"].update(rounds=40, client_fraction=1.0, local_epochs=3, batch_size=4)
    small_experiment["train"]["aggregator"] = {"name": "fedavgm", "momentum": 0.9}
    config_path = _write_config(tmp_path / "config.yaml", small_experiment)

    reference = _fedplug("run", str(config_path), "--out", str(tmp_path / "reference"), "--quiet")
    assert reference.wait(timeout=600) == 0

    killed_dir = tmp_path / "killed"
    victim = _fedplug("run", str(config_path), "--out", str(killed_dir), "--quiet")
    deadline = time.time() + 300
    while not (killed_dir / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=60)
    partial = torch.load(killed_dir / "checkpoint.pt", weights_only=False)
    assert 1 <= len(partial["history"]) < 40, "the run must be killed mid-way for this test to mean anything"
    assert not (killed_dir / "metrics.json").exists()

    resumed = _fedplug("run", str(config_path), "--out", str(killed_dir), "--quiet")
    assert resumed.wait(timeout=600) == 0
    expected = json.loads((tmp_path / "reference" / "metrics.json").read_text())
    actual = json.loads((killed_dir / "metrics.json").read_text())
    strip = lambda history: [{k: v for k, v in r.items() if k not in VOLATILE} for r in history]  # noqa: E731
    assert strip(actual["history"]) == strip(expected["history"])
    assert actual["final_accuracy"] == expected["final_accuracy"]
    reference_model = torch.load(tmp_path / "reference" / "model.pt")
    resumed_model = torch.load(killed_dir / "model.pt")
    for name in reference_model:
        assert torch.equal(reference_model[name], resumed_model[name]), name


@pytest.mark.slow
def test_two_processes_give_identical_metrics(small_experiment, tmp_path):
    config_path = _write_config(tmp_path / "config.yaml", small_experiment)
    runs = [_fedplug("run", str(config_path), "--out", str(tmp_path / name), "--quiet") for name in ("a", "b")]
    assert [run.wait(timeout=600) for run in runs] == [0, 0]
    a, b = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("a", "b"))
    strip = lambda history: [{k: v for k, v in r.items() if k not in VOLATILE} for r in history]  # noqa: E731
    assert strip(a["history"]) == strip(b["history"])
    info = json.loads((tmp_path / "a" / "run_info.json").read_text())
    assert info["packages"]["torch"] == torch.__version__.split("+")[0] or info["packages"]["torch"]
    assert "git_commit" in info
    assert yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["train"]["aggregator"]["name"] == "fedavg"


def test_checkpoint_of_another_config_is_refused(small_experiment, tmp_path):
    run_experiment(validate_experiment(small_experiment), tmp_path)
    small_experiment["train"]["rounds"] = 4
    small_experiment["train"]["optimizer"]["lr"] = 0.1
    # The folder's marker refuses it (ConfigError) before its checkpoint's fingerprint would
    # (TrainingError): both hold the config's.
    with pytest.raises((ConfigError, TrainingError), match="belongs to a different config"):
        run_experiment(validate_experiment(small_experiment), tmp_path)


def test_scaffold_client_state_lives_in_the_simulator_and_is_checkpointed(small_experiment, tmp_path):
    small_experiment["train"]["aggregator"] = {"name": "scaffold"}
    small_experiment["train"].update(rounds=2)
    run_experiment(validate_experiment(small_experiment), tmp_path)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert checkpoint["client_states"], "SCAFFOLD's per-client control variates must be saved"
    some_state = next(iter(checkpoint["client_states"].values()))
    assert any(torch.count_nonzero(value) > 0 for value in some_state.values())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_any_non_finite_value(bad):
    from fedplug.run.vectors import all_finite

    vector = torch.arange(1000, dtype=torch.float32)
    assert all_finite(vector)
    vector[537] = bad
    assert not all_finite(vector)
