"""The study runner's machinery for the cross-paper benchmark (issue 40, items 1-2, 5-6).

- A built-in quantity-skew partitioner, ``dirichlet_size``: IID labels, client sizes
  from Dirichlet shares, a floor of ``min_size`` samples.
- ``tune.draws`` (trials train on partition draws the study never reports, a trial scoring
  the mean over them) and ``tune.select: window`` (the mean of the last ``window`` rounds);
  ``tune.equal_trials``; existing searches keep their fingerprints.
- Every trial a committed record (``<study>.trials.jsonl`` beside the results file), from
  which an interrupted search resumes without training its finished trials again.
- The edge rule: a choice at an edge of its search space is said in one line and kept.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import yaml
from scipy import stats
from test_partitions import assert_valid, balanced_labels, same_split
from test_study import load_runner
from test_study_tuning import BASE, FINGERPRINT, LEARNING_RATES, SEED_03_FIRST, spec_dict

from fedplug.config import read_yaml, validate_experiment
from fedplug.data.build import build_federation
from fedplug.data.partitions import (
    DirichletClassConfig,
    DirichletSizeConfig,
    dirichlet_class,
    dirichlet_size,
    dirichlet_sizes,
)
from fedplug.errors import ConfigError, DataError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry
from fedplug.study import tuning
from fedplug.study.expansion import expand_study
from fedplug.study.records import load_records
from fedplug.study.spec import ParamRange, TuneSpec, parse_study
from fedplug.study.tables import _edge
from fedplug.study.trials import edge_side, load_trials, trials_path
from fedplug.study.tuning import TUNED_NAME, apply_tuning, search_fingerprint

ROOT = Path(__file__).resolve().parents[1]
TOO_MANY = "data.num_clients is {} but dataset 'synthetic' has only 600 training samples"


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------- dirichlet_size


def test_dirichlet_size_by_hand_on_ten_samples() -> None:
    """n = 10, K = 3, beta = 1, min_size = 2, seed 0: the shares are q = (0.395, 0.593,
    0.012); each client gets 2, and the 4 samples left are cut at floor(4 * 0.395) = 1 and
    floor(4 * 0.988) = 3, so 1, 2 and 1 more: sizes 3, 4, 3."""
    shares = rng(0).dirichlet(np.ones(3))
    assert np.allclose(shares, [0.39546, 0.59302, 0.01152], atol=1e-5)

    sizes = dirichlet_sizes(10, 3, 1.0, 2, rng(0))

    assert sizes.tolist() == [3, 4, 3]


def test_dirichlet_size_without_a_floor_is_niid_benchs_split() -> None:
    """min_size 0 gives the sizes of NIID-Bench's ``np.split(idxs, (cumsum(q) * n)[:-1])``."""
    for seed in range(20):
        shares = rng(seed).dirichlet(np.full(7, 0.5))
        reference = [len(part) for part in np.split(np.arange(1000), (np.cumsum(shares) * 1000).astype(int)[:-1])]

        assert dirichlet_sizes(1000, 7, 0.5, 0, rng(seed)).tolist() == reference


def test_dirichlet_size_places_every_sample_and_gives_each_client_its_floor() -> None:
    labels = balanced_labels(10, 500)
    spread = []
    for seed in range(30):
        partition = dirichlet_size(labels, 10, 20, DirichletSizeConfig(beta=0.3, min_size=40), rng(seed))

        assert_valid(partition, labels, 10, 20)
        assert partition.sizes.sum() == labels.size and partition.sizes.min() >= 40
        spread.append(partition.sizes.std() / partition.sizes.mean())
    # Sizes are skewed (equal sizes would give 0), more at beta 0.3 than at beta 100.
    even = [dirichlet_size(labels, 10, 20, DirichletSizeConfig(beta=100.0, min_size=40), rng(seed)).sizes.std()
            / 250 for seed in range(30)]
    assert np.mean(spread) > 0.5 > 0.1 > np.mean(even)


