"""A study's ``tune:`` search: Optuna's grid and TPE samplers choose a learning rate on
validation samples (never a test set), the median pruner stops a hopeless trial, every trial
is an MLflow run nested under the tuning parent, the choice reaches every run and its record,
and an unknown parameter is one line before anything trains."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_study import load_runner

from fedplug.config import validate_experiment
from fedplug.errors import ConfigError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry
from fedplug.study import tuning
from fedplug.study.expansion import expand_study
from fedplug.study.records import load_records
from fedplug.study.spec import parse_study
from fedplug.study.tuning import TUNED_NAME, apply_tuning

FINGERPRINT = "fedplug study tiny"

BASE: dict[str, Any] = {
    "study": {"target_accuracy": 0.5},
    "tracking": {"enabled": False},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 600, "num_test": 100, "num_features": 12, "num_classes": 4},
        "partition": {"name": "iid"},
        "num_clients": 4,
        "local_test_fraction": 0.2,
        "seed": 0,
    },
    "train": {
        "model": {"name": "mlp", "hidden": [16]},
        "rounds": 3,
        "local_epochs": 3,
        "batch_size": 8,
        "optimizer": {"name": "sgd", "lr": 0.1},
        "engine": "sequential",
    },
}
LEARNING_RATES = [0.02, 0.3, 1.5]
SEED_03_FIRST = 1
"""A grid seed with which Optuna's GridSampler tries lr 0.3 before lr 1e-6."""


def spec_dict(tune: dict[str, Any], **changes: Any) -> dict[str, Any]:
    spec = {
        "name": "tiny",
        "base": copy.deepcopy(BASE),
        "grid": {"clients": {"4": {}, "6": {"data.num_clients": 6}}},
        "algorithms": {"fedavg": {}},
        "seeds": [0],
        "plots": [],
        "tune": {"validation_fraction": 0.2, **tune},
    }
    spec.update(changes)
    return spec


def tune_grid(out: Path, **tune: Any) -> tuple[Any, list[Any]]:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": LEARNING_RATES}, **tune}))
    runs = expand_study(spec)
    return spec, apply_tuning(spec, runs, out, None, mlflow_root=None, fingerprint=FINGERPRINT)


def validation_accuracy(lr: float) -> float:
    """The last round's val_accuracy of the first cell's run trained with ``lr`` (by hand)."""
    document = copy.deepcopy(BASE)
    document["train"]["optimizer"]["lr"] = lr
    document["train"]["seed"] = 0
    document["data"]["validation_fraction"] = 0.2
    result, _ = run_experiment(validate_experiment(document), None)
    return result.history[-1].metrics["val_accuracy"]


def test_the_grid_chooses_the_learning_rate_with_the_best_validation_accuracy(tmp_path: Path) -> None:
    accuracies = [validation_accuracy(lr) for lr in LEARNING_RATES]
    best = LEARNING_RATES[accuracies.index(max(accuracies))]
    assert accuracies.count(max(accuracies)) == 1, "one learning rate must be best for this test to mean anything"

    _, runs = tune_grid(tmp_path / "out")

    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]
    assert chosen["params"] == {"train.optimizer.lr": best} and chosen["value"] == max(accuracies)
    assert chosen["trials"] == 3 and chosen["pruned"] == 0 and chosen["tuned_on"] == "4__fedavg__d0s0"
    assert [run.config.train.optimizer.lr for run in runs] == [best, best]
    assert all(run.tuned == {"train.optimizer.lr": best} for run in runs)
    # The study's runs train on every training sample: the validation split is only the trials'.
    assert all(run.config.data.validation_fraction == 0.0 for run in runs)


