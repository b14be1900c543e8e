"""The command line, as a user runs it."""

from __future__ import annotations

import json

import pytest
import yaml

from fedplug.cli import main


def test_list_shows_every_kind_and_a_kind_its_parameters(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for kind in ("datasets:", "partitioners:", "models:", "samplers:", "loss_transforms:", "aggregators:", "groupers:"):
        assert kind in out
    for name in ("fedavgm", "iwds", "fedshift", "fedgsp", "feddisk", "dirichlet_class", "cnn_mnist"):
        assert name in out
    assert main(["list", "aggregators"]) == 0
    details = capsys.readouterr().out
    assert "momentum = 0.9" in details and ">= 0" in details and "fedyogi" in details


def test_list_fits_100_columns_and_the_overview_is_short(capsys, monkeypatch, tmp_path):
    """Every view of ``fedplug list`` wraps at 100 columns (continuation lines indented); the
    overview names each component on a line or two, the details sit behind a KIND."""
    from fedplug.cli import SECTIONS
    from fedplug.registry import KINDS

    monkeypatch.chdir(tmp_path)  # no params.yaml here: the defaults
    for kind in (None, *KINDS, *SECTIONS, "trackers"):
        assert main(["list"] if kind is None else ["list", kind]) == 0
        lines = capsys.readouterr().out.splitlines()
        too_wide = [line for line in lines if len(line) > 100]
        assert not too_wide, (kind, too_wide[:3])
        if kind is None:
            assert len(lines) < 100, len(lines)
            assert "alpha = 0.5" not in "\n".join(lines)  # parameters only under `fedplug list KIND`


def test_list_section_shows_the_params_file_values_beside_the_defaults(capsys, monkeypatch, tmp_path, small_experiment):
    small_experiment["train"]["rounds"] = 7
    small_experiment["train"]["aggregator"] = {"name": "fedavgm", "momentum": 0.5}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(small_experiment))
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**small_experiment, "train": {**small_experiment["train"], "rounds": 4}}))
    monkeypatch.chdir(tmp_path)

    assert main(["list", "train"]) == 0
    out = capsys.readouterr().out
    assert "values from params.yaml" in out
    assert "train.rounds = 7 (default 20)" in out
    assert "train.aggregator = 'fedavgm' (default 'fedavg')" in out
    assert "train.aggregator.momentum = 0.5" in out
    assert "train.local_epochs = 1  Local epochs" in out  # the default, left unlabelled
    assert main(["list", "train", "--config", str(other)]) == 0
    assert "train.rounds = 4 (default 20)" in capsys.readouterr().out
    # A ./params.yaml that is not a valid config (another tool's) leaves the defaults, with a note.
    (tmp_path / "params.yaml").write_text("train: {round: 3}\n")
    assert main(["list", "train"]) == 0
    captured = capsys.readouterr()
    assert "train.rounds = 20  Number" in captured.out and "values from" not in captured.out
    assert "./params.yaml is not used" in captured.err and "did you mean train.rounds" in captured.err


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
    from fedplug.run_folder import default_output_dir

    config = load_experiment("params.yaml", ["data.dataset=synthetic"], None, check_every_algorithm=False)
    folder = default_output_dir(config)
    assert folder.parent.name == "runs" and folder.name.startswith("synthetic-fedavg-")
    assert config.study.name not in folder.name
    prox = load_experiment("params.yaml", ["data.dataset=synthetic"], "fedprox", check_every_algorithm=False)
    assert default_output_dir(prox, "fedprox").name.startswith("synthetic-fedprox-")
    # Without --algorithm, the slots that are not at their default name the folder.
    mixed = load_experiment(
        "params.yaml", ["data.dataset=synthetic", "train.loss_transform=fedprox", "train.aggregator=fedavgm"],
        None, check_every_algorithm=False,
    )
    assert default_output_dir(mixed).name.startswith("synthetic-fedprox+fedavgm-")