def test_dirichlet_size_keeps_each_clients_label_mix_the_datasets() -> None:
    """Labels are IID within each client: a chi-square test of each client's class counts
    against the global mix does not reject (p > 0.001 for all 10), where label skew
    (``dirichlet_class`` at alpha 0.5, the same sizes of data) rejects for every client."""
    labels = np.repeat(np.arange(10), [8000, 9000, 10000, 11000, 12000, 8000, 9000, 10000, 11000, 12000])
    global_mix = np.bincount(labels) / labels.size

    def p_values(partition: Any) -> np.ndarray:
        counts = partition.class_counts
        expected = counts.sum(axis=1, keepdims=True) * global_mix
        return np.array([stats.chisquare(row, row_expected).pvalue for row, row_expected in zip(counts, expected)])

    quantity = dirichlet_size(labels, 10, 10, DirichletSizeConfig(beta=0.5, min_size=500), rng(3))
    label_skew = dirichlet_class(labels, 10, 10, DirichletClassConfig(alpha=0.5), rng(3))

    assert quantity.sizes.max() > 3 * quantity.sizes.min()  # skewed sizes ...
    assert p_values(quantity).min() > 1e-3  # ... with the global label mix
    assert p_values(label_skew).max() < 1e-10


def test_dirichlet_size_is_the_same_for_a_seed_and_another_for_another() -> None:
    labels = balanced_labels(10, 50)
    config = DirichletSizeConfig(beta=0.5, min_size=5)

    first, again, other = (dirichlet_size(labels, 10, 10, config, rng(seed)) for seed in (7, 7, 8))

    assert same_split(first, again) and np.array_equal(first.class_counts, again.class_counts)
    assert not np.array_equal(first.sizes, other.sizes)


def test_an_impossible_min_size_is_one_line_saying_what_to_change() -> None:
    with pytest.raises(DataError) as raised:
        dirichlet_size(balanced_labels(10, 5), 10, 10, DirichletSizeConfig(min_size=6), rng(0))

    message = str(raised.value)
    assert "\n" not in message and "needs 60 samples but there are 50" in message
    assert "set min_size to at most 5" in message


def test_dirichlet_size_is_a_registered_partition_a_config_builds() -> None:
    document = copy.deepcopy(BASE)
    document["data"]["partition"] = {"name": "dirichlet_size", "beta": 0.5, "min_size": 20}
    config = validate_experiment(document)

    federation = build_federation(config.data, default_registry())

    assert config.data.partition.name == "dirichlet_size" and config.data.partition.beta == 0.5
    assert "dirichlet_size" in {entry.name for entry in default_registry().entries("partitioners")}
    sizes = federation.client_sizes  # training samples after each client's local test split
    assert len(sizes) == 4 and len(set(sizes.tolist())) > 1


# ---------------------------------------------------------------------- tune: draws and window


def history(values: list[float], metric: str = "val_accuracy") -> list[Any]:
    from fedplug.run.results import RoundRecord

    return [RoundRecord(round=number, accuracy=0.0, loss=0.0, client_accuracy_mean=0.0, client_accuracy_std=0.0,
                        bytes_up=0, bytes_down=0, cumulative_bytes=0, seconds=0.0, participants=1, failures=0,
                        metrics={metric: value}) for number, value in enumerate(values, 1)]


def test_select_window_scores_the_mean_of_the_last_rounds() -> None:
    space = {"train.optimizer.lr": [0.1]}
    window = TuneSpec(params=space, sampler="grid", select="window", window=2)

    assert tuning.objective_value(history([0.1, 0.5, 0.7, 0.9]), window) == pytest.approx(0.8)
    assert tuning.objective_value(history([0.1, 0.5, 0.7, 0.9]), TuneSpec(params=space, sampler="grid")) == 0.9
    assert tuning.objective_value(history([0.9, float("nan")]), window) == -math.inf  # a diverged round is the worst
    loss = TuneSpec(params=space, sampler="grid", select="window", window=3, metric="val_loss")
    assert tuning.objective_value(history([4.0, 3.0, 2.0, 1.0], "val_loss"), loss) == pytest.approx(2.0)


def hand_score(lr: float, draws: list[int], window: int) -> float:
    """A trial's score computed by hand: per draw, the mean val_accuracy of the last
    ``window`` rounds of the first cell's run with ``lr``; then the mean over draws."""
    per_draw = []
    for draw in draws:
        document = copy.deepcopy(BASE)
        document["data"].update(seed=draw, validation_fraction=0.2)
        document["train"].update(seed=0, optimizer={"name": "sgd", "lr": lr})
        result, _ = run_experiment(validate_experiment(document), None)
        per_draw.append(np.mean([record.metrics["val_accuracy"] for record in result.history[-window:]]))
    return float(np.mean(per_draw))


