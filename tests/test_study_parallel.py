"""Studies on Ray (``run_study.py --jobs N`` / ``--address``): the runs of a tiny study
trained as Ray tasks, on a local Ray and on a real two-node cluster on this machine, give
the sequential runner's results, each federation built once per node; a failing run is
recorded and retried on request; a worker killed mid-run resumes its run; an unreachable
cluster is one line."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_study import BASE, load_runner

from fedplug.errors import ConfigError
from fedplug.run.checkpoint import read_checkpoint
from fedplug.study.parallel import (
    FAILED_NAME,
    RunOutcome,
    RunProgress,
    check_reachable,
    updated_failures,
)

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "pipelines" / "studies" / "run_study.py"
TIMING_KEYS = frozenset({"seconds", "total_seconds", "setup_seconds", "train_seconds", "started_at", "finished_at"})
"""Wall times and clock times: the only numbers a parallel run may change."""
RUN_IDS = ["0.5__fedavg__d0s0", "0.5__fedavg__d0s1", "0.5__fedavgm__d0s0", "0.5__fedavgm__d0s1"]


def without_timing(value: Any) -> Any:
    """``value`` with every wall-time entry dropped, at any depth."""
    if isinstance(value, dict):
        return {key: without_timing(item) for key, item in value.items() if key not in TIMING_KEYS}
    if isinstance(value, list):
        return [without_timing(item) for item in value]
    return value


def spec_file(tmp_path: Path, rounds: int = 3, draws: list[int] | None = None, **base_changes: Any) -> Path:
    """A 4-run study on the synthetic dataset: 2 algorithms x 2 seeds on one partition
    draw (:data:`RUN_IDS`), or x 2 ``draws`` (2 data configs) with seed 0."""
    base = copy.deepcopy(BASE)
    base["train"]["rounds"] = rounds
    for section, changes in base_changes.items():
        base[section].update(changes)
    spec = {"name": "tiny", "base": base, "grid": {"alpha": {"0.5": {"data.partition.alpha": 0.5}}},
            "algorithms": {"fedavg": {}, "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.5}}},
            "seeds": [0, 1] if draws is None else [0], "plots": []}
    if draws is not None:
        spec["draws"] = draws
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def study_outputs(out: Path, results: Path, run_ids: list[str] = RUN_IDS) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each run's metrics.json and the results file's records, without wall times."""
    metrics = {run_id: without_timing(json.loads((out / run_id / "metrics.json").read_text())) for run_id in run_ids}
    records = [without_timing(json.loads(line)) for line in results.read_text().splitlines()]
    return metrics, records