def test_help_says_where_the_default_output_goes_and_the_run_writes_there(
    capsys, monkeypatch, tmp_path, small_experiment
):
    """``--help``'s default output folder is the one a run with ``--algorithm`` writes: in the
    config file's folder, named after the algorithm entry."""
    import re

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "runs/<dataset>-<algorithm>-<config hash> in the config file's folder" in help_text
    assert "<algorithm> is --algorithm's NAME" in help_text

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    small_experiment["train"]["rounds"] = 1
    small_experiment["algorithms"] = {"prox": {"loss_transform": {"name": "fedprox", "mu": 0.1}}}
    (project / "params.yaml").write_text(yaml.safe_dump(small_experiment))
    monkeypatch.chdir(elsewhere)
    assert main(["run", str(project / "params.yaml"), "--algorithm", "prox", "--quiet", "--no-track"]) == 0
    written = list((project / "runs").iterdir())
    assert len(written) == 1 and re.fullmatch(r"synthetic-prox-[0-9a-f]{10}", written[0].name), written
    assert (written[0] / "metrics.json").is_file()
    assert list(elsewhere.iterdir()) == []


def test_run_from_another_folder_reads_data_root_against_the_config_folder(capsys, monkeypatch, tmp_path):
    """A relative ``data.root`` is the config file's folder's, as the MLflow store is: run
    from elsewhere, fedplug reads the project's files and writes nothing in the working folder."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_datasets import write_idx_set

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    write_idx_set(project / "files" / "FashionMNIST" / "raw", gz=True, train=40, test=10)
    elsewhere.mkdir()
    config = {
        "data": {"dataset": {"name": "fashion_mnist", "download": False}, "partition": "iid", "num_clients": 2,
                 "root": "files"},
        "train": {"model": "logreg", "rounds": 1, "batch_size": 8},
    }
    (project / "params.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(elsewhere)

    assert main(["run", str(project / "params.yaml"), "--quiet", "--no-track"]) == 0
    assert list(elsewhere.iterdir()) == []
    assert [folder.name.split("-")[0] for folder in (project / "runs").iterdir()] == ["fashion_mnist"]
    resolved = yaml.safe_load(next((project / "runs").iterdir()).joinpath("config.yaml").read_text())
    assert resolved["data"]["root"] == "files"  # the file's words, not this machine's path


def test_set_takes_key_space_value_as_well_as_key_equals_value(small_experiment, tmp_path, capsys):
    from fedplug.cli import join_set_values

    assert join_set_values(["run", "p.yaml", "--set", "train.rounds", "5", "--set", "train.seed=1", "--quiet"]) == [
        "run", "p.yaml", "--set", "train.rounds=5", "--set", "train.seed=1", "--quiet"
    ]
    assert join_set_values(["--set", "train.rounds", "--quiet"]) == ["--set", "train.rounds", "--quiet"]
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(small_experiment))
    out = tmp_path / "run"
    assert main(["run", str(config_path), "--set", "train.rounds", "2", "--out", str(out), "--quiet", "--no-track"]) == 0
    assert json.loads((out / "metrics.json").read_text())["rounds"] == 2
    # A key with no value at all gets the spelling that works, in one line.
    assert main(["run", str(config_path), "--out", str(tmp_path / "x"), "--set", "train.rounds"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "write --set train.rounds=VALUE" in err, err


def test_list_shows_the_config_keys_with_their_defaults(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no params.yaml here: the defaults
    out = ""
    for section in ("study", "tracking", "data", "train", "trackers"):
        assert main(["list", section]) == 0
        shown = capsys.readouterr().out
        assert shown.startswith(f"{section}:"), section
        out += shown
    for line in ("train.rounds = 20", "train.optimizer.lr = 0.05", "train.aggregator = 'fedavg'",
                 "data.num_clients = 10", "study.target_accuracy = 0.9", "tracking.enabled = True",
                 "tracking.backends = ['mlflow']", "tracking.register_model = None", "train.failures.max_round_retries = 1"):
        assert line in out, line
    assert "mlflow " in out and "tensorboard " in out
    assert main(["list", "tracking"]) == 0
    only = capsys.readouterr().out
    assert only.startswith("tracking:") and "train.rounds" not in only