def test_a_trial_scores_the_mean_over_the_tuning_draws_of_its_window_mean(tmp_path: Path) -> None:
    scores = {lr: hand_score(lr, [100, 101], 2) for lr in LEARNING_RATES}
    best = max(scores, key=scores.__getitem__)
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": LEARNING_RATES},
                                  "draws": [100, 101], "select": "window", "window": 2}, draws=[0, 1]))
    trials_file = tmp_path / "tiny.trials.jsonl"

    runs = apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT,
                        trials_file=trials_file)

    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]
    assert chosen["params"] == {"train.optimizer.lr": best} and chosen["value"] == pytest.approx(scores[best])
    lines = load_trials(trials_file)
    assert {line["values"]["train.optimizer.lr"]: line["score"] for line in lines} == pytest.approx(scores)
    for line in lines:
        assert line["draws"] == [100, 101] and line["score"] == pytest.approx(np.mean(line["draw_scores"]))
        assert [len(curve) for curve in line["val_accuracy"]] == [3, 3]
        assert line["config"]["data"]["seed"] == 100  # never a reported draw
    # The study's runs train on the reported draws, with the choice.
    assert sorted({run.draw for run in runs}) == [0, 1]
    assert all(run.tuned == {"train.optimizer.lr": best} for run in runs)


@pytest.mark.parametrize(("tune", "changes", "expected"), [
    ({"draws": [1, 100]}, {"draws": [0, 1]}, "tune.draws: [1] is also reported (draws [0, 1]); tune on draws the study "
                                             "does not report"),
    ({"draws": [0]}, {}, "tune.draws: [0] is also reported (draws [0])"),
    ({"draws": [100, 100]}, {}, "give each data.seed once"),
    ({"select": "window"}, {}, "select: window needs `window:`"),
    ({"window": 5}, {}, "`window:` applies only to select: window"),
])
def test_a_tune_section_with_bad_draws_or_window_is_refused_in_one_line(tune: dict[str, Any], changes: dict[str, Any],
                                                                        expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]}, **tune}, **changes))

    assert expected in str(raised.value)


def test_a_window_longer_than_the_run_is_refused_before_anything_trains(tmp_path: Path) -> None:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]}, "select": "window",
                                  "window": 4}))

    with pytest.raises(ConfigError, match=r"tune.window 4 is more rounds than algorithm 'fedavg' trains \(3\)"):
        apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT)
    assert not (tmp_path / "out").exists()


def test_equal_trials_refuses_searches_of_different_budgets() -> None:
    algorithms = {"fedavg": {}, "fedprox": {"loss_transform": {"name": "fedprox", "mu": 0.01}}}
    tune = {"sampler": "grid", "params": {"train.optimizer.lr": [0.1, 0.3]}, "equal_trials": True,
            "algorithm_params": {"fedprox": {"train.loss_transform.mu": [0.01, 0.1]}}}
    spec = parse_study(spec_dict(tune, algorithms=algorithms))

    with pytest.raises(ConfigError) as raised:
        tuning.check_tune_params(spec, expand_study(spec))

    assert "\n" not in str(raised.value) and "(fedavg 2, fedprox 4)" in str(raised.value)
    capped = parse_study(spec_dict({**tune, "trials": 2}, algorithms=algorithms))
    tuning.check_tune_params(capped, expand_study(capped))  # 2 trials each: accepted


def test_the_committed_tuned_studies_keep_their_search_fingerprints() -> None:
    """Every search of every committed tuned study has the fingerprint its committed records
    keep, so their choices are still reused (no search runs on a fresh clone)."""
    checked = 0
    for path in sorted((ROOT / "pipelines/studies").glob("*.yaml")):
        data = read_yaml(path)
        results = ROOT / "pipelines/studies/results" / f"{path.stem}.jsonl"
        if path.stem == "dvc" or "tune" not in data or not results.is_file():
            continue  # not a study, not tuned, or not run yet (the benchmark, before its records)
        spec = parse_study(data, str(path))
        runs = expand_study(spec)
        kept = {tuning.search_key(spec, run): record["tuning"]["fingerprint"]
                for record in load_records(ROOT / "pipelines/studies/results" / f"{spec.name}.jsonl")
                if "tuning" in record for run in runs if run.run_id == record["run"]}
        for planned in tuning.searches(spec):
            run = tuning.tuning_run(spec, runs, planned.algorithm, planned.cell)
            assert search_fingerprint(tuning.algorithm_space(spec.tune, planned.algorithm), run.config) \
                == kept[planned.key], (spec.name, planned.key)
            checked += 1
    assert checked >= 30