def test_the_test_set_takes_no_part_in_the_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trials whose federation has its test labels scrambled choose the same, with the same values."""
    _, plain = tune_grid(tmp_path / "plain")
    build = tuning.build_federation

    def scrambled(*args: Any, **kwargs: Any) -> Any:
        federation = build(*args, **kwargs)
        federation.test_y = (federation.test_y + 1) % federation.num_classes  # every test label wrong
        return federation

    monkeypatch.setattr(tuning, "build_federation", scrambled)
    _, scrambled_runs = tune_grid(tmp_path / "scrambled")

    first = json.loads((tmp_path / "plain" / TUNED_NAME).read_text())
    second = json.loads((tmp_path / "scrambled" / TUNED_NAME).read_text())
    for choices in (first, second):
        for choice in choices.values():
            assert choice.pop("seconds") > 0  # the search's wall time: the one thing that may differ
    assert first == second
    assert [run.tuned for run in plain] == [run.tuned for run in scrambled_runs]


def test_tpe_runs_its_trials_reproducibly_and_a_matching_choice_is_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tune = {"sampler": "tpe", "trials": 4, "seed": 7, "params": {"train.optimizer.lr": {"low": 0.01, "high": 1.0, "log": True}}}
    spec = parse_study(spec_dict(tune))
    runs = expand_study(spec)

    apply_tuning(spec, runs, tmp_path / "a", None, mlflow_root=None, fingerprint=FINGERPRINT)
    apply_tuning(spec, runs, tmp_path / "b", None, mlflow_root=None, fingerprint=FINGERPRINT)

    first = json.loads((tmp_path / "a" / TUNED_NAME).read_text())["fedavg"]
    second = json.loads((tmp_path / "b" / TUNED_NAME).read_text())["fedavg"]
    assert first.pop("seconds") > 0 and second.pop("seconds") > 0  # the search's wall time, all else equal
    assert first == second
    assert first["trials"] == 4 and 0.01 <= first["params"]["train.optimizer.lr"] <= 1.0
    assert capsys.readouterr().out.count("trial 4/4") == 2
    # Again with the same tune section and config: tuned.json's choice, no trial.
    again = apply_tuning(spec, runs, tmp_path / "a", None, mlflow_root=None, fingerprint=FINGERPRINT)
    assert "trial" not in capsys.readouterr().out
    assert again[0].tuned == first["params"]


def test_the_median_pruner_stops_a_trial_that_learns_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The grid's seed has lr 0.3 tried first; then lr 1e-6 (the model stays about at its
    initialisation) has a higher validation loss after round 1 and is pruned there."""
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.3, 1e-6]}, "seed": SEED_03_FIRST,
                                  "metric": "val_loss", "pruner": "median", "pruner_startup_trials": 1}))

    runs = apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT)

    assert "trial 1/2 {'train.optimizer.lr': 0.3} ->" in capsys.readouterr().out, "the grid's order changed: pick another seed"

    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]
    assert chosen["pruned"] == 1 and chosen["trials"] == 2 and chosen["params"] == {"train.optimizer.lr": 0.3}
    assert runs[0].tuned == {"train.optimizer.lr": 0.3}


def test_trials_are_mlflow_runs_nested_under_the_tuning_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": LEARNING_RATES}}))

    apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=tmp_path, fingerprint=FINGERPRINT)

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("study-tiny")
    runs = client.search_runs([experiment.experiment_id])
    parents = [run for run in runs if "fedplug.parent" in run.data.tags]
    trials = [run for run in runs if "mlflow.parentRunId" in run.data.tags]
    assert len(parents) == 1 and len(trials) == 3 and len(runs) == 4
    parent = parents[0]
    assert parent.data.tags["fedplug.parent"] == f"tune:{(tmp_path / 'out').resolve().relative_to(tmp_path.resolve())}"
    assert {run.data.tags["mlflow.parentRunId"] for run in trials} == {parent.info.run_id}
    assert sorted(run.data.params["train.optimizer.lr"] for run in trials) == sorted(str(lr) for lr in LEARNING_RATES)
    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]
    for trial in trials:
        history = client.get_metric_history(trial.info.run_id, "val_accuracy")
        assert sorted(metric.step for metric in history) == [1, 2, 3] and trial.info.status == "FINISHED"
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["fedavg.best_value"] == pytest.approx(chosen["value"])
    assert parent.data.metrics["fedavg.train.optimizer.lr"] == chosen["params"]["train.optimizer.lr"]


def test_per_cell_choices_reach_the_tuning_parent_under_names_mlflow_takes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.3]}, "per_cell": True}))

    apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=tmp_path, fingerprint=FINGERPRINT)

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("study-tiny").experiment_id])
    parent = next(run for run in runs if "fedplug.parent" in run.data.tags)
    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())
    assert parent.info.status == "FINISHED" and len(runs) == 3
    for cell in ("4", "6"):
        assert parent.data.metrics[f"fedavg/{cell}.best_value"] == pytest.approx(chosen[f"fedavg@{cell}"]["value"])


