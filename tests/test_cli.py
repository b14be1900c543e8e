"""The command line, as a user runs it."""

from __future__ import annotations

import json

import pytest
import yaml

from fedplug.cli import main


def test_list_shows_every_kind_with_parameters(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for kind in ("datasets:", "partitioners:", "models:", "samplers:", "loss_transforms:", "aggregators:", "groupers:"):
        assert kind in out
    for name in ("fedavgm", "iwds", "fedshift", "fedgsp", "feddisk", "dirichlet_class", "cnn_mnist"):
        assert name in out
    assert "momentum = 0.9" in out and ">= 0" in out


def test_run_writes_metrics_and_resolved_config(small_experiment, tmp_path, capsys):
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(small_experiment))
    out = tmp_path / "run"
    code = main(["run", str(config_path), "--set", "train.rounds=2", "--set", "train.aggregator=fedavgm", "--out", str(out), "--quiet"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rounds"] == 2
    assert {"final_accuracy", "best_accuracy", "history"} <= set(metrics)
    for key in ("round", "accuracy", "loss", "bytes_up", "bytes_down", "seconds"):
        assert key in metrics["history"][0]
    assert metrics["final_accuracy"] == metrics["history"][-1]["accuracy"]
    assert metrics["best_accuracy"] == max(r["accuracy"] for r in metrics["history"])
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["train"]["aggregator"]["name"] == "fedavgm"
    assert resolved["train"]["aggregator"]["momentum"] == 0.9  # defaults resolved
    # Hsu et al. report eta / (1 - beta) with eta the client learning rate (0.5 here).
    assert metrics["derived"]["effective_learning_rate"] == pytest.approx(0.5 / (1 - 0.9))


def test_bad_input_exits_nonzero_with_one_clear_line(small_experiment, tmp_path, capsys):
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(small_experiment))
    code = main(
        ["run", str(config_path), "--set", "train.aggregator=fedavgm", "--set", "train.aggregator.momentum=2",
         "--out", str(tmp_path / "x")]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "train.aggregator.momentum" in err
    assert "Traceback" not in err
    assert not (tmp_path / "x").exists(), "nothing may start before the config is valid"