def test_new_tune_fields_enter_a_fingerprint_only_when_set() -> None:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.1]}}))
    config = expand_study(spec)[0].config
    space = {"train.optimizer.lr": [0.1, 0.3]}
    plain = search_fingerprint(TuneSpec(params=space, sampler="grid"), config)

    assert search_fingerprint(TuneSpec(params=space, sampler="grid", equal_trials=True), config) == plain
    assert search_fingerprint(TuneSpec(params=space, sampler="grid", draws=[100]), config) != plain
    assert search_fingerprint(TuneSpec(params=space, sampler="grid", select="window", window=2), config) != plain


# ---------------------------------------------------------------------- every trial a record


def test_the_runner_keeps_every_trial_beside_the_results_file(tmp_path: Path) -> None:
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(
        {"sampler": "grid", "params": {"train.optimizer.lr": LEARNING_RATES}, "draws": [100, 101], "select": "window",
         "window": 2}, draws=[0])))
    out, results = tmp_path / "out", tmp_path / "tiny.jsonl"

    assert load_runner().main([str(spec_path), "--no-mlflow", "--jobs", "1", "--out", str(out), "--results",
                               str(results)]) == 0

    assert trials_path(results) == tmp_path / "tiny.trials.jsonl"
    lines = load_trials(trials_path(results))
    assert [line["trial"] for line in lines] == [0, 1, 2]
    assert sorted(line["values"]["train.optimizer.lr"] for line in lines) == sorted(LEARNING_RATES)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    tuned_on = expand_study(parse_study(read_yaml(spec_path)))[0].config
    for line in lines:
        assert line["study"] == "tiny" and line["search"] == "fedavg" and line["cell"] == {"clients": "4"}
        assert line["state"] == "complete" and line["reason"] is None and line["commit"] == commit
        assert isinstance(line["fedplug"], str) and isinstance(line["dirty"], bool)
        # The resolved config, every default filled in, as a run's config.yaml.
        expected = tuning.trial_config(tuned_on, parse_study(read_yaml(spec_path)).tune,
                                       line["values"], None, 100).model_dump(mode="json")
        assert line["config"] == expected and line["config"]["train"]["aggregator"]["name"] == "fedavg"
        assert len(line["val_accuracy"]) == 2 and all(len(curve) == 3 for curve in line["val_accuracy"])
        window_means = [np.mean(curve[-2:]) for curve in line["val_accuracy"]]
        assert line["draw_scores"] == pytest.approx(window_means, abs=1e-6)
    # The runs' records carry their resolved config, the chosen value in it.
    for record in load_records(results):
        assert record["config"] == yaml.safe_load((out / record["run"] / "config.yaml").read_text())
        assert record["config"]["train"]["optimizer"]["lr"] == record["tuned"]["train.optimizer.lr"]


REAL_TRAINER = tuning.federation_trainer
"""The trials' trainer, before any test wraps it."""


class Killed(Exception):
    """Stands for the process being killed mid-search."""


def counting_trainer(monkeypatch: pytest.MonkeyPatch, calls: list[Any], kill_at: int | None = None) -> None:
    """Wrap the trials' trainer: count its calls (one per trial and draw) and raise
    :class:`Killed` at call ``kill_at`` (1-based)."""
    real = REAL_TRAINER

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        train = real(*args, **kwargs)

        def counted(config: Any, observers: Any) -> Any:
            calls.append(config.train.optimizer.lr)
            if kill_at is not None and len(calls) == kill_at:
                raise Killed
            return train(config, observers)

        return counted

    monkeypatch.setattr(tuning, "federation_trainer", wrapped)