def test_a_tuned_study_records_the_choice_in_every_run_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.05, 0.5]}},
                                                  algorithms={"fedavg": {}, "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.5}}})))
    out, results = tmp_path / "out", tmp_path / "tiny.jsonl"
    command = [str(spec_path), "--no-mlflow", "--out", str(out), "--results", str(results)]

    assert load_runner().main(command) == 0

    chosen = json.loads((out / TUNED_NAME).read_text())
    records = load_records(results)
    assert len(records) == 4 and set(chosen) == {"fedavg", "fedavgm"}
    for record in records:
        lr = chosen[record["algorithm"]]["params"]["train.optimizer.lr"]
        assert record["tuned"] == {"train.optimizer.lr": lr}
        config = yaml.safe_load((out / record["run"] / "config.yaml").read_text())
        assert config["train"]["optimizer"]["lr"] == lr and "validation_fraction" not in config["data"]
        search = chosen[record["algorithm"]]
        assert record["tuning"] == {key: search[key] for key in ("value", "trials", "pruned", "seconds", "tuned_on",
                                                                 "fingerprint")}
        assert record["tuning"]["trials"] == 2 and record["tuning"]["seconds"] > 0
    # Resumed: the choice and the runs are reused, nothing trains.
    capsys.readouterr()
    assert load_runner().main(command) == 0
    printed = capsys.readouterr().out
    assert "4 runs, 4 done, 0 to train" in printed and "trial" not in printed
    # A fresh clone: no study folder, only the committed results file. Its records hold the
    # choices, so neither a search nor a run trains, and the records come back unchanged.
    shutil.rmtree(out)
    assert load_runner().main(command) == 0
    printed = capsys.readouterr().out
    assert "4 runs, 4 done (4 from" in printed and "0 to train" in printed and "trial" not in printed
    assert load_records(results) == records
    # A record whose search had another space is not taken for this one's: the search runs.
    spec_path.write_text(yaml.safe_dump(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.05, 0.5, 0.2]}},
                                                  algorithms={"fedavg": {}, "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.5}}})))
    shutil.rmtree(out)
    with pytest.raises(ConfigError, match="holds no choice for 'fedavg' .* nor does a record"):
        load_runner().main([*command, "--report-only"])


def test_the_runners_searches_train_with_the_pipelines_thread_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trials train in the runner's own process, so they use ``$FEDPLUG_TORCH_THREADS``
    like its runs do (on a 2-core machine, two runners each on torch's default of every core
    trained a search several times slower)."""
    import torch

    import fedplug.study.tuning as tuning

    seen: list[int] = []
    real = tuning.apply_tuning

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.5]}})))
    before = torch.get_num_threads()
    monkeypatch.setattr(tuning, "apply_tuning", counting)
    monkeypatch.setenv("FEDPLUG_TORCH_THREADS", "1")
    torch.set_num_threads(2)
    try:
        assert load_runner().main([str(spec_path), "--no-mlflow", "--out", str(tmp_path / "out"), "--no-results"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


def test_an_unknown_parameter_is_one_line_before_anything_trains(tmp_path: Path) -> None:
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict({"sampler": "grid", "params": {"train.optimizer.lrr": [0.1]}})))
    out = tmp_path / "out"

    with pytest.raises(ConfigError) as raised:
        load_runner().main([str(spec_path), "--no-mlflow", "--out", str(out)])

    message = str(raised.value)
    assert "\n" not in message and "'train.optimizer.lrr'" in message
    assert "did you mean 'train.optimizer.lr'" in message and "train.optimizer.momentum" in message
    assert not out.exists()


def test_a_value_the_config_refuses_is_one_line_before_anything_trains(tmp_path: Path) -> None:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.1, 0.0]}}))

    with pytest.raises(ConfigError) as raised:
        apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT)

    assert "\n" not in str(raised.value) and "train.optimizer.lr: Input should be greater than 0" in str(raised.value)
    assert not (tmp_path / "out").exists()


def validation_accuracies(**data: Any) -> list[float]:
    """:func:`validation_accuracy` of each of :data:`LEARNING_RATES` with ``data`` changed."""
    accuracies = []
    for lr in LEARNING_RATES:
        document = copy.deepcopy(BASE)
        document["data"].update(data, validation_fraction=0.2)
        document["train"].update(seed=0, optimizer={"name": "sgd", "lr": lr})
        result, _ = run_experiment(validate_experiment(document), None)
        accuracies.append(result.history[-1].metrics["val_accuracy"])
    return accuracies


def test_per_cell_tuning_chooses_in_each_cell_on_that_cells_own_run(tmp_path: Path) -> None:
    """Each cell's runs train with the learning rate best on that cell's validation split
    (checked against trials trained by hand), not the first cell's."""
    best = {}
    for cell, clients in (("4", 4), ("6", 6)):
        accuracies = validation_accuracies(num_clients=clients)
        assert accuracies.count(max(accuracies)) == 1
        best[cell] = (LEARNING_RATES[accuracies.index(max(accuracies))], max(accuracies))

    _, runs = tune_grid(tmp_path / "out", per_cell=True)

    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())
    assert set(chosen) == {"fedavg@4", "fedavg@6"}
    for cell, (lr, value) in best.items():
        assert chosen[f"fedavg@{cell}"]["params"] == {"train.optimizer.lr": lr}
        assert chosen[f"fedavg@{cell}"]["value"] == value and chosen[f"fedavg@{cell}"]["tuned_on"] == f"{cell}__fedavg__d0s0"
    assert {run.cell_id: run.config.train.optimizer.lr for run in runs} == {cell: lr for cell, (lr, _) in best.items()}