@pytest.fixture(scope="module")
def sequential(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The tiny study trained by the sequential runner (``--jobs 1``), the reference."""
    folder = tmp_path_factory.mktemp("sequential")
    out, results = folder / "out", folder / "results.jsonl"
    assert load_runner().main([str(spec_file(folder)), "--no-mlflow", "--jobs", "1", "--out", str(out),
                               "--results", str(results)]) == 0
    assert not any((out / run_id / "provenance.json").read_text().count("ray_node") for run_id in RUN_IDS)
    return study_outputs(out, results)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """A real Ray cluster of two nodes (one CPU each) on this machine."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    # Cluster records its address for a bare ray.init() to join (/tmp/ray/ray_current_cluster):
    # forget it, or Flower simulations of other tests (make test's other worker) would land here.
    from ray._common.utils import reset_ray_address

    reset_ray_address()
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def recorded_outcomes(monkeypatch: pytest.MonkeyPatch) -> list[RunOutcome]:
    """The :class:`RunOutcome` of every run the runner trains on Ray from now on."""
    from fedplug.study import parallel

    outcomes: list[RunOutcome] = []
    train_on_ray = parallel.train_on_ray

    def recording(*args: Any, **kwargs: Any) -> list[RunOutcome]:
        these = train_on_ray(*args, **kwargs)
        outcomes.extend(these)
        return these

    monkeypatch.setattr(parallel, "train_on_ray", recording)  # the runner imports it when it trains
    return outcomes


# ------------------------------------------------------------------------------ pure pieces


def test_updated_failures_adds_failed_runs_and_drops_finished_ones() -> None:
    previous = {"b": {"error": "old", "when": "t0"}, "c": {"error": "x", "when": "t0"}}
    outcomes = [RunOutcome("a", None, "boom", "Traceback ...", None, 1.0),
                RunOutcome("b", None, "new", None, None, 1.0),
                RunOutcome("c", {"final_accuracy": 0.5}, None, None, "node", 1.0)]

    updated = updated_failures(previous, outcomes, when="t1")

    assert updated == {"a": {"error": "boom", "when": "t1", "traceback": "Traceback ..."},
                       "b": {"error": "new", "when": "t1"}}
    assert list(updated) == ["a", "b"]


def test_progress_without_a_terminal_prints_one_line_per_run(tmp_path: Path) -> None:
    with (tmp_path / "log").open("w") as stream:
        progress = RunProgress(2, stream)
        progress.update(RunOutcome("r1", {"final_accuracy": 0.91234}, None, None, "n", 12.4))
        progress.update(RunOutcome("r2", None, "ConfigError: bad", None, None, 3.0))
        progress.close()

    assert (tmp_path / "log").read_text().splitlines() == [
        "[1/2] r1: final accuracy 0.9123, 12 s", "[2/2] r2: FAILED: ConfigError: bad"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_an_unreachable_address_is_one_line_before_anything_trains(tmp_path: Path, scheme: str) -> None:
    address = f"{scheme}127.0.0.1:{free_port()}"
    out = tmp_path / "out"

    with pytest.raises(ConfigError) as refused:
        load_runner().main([str(spec_file(tmp_path)), "--no-mlflow", "--out", str(out), "--address", address])

    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"cannot reach the Ray cluster at {address}: ")
    assert message.endswith("start one with `ray start --head` or drop --address")
    assert not any((out / run_id).exists() for run_id in RUN_IDS)
    check_reachable("auto")  # left to Ray, which answers at once


# ------------------------------------------------------------------------------ on Ray


@pytest.mark.slow
def test_runs_land_on_both_nodes_of_a_cluster_and_equal_the_sequential_runs(
    tmp_path: Path, two_nodes: Any, sequential: tuple[dict[str, Any], list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the nodes were started before: the runs get the uri passed
    out, results = tmp_path / "out", tmp_path / "results.jsonl"
    outcomes = recorded_outcomes(monkeypatch)

    assert load_runner().main([str(spec_file(tmp_path)), "--out", str(out), "--results", str(results),
                               "--address", two_nodes.address]) == 0

    assert study_outputs(out, results) == sequential
    nodes = {json.loads((out / run_id / "provenance.json").read_text())["ray_node"] for run_id in RUN_IDS}
    assert nodes == {node.node_id for node in two_nodes.list_all_nodes()} and len(nodes) == 2
    # The runs' one data config was built once on each node, then read from that node.
    assert sorted(outcome.run_id for outcome in outcomes) == RUN_IDS
    assert Counter(outcome.node for outcome in outcomes if outcome.federation == "built") == dict.fromkeys(nodes, 1)
    assert {outcome.federation for outcome in outcomes} <= {"built", "node", "process"}
    # Every run is a child of the study's one parent run in the one MLflow store.
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("study-tiny").experiment_id])
    parents = [run for run in runs if "fedplug.parent" in run.data.tags]
    children = [run for run in runs if "mlflow.parentRunId" in run.data.tags]
    assert len(parents) == 1 and len(runs) == 5
    assert sorted(run.info.run_name for run in children) == RUN_IDS
    assert {run.data.tags["mlflow.parentRunId"] for run in children} == {parents[0].info.run_id}
    assert {run.info.status for run in runs} == {"FINISHED"}
    for child in children:
        steps = [metric.step for metric in client.get_metric_history(child.info.run_id, "accuracy")]
        assert sorted(steps) == [1, 2, 3]


@pytest.mark.slow
def test_a_failing_run_is_recorded_the_others_finish_and_retry_failed_trains_it(
    tmp_path: Path, two_nodes: Any, sequential: tuple[dict[str, Any], list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch
    from test_study import write_run_folder

    from fedplug.study import expand_study, parse_study

    # Prepare: one run folder holds a checkpoint of another federation (its config.yaml matches).
    spec_path = spec_file(tmp_path)
    out, results = tmp_path / "out", tmp_path / "results.jsonl"
    broken = next(run for run in expand_study(parse_study(yaml.safe_load(spec_path.read_text())))
                  if run.run_id == RUN_IDS[1])
    write_run_folder(out / broken.run_id, broken.config.model_dump(mode="json"), metrics=False)
    torch.save({"version": 1, "fingerprint": "0" * 16, "history": []}, out / broken.run_id / "checkpoint.pt")
    command = [str(spec_path), "--no-mlflow", "--out", str(out), "--results", str(results),
               "--address", two_nodes.address]

    # Execute / Assert: recorded with the runner's own one-line reason, the others trained.
    assert load_runner().main(command) == 1
    failures = json.loads((out / FAILED_NAME).read_text())
    assert list(failures) == [broken.run_id]
    assert failures[broken.run_id]["error"].startswith(f"run {broken.run_id}: checkpoint ")
    assert "traceback" not in failures[broken.run_id]  # a fedplug error says what to fix itself
    assert [json.loads(line)["run"] for line in results.read_text().splitlines()] == [
        run_id for run_id in RUN_IDS if run_id != broken.run_id]
    assert f"run {broken.run_id} FAILED: run {broken.run_id}: checkpoint " in capsys.readouterr().err

    # Later invocations skip it with one line ...
    assert load_runner().main(command) == 0
    assert f"skipping 1 runs that failed before (listed in {out / FAILED_NAME}), e.g. {broken.run_id}: " \
        in capsys.readouterr().out
    # ... until --retry-failed (here with the cause fixed by --redo-mismatched) trains it.
    assert load_runner().main([*command, "--retry-failed", "--redo-mismatched"]) == 0
    assert not (out / FAILED_NAME).exists()
    assert study_outputs(out, results) == sequential


@pytest.mark.slow
def test_two_workers_of_one_node_build_each_data_config_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 2 partition draws (2 data configs) x 2 algorithms, the sequential reference.
    spec_path = spec_file(tmp_path, draws=[0, 1])
    run_ids = [f"0.5__{algorithm}__d{draw}s0" for draw in (0, 1) for algorithm in ("fedavg", "fedavgm")]
    reference, reference_results = tmp_path / "reference", tmp_path / "reference.jsonl"
    assert load_runner().main([str(spec_path), "--no-mlflow", "--jobs", "1", "--out", str(reference),
                               "--results", str(reference_results)]) == 0
    out, results = tmp_path / "out", tmp_path / "results.jsonl"
    outcomes = recorded_outcomes(monkeypatch)

    # Execute: two runs at a time on a local Ray (one node, two worker processes).
    assert load_runner().main([str(spec_path), "--no-mlflow", "--jobs", "2", "--out", str(out),
                               "--results", str(results)]) == 0

    # Assert: the two runs of a draw start together, yet its federation is built once.
    assert sorted(outcome.run_id for outcome in outcomes) == sorted(run_ids)
    built = [outcome.run_id.split("__")[-1] for outcome in outcomes if outcome.federation == "built"]
    assert sorted(built) == ["d0s0", "d1s0"]
    assert {outcome.federation for outcome in outcomes} <= {"built", "node", "process"}
    assert study_outputs(out, results, run_ids) == study_outputs(reference, reference_results, run_ids)


@pytest.mark.slow
def test_a_federation_its_node_cannot_build_fails_its_runs_with_the_data_error(tmp_path: Path) -> None:
    spec_path = spec_file(tmp_path, data={"num_clients": 400})  # the synthetic dataset has 300 samples
    out = tmp_path / "out"

    assert load_runner().main([str(spec_path), "--no-mlflow", "--jobs", "2", "--out", str(out),
                               "--results", str(tmp_path / "results.jsonl")]) == 1

    failures = json.loads((out / FAILED_NAME).read_text())
    assert sorted(failures) == RUN_IDS
    for failure in failures.values():  # the holder's DataError, one line, as without Ray
        assert failure["error"] == "data.num_clients is 400 but dataset 'synthetic' has only 300 training " \
            "samples; use fewer clients"
        assert "traceback" not in failure


def run_folder_pid(folder: Path) -> int | None:
    """The process id the run folder's lock names (the Ray worker training it)."""
    try:
        return int((folder / ".fedplug-output.lock").read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_a_worker_killed_mid_run_resumes_its_run_from_the_checkpoint(tmp_path: Path) -> None:
    # Prepare: runs long enough (40 rounds) to be caught between two checkpoints, a local
    # Ray started (and stopped) by the runner itself; the sequential reference first.
    slow = {"dataset": {"name": "synthetic", "num_train": 2000, "num_test": 200, "num_features": 32,
                        "num_classes": 4}}
    spec_path = spec_file(tmp_path, rounds=40, data=slow, train={"model": {"name": "mlp", "hidden": [64]}})
    reference, results = tmp_path / "reference", tmp_path / "reference.jsonl"
    assert load_runner().main([str(spec_path), "--no-mlflow", "--jobs", "1", "--out", str(reference),
                               "--results", str(results)]) == 0
    out = tmp_path / "out"
    victim = out / RUN_IDS[0]
    driver = subprocess.Popen([sys.executable, str(RUNNER), str(spec_path), "--no-mlflow", "--jobs", "2", "--out",
                               str(out), "--results", str(tmp_path / "results.jsonl")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        # Execute: kill the worker training the first run once a round is checkpointed.
        deadline = time.monotonic() + 240
        while not (victim / "checkpoint.pt").exists() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.01)
        killed = run_folder_pid(victim)
        assert killed is not None and not (victim / "metrics.json").exists(), "the run ended before it was caught"
        os.kill(killed, signal.SIGKILL)
        before = read_checkpoint(victim / "checkpoint.pt")["history"]  # what the killed worker had saved
        output, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    # Assert: another process finished the run from the checkpoint (the rounds trained before
    # the kill keep the killed worker's own wall times), and it equals the reference.
    assert driver.returncode == 0, output
    assert run_folder_pid(victim) != killed
    history = json.loads((victim / "metrics.json").read_text())["history"]
    assert 1 <= len(before) < 40 and [round_["seconds"] for round_ in history[:len(before)]] == [
        round_["seconds"] for round_ in before]
    assert study_outputs(out, tmp_path / "results.jsonl") == study_outputs(reference, results)
    assert not (out / FAILED_NAME).exists()