def test_an_interrupted_search_resumes_without_training_its_finished_trials_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": LEARNING_RATES},
                                  "draws": [100, 101], "select": "window", "window": 2}))
    runs = expand_study(spec)

    def tune(name: str) -> dict[str, Any]:
        apply_tuning(spec, runs, tmp_path / name, None, mlflow_root=None, fingerprint=FINGERPRINT,
                     trials_file=tmp_path / f"{name}.trials.jsonl")
        return json.loads((tmp_path / name / TUNED_NAME).read_text())["fedavg"]

    whole = tune("whole")
    # Killed in the third trial's first draw: trials 0 and 1 are lines, the third is not.
    calls: list[Any] = []
    counting_trainer(monkeypatch, calls, kill_at=5)
    with pytest.raises(Killed):
        tune("resumed")
    assert [line["trial"] for line in load_trials(tmp_path / "resumed.trials.jsonl")] == [0, 1]
    with (tmp_path / "resumed.trials.jsonl").open("ab") as handle:
        handle.write(b'{"study":"tiny","search":"fed')  # a line a kill cut off
    calls.clear()
    counting_trainer(monkeypatch, calls)
    capsys.readouterr()

    resumed = tune("resumed")

    assert "2 of 3 trials already recorded" in capsys.readouterr().out
    assert len(calls) == 2  # one trial, two draws
    for choice in (whole, resumed):
        choice.pop("seconds")
    assert resumed == whole
    # The grid's points in the order an uninterrupted search tried them, the cut line gone.
    first, second = (load_trials(tmp_path / f"{name}.trials.jsonl") for name in ("whole", "resumed"))
    assert [line["values"] for line in second] == [line["values"] for line in first]
    assert [line["score"] for line in second] == [line["score"] for line in first]
    assert (tmp_path / "resumed.trials.jsonl").read_bytes().count(b"\n") == 3


def test_failed_trials_are_records_with_their_reason_and_are_restored_as_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"data.num_clients": [1000, 4, 2000]}, "seed": 0}))
    trials_file = tmp_path / "tiny.trials.jsonl"

    def tune() -> dict[str, Any]:
        apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT,
                     trials_file=trials_file)
        return json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]

    first = tune()

    states = {line["values"]["data.num_clients"]: (line["state"], line["reason"], line["score"])
              for line in load_trials(trials_file)}
    assert states[4][0] == "complete" and states[4][2] == first["value"]
    for clients in (1000, 2000):
        state, reason, score = states[clients]
        assert state == "failed" and reason.startswith(TOO_MANY.format(clients)) and score is None
    # tuned.json lost: the search is rebuilt from the file, failed trials included; none trains.
    (tmp_path / "out" / TUNED_NAME).unlink()
    calls: list[Any] = []
    counting_trainer(monkeypatch, calls)
    again = tune()
    assert calls == [] and again["params"] == first["params"] and again["trials"] == 3
    assert len(load_trials(trials_file)) == 3