def test_only_the_named_algorithms_are_tuned_each_over_its_own_space(tmp_path: Path) -> None:
    """``tune.algorithms`` leaves an ablation at its study values; ``algorithm_params`` adds a
    path only one algorithm has (FedAvg has no server_lr), searched on the grid with the rest."""
    spec = parse_study(spec_dict(
        {"sampler": "grid", "params": {"train.optimizer.lr": [0.3]}, "algorithms": ["momentum"],
         "algorithm_params": {"momentum": {"train.aggregator.server_lr": [0.5, 1.0]}}},
        algorithms={"plain": {}, "momentum": {"aggregator": {"name": "fedavgm", "momentum": 0.5}}}))

    runs = apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT)

    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())
    assert set(chosen) == {"momentum"} and chosen["momentum"]["trials"] == 2
    assert set(chosen["momentum"]["params"]) == {"train.optimizer.lr", "train.aggregator.server_lr"}
    for run in runs:
        if run.algorithm == "plain":
            assert not isinstance(run, tuning.TunedRun) and run.config.train.optimizer.lr == 0.1
        else:
            assert run.tuned == chosen["momentum"]["params"]
            assert run.config.train.aggregator.server_lr == chosen["momentum"]["params"]["train.aggregator.server_lr"]


def test_a_search_is_reused_while_its_own_space_holds_whatever_the_others_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another algorithm's grid and the list of tuned algorithms are not part of a search's
    fingerprint; its own grid is: tuning a study in pieces (or widening one algorithm's
    grid) re-runs only the searches whose space changed."""
    algorithms = {"plain": {}, "momentum": {"aggregator": {"name": "fedavgm", "momentum": 0.5}}}

    def tune(out: Path, **fields: Any) -> dict[str, Any]:
        spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.3]}, **fields},
                                     algorithms=algorithms))
        apply_tuning(spec, expand_study(spec), out, None, mlflow_root=None, fingerprint=FINGERPRINT)
        return json.loads((out / TUNED_NAME).read_text())

    server = {"momentum": {"train.aggregator.server_lr": [0.5, 1.0]}}
    first = tune(tmp_path, algorithms=["plain"])
    capsys.readouterr()
    both = tune(tmp_path, algorithms=["plain", "momentum"], algorithm_params=server)
    out = capsys.readouterr().out
    assert "tune plain" not in out and "tune momentum" in out  # momentum's search only
    assert both["plain"] == first["plain"] and both["momentum"]["trials"] == 2
    wider = tune(tmp_path, algorithms=["plain", "momentum"],
                 algorithm_params={"momentum": {"train.aggregator.server_lr": [0.5, 1.0, 2.0]}})
    out = capsys.readouterr().out
    assert "tune plain" not in out and "tune momentum" in out  # momentum's again, plain's kept
    assert wider["plain"] == first["plain"] and wider["momentum"]["trials"] == 3
    assert wider["momentum"]["fingerprint"] != both["momentum"]["fingerprint"]


def test_a_search_is_reused_under_another_study_name_but_not_with_other_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A search's fingerprint covers what can change its trials' results (the comparable
    config, as for a run's ``config_hash``): the study's name and tracking are not part of
    it, so a study tuned in pieces under other names, or renamed, keeps its choices; a
    setting that trains differently (the rounds) is."""

    def tune(name: str, rounds: int = 3) -> dict[str, Any]:
        spec_data = spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.3, 1.5]}}, name=name)
        spec_data["base"]["train"]["rounds"] = rounds
        spec = parse_study(spec_data)
        apply_tuning(spec, expand_study(spec), tmp_path, None, mlflow_root=None, fingerprint=FINGERPRINT)
        return json.loads((tmp_path / TUNED_NAME).read_text())

    first = tune("tiny")
    capsys.readouterr()
    assert tune("tiny_renamed") == first and "tune" not in capsys.readouterr().out  # reused, no trial
    longer = tune("tiny", rounds=4)
    assert "tune fedavg" in capsys.readouterr().out and longer["fedavg"]["fingerprint"] != first["fedavg"]["fingerprint"]


