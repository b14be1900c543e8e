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


def quick_start_command() -> list[str]:
    """The README's first-run command, as its words."""
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("## Run an experiment")
    line = next(text for text in readme[start:].splitlines() if text.startswith("fedplug run params.yaml --set data.dataset=synthetic"))
    return shlex.split(line)


@pytest.mark.slow
def test_readme_quick_start_learns_in_seconds(tmp_path, capsys):
    import time
    from pathlib import Path

    command = quick_start_command()
    assert command[:3] == ["fedplug", "run", "params.yaml"]
    params = Path(__file__).resolve().parents[1] / "params.yaml"
    started = time.process_time()
    code = main(["run", str(params), *command[3:], "--out", str(tmp_path / "quick"), "--quiet", "--no-track"])
    cpu_seconds = time.process_time() - started
    assert code == 0
    metrics = json.loads((tmp_path / "quick" / "metrics.json").read_text())
    assert metrics["history"][-1]["round"] == 10  # params.yaml's rounds, 10 classes
    assert metrics["final_accuracy"] > 0.9, metrics["final_accuracy"]
    assert cpu_seconds < 30, cpu_seconds


def test_default_output_folder_is_named_after_what_ran_not_the_study():
    from fedplug.config import load_experiment
    from fedplug.experiment import default_output_dir

    config = load_experiment("params.yaml", ["data.dataset=synthetic"], None, check_every_algorithm=False)
    folder = default_output_dir(config)
    assert folder.parent.name == "runs" and folder.name.startswith("synthetic-fedavg-")
    assert config.study.name not in folder.name


def test_list_shows_the_config_keys_with_their_defaults(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for section in ("study:", "tracking:", "data:", "train:", "trackers:"):
        assert f"\n{section}" in out, section
    for line in ("train.rounds = 20", "train.optimizer.lr = 0.05", "train.aggregator = 'fedavg'",
                 "data.num_clients = 10", "study.target_accuracy = 0.9", "tracking.enabled = True",
                 "tracking.backends = ['mlflow']", "tracking.register_model = None", "train.failures.max_round_retries = 1"):
        assert line in out, line
    assert "mlflow " in out and "tensorboard " in out
    assert main(["list", "tracking"]) == 0
    only = capsys.readouterr().out
    assert only.startswith("tracking:") and "train.rounds" not in only