def test_pruned_trials_are_records_with_the_rounds_they_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As in test_study_tuning: lr 0.3 first, then lr 1e-6 pruned after round 1."""
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.3, 1e-6]},
                                  "seed": SEED_03_FIRST, "metric": "val_loss", "pruner": "median",
                                  "pruner_startup_trials": 1}))
    trials_file = tmp_path / "tiny.trials.jsonl"

    apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT,
                 trials_file=trials_file)

    complete, pruned = load_trials(trials_file)
    assert complete["state"] == "complete" and len(complete["val_loss"][0]) == 3
    assert pruned["state"] == "pruned" and pruned["values"] == {"train.optimizer.lr": 1e-6}
    assert len(pruned["val_loss"][0]) == 1 and pruned["score"] is None
    # Restored as pruned: no trial trains and the choice counts it.
    (tmp_path / "out" / TUNED_NAME).unlink()
    calls: list[Any] = []
    counting_trainer(monkeypatch, calls)
    apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT,
                 trials_file=trials_file)
    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]
    assert calls == [] and chosen["pruned"] == 1 and chosen["params"] == {"train.optimizer.lr": 0.3}


def test_a_tpe_search_resumes_from_its_recorded_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_study(spec_dict({"sampler": "tpe", "trials": 4, "seed": 3,
                                  "params": {"train.optimizer.lr": {"low": 0.01, "high": 1.0, "log": True}}}))
    trials_file = tmp_path / "tiny.trials.jsonl"
    calls: list[Any] = []
    counting_trainer(monkeypatch, calls, kill_at=3)
    with pytest.raises(Killed):
        apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT,
                     trials_file=trials_file)
    calls.clear()
    counting_trainer(monkeypatch, calls)

    apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT,
                 trials_file=trials_file)

    lines = load_trials(trials_file)
    assert len(calls) == 2 and [line["trial"] for line in lines] == [0, 1, 2, 3]
    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]
    best = max(lines, key=lambda line: line["score"])
    assert chosen["trials"] == 4 and chosen["params"] == best["values"] and chosen["value"] == best["score"]


# ---------------------------------------------------------------------- the edge rule


@pytest.mark.parametrize(("value", "space", "side"), [
    (0.05, [0.05, 0.1, 0.2], "low"),
    (0.2, [0.05, 0.1, 0.2], "high"),
    (0.1, [0.05, 0.1, 0.2], None),
    (0.1, [0.1], None),  # one value: no edge
    ("adam", ["sgd", "adam"], None),  # categories: no edge
    (0.0123, ParamRange(low=0.01, high=1.0, log=True), "low"),  # log position 0.045
    (0.0130, ParamRange(low=0.01, high=1.0, log=True), None),  # 0.057
    (0.80, ParamRange(low=0.01, high=1.0, log=True), "high"),  # 0.952
    (0.0404, ParamRange(low=0.0, high=0.99), "low"),  # linear position 0.041
    (0.0505, ParamRange(low=0.0, high=0.99), None),  # 0.051
    (0.95, ParamRange(low=0.0, high=0.99), "high"),  # 0.960
])
def test_edge_side_on_lists_as_the_page_and_within_5_percent_of_a_range(value: Any, space: Any,
                                                                         side: str | None) -> None:
    assert edge_side(value, space) == side
    if isinstance(space, list):  # the rule of the results page's "(grid edge)"
        assert (side is not None) == bool(_edge(value, space))


def test_a_choice_at_the_edge_is_said_in_one_line_and_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"train.optimizer.lr": [0.02, 0.3]}}))
    trials_file = tmp_path / "tiny.trials.jsonl"

    apply_tuning(spec, expand_study(spec), tmp_path / "out", None, mlflow_root=None, fingerprint=FINGERPRINT,
                 trials_file=trials_file)

    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]
    assert chosen["params"] == {"train.optimizer.lr": 0.3} and chosen["edge"] == {"train.optimizer.lr": True}
    assert ("tune fedavg: chosen at the edge of the search space: train.optimizer.lr 0.3 (the high end of "
            "[0.02, 0.3]); widen the space at that end and tune again") in capsys.readouterr().out.splitlines()
    assert all(line["edge"] == {"train.optimizer.lr": True} for line in load_trials(trials_file))


def test_a_tuned_json_entry_written_before_edge_existed_is_still_reused() -> None:
    entry = {"params": {"train.optimizer.lr": 0.1}, "value": 0.9, "trials": 5, "pruned": 0, "tuned_on": "x",
             "fingerprint": "abc", "seconds": 1.0}

    choice = tuning.stored_choice(entry, "abc")

    assert choice is not None and choice.edge == {} and choice.as_dict() == entry
    assert tuning.stored_choice({**entry, "edge": {"train.optimizer.lr": False}}, "abc") is not None
    assert tuning.stored_choice({**entry, "other": 1}, "abc") is None


# ---------------------------------------------------------------------- the DVC stage


def test_the_tuned_study_stage_declares_the_trials_file_beside_the_results_file() -> None:
    stages = yaml.safe_load((ROOT / "pipelines/studies/dvc.yaml").read_text())["stages"]
    study, tuned = stages["study"]["do"], stages["tuned_study"]["do"]

    assert {key: value for key, value in tuned.items() if key != "outs"} == \
        {key: value for key, value in study.items() if key != "outs"}
    assert tuned["outs"] == [*study["outs"], {"pipelines/studies/results/${key}.trials.jsonl":
                                              {"persist": True, "cache": False}}]
    assert not set(stages["tuned_study"]["foreach"]) & set(stages["study"]["foreach"])


def test_optuna_restores_a_grid_search_at_the_point_it_stopped() -> None:
    """The GridSampler gives trial n of a fresh study grid point n of its shuffled grid;
    restored trials 0..k-1 carry those ids, so trial k gets point k as it would have."""
    from fedplug.study.trials import frozen_trial

    tune = TuneSpec(params={"x": [1, 2, 3, 4]}, sampler="grid", seed=5)
    uninterrupted = optuna.create_study(sampler=tuning.make_sampler(tune))
    uninterrupted.optimize(lambda trial: float(trial.suggest_categorical("x", [1, 2, 3, 4])), n_trials=4)
    order = [trial.params["x"] for trial in uninterrupted.trials]
    resumed = optuna.create_study(sampler=tuning.make_sampler(tune))
    for number, x in enumerate(order[:2]):
        resumed.add_trial(frozen_trial({"trial": number, "state": "complete", "values": {"x": x}, "score": float(x)},
                                       tune, 3, tuning.FAILURE_ATTR))

    resumed.optimize(lambda trial: float(trial.suggest_categorical("x", [1, 2, 3, 4])), n_trials=2)

    assert [trial.params["x"] for trial in resumed.trials] == order