@pytest.mark.parametrize(("tune", "expected"), [
    ({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]}, "algorithms": ["fedavgg"]},
     "tune.algorithms: 'fedavgg' is not one of the algorithms (fedavg)"),
    ({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]}, "algorithms": ["fedavg"],
      "algorithm_params": {"other": {"train.optimizer.lr": [0.2]}}}, "'other' is not a tuned algorithm (fedavg)"),
    ({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]}, "per_cell": True, "cell": {"clients": "6"}},
     "remove `cell:`"),
    ({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]},
      "algorithm_params": {"fedavg": {"train.aggregator.server_lr": {"low": 0.1, "high": 1}}}},
     "algorithm_params.fedavg.train.aggregator.server_lr: the grid sampler needs a list"),
])
def test_a_tune_section_naming_what_the_study_lacks_is_refused(tune: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_study(spec_dict(tune))

    assert expected in str(raised.value)


@pytest.mark.parametrize(("tune", "expected"), [
    ({"sampler": "grid", "params": {"train.optimizer.lr": {"low": 0.01, "high": 0.1}}}, "needs a list of values"),
    ({"sampler": "tpe", "params": {"train.optimizer.lr": [0.1]}}, "needs `trials:`"),
    ({"sampler": "grid", "params": {"train.seed": [1, 2]}}, "train.seed is set by the study's `seeds:`"),
    ({"sampler": "grid", "params": {"lr": [0.1]}}, "'lr' is not a config path"),
    ({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]}, "cell": {"clients": "7"}}, "tune.cell.clients: '7'"),
    ({"sampler": "tpe", "trials": 2, "params": {"train.optimizer.lr": {"low": 0, "high": 1, "log": True}}}, "low > 0"),
])
def test_a_malformed_tune_section_is_refused_when_the_study_is_read(tune: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match="tune") as raised:
        parse_study(spec_dict(tune))

    assert expected in str(raised.value)


def test_tune_cell_picks_the_cell_the_trials_train(tmp_path: Path) -> None:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]}, "cell": {"clients": "6"}}))

    apply_tuning(spec, expand_study(spec), tmp_path / "out", default_registry(), mlflow_root=None, fingerprint=FINGERPRINT)

    assert json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]["tuned_on"] == "6__fedavg__d0s0"


def test_the_tuned_table_lists_each_cell_and_algorithm_once_with_its_search() -> None:
    from fedplug.study.tables import tuned_table

    def record(cell: str, algorithm: str, draw: int, lr: float | None) -> dict[str, Any]:
        tuned = {"tuned": {"train.optimizer.lr": lr}, "tuning": {"value": 0.875, "trials": 5, "pruned": 1,
                                                               "tuned_on": f"{cell}__{algorithm}__d0s0"}}
        return {"cell": {"alpha": cell}, "algorithm": algorithm, "draw": draw, **(tuned if lr is not None else {})}

    records = [record("0.1", "fedavg", 0, 0.5), record("0.1", "fedavg", 1, 0.5), record("0.1", "plain", 0, None),
               record("10", "fedavg", 0, 0.02)]

    table = tuned_table(records, ["alpha"], labels={"fedavg": "FedAvg (tuned)"},
                        spaces={"fedavg": {"train.optimizer.lr": [0.01, 0.02, 0.5]}})

    assert table.splitlines() == [
        "| alpha | algorithm | `train.optimizer.lr` | validation value | trials (pruned) | tuned on |",
        "|---|---|---|---|---|---|",
        "| 0.1 | FedAvg (tuned) | 0.5 (grid edge) | 0.8750 | 5 (1) | 0.1__fedavg__d0s0 |",
        "| 10 | FedAvg (tuned) | 0.02 | 0.8750 | 5 (1) | 10__fedavg__d0s0 |",
    ]
    assert tuned_table([record("0.1", "plain", 0, None)], ["alpha"]) == ""
