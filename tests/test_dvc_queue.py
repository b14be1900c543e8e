"""DVC's own queue as the sweep runner of the default pipeline (docs/pipeline.md, "Parameter
sweeps with DVC's queue"), run for real in a temporary git repository holding the project's
pipeline on a tiny synthetic study (one algorithm, one seed, 2 rounds): a comma grid queues
one experiment per value, and two queued learning rates run on two workers
(``dvc queue start -j 2``), each with its params and metrics in ``dvc exp show`` and its
runs in the project's MLflow store (not in the temporary copy DVC runs it in)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_pipeline import REPO, VENV_BIN, dvc, environment, reproduced_project, tiny_params

LEARNING_RATES = ("0.01", "0.1")
"""The two queued values of ``train.optimizer.lr`` (the baseline commit trains with 0.5)."""
QUEUE_TIMEOUT_SECONDS = 600


def queue_params() -> dict[str, Any]:
    """The pipeline's tiny study with FedAvg alone: two experiments train in seconds."""
    params = tiny_params()
    params["study"]["name"] = "queue-test"
    params["algorithms"] = {"fedavg": {}}
    return params


def documented_command(prefix: str) -> list[str]:
    """The arguments of the command of docs/pipeline.md's section on DVC's queue whose line
    starts with ``prefix`` (its trailing comment dropped)."""
    section = (REPO / "docs" / "pipeline.md").read_text().split("### Parameter sweeps with DVC's queue")
    assert len(section) == 2, "docs/pipeline.md has no section 'Parameter sweeps with DVC's queue'"
    for line in section[1].splitlines():
        if line.startswith(prefix):
            return shlex.split(line, comments=True)
    raise AssertionError(f"docs/pipeline.md's queue section has no line starting with {prefix!r}")


def processes_in(folder: Path) -> list[psutil.Process]:
    """The processes whose working directory is inside ``folder`` (DVC's queue workers run
    in ``.dvc/tmp/exps/celery``, the experiments and their stages in ``.dvc/tmp/exps/<tmp>``)."""
    found = []
    for process in psutil.process_iter(["cwd"]):
        cwd = process.info.get("cwd")
        if cwd and Path(cwd).is_relative_to(folder) and process.pid != os.getpid():
            found.append(process)
    return found


def stop_queue(repo: Path) -> list[str]:
    """``dvc queue stop``, then wait for the workers to exit; kill (by PID) whatever still
    runs in ``repo`` a minute later. Returns the command lines that had to be killed."""
    subprocess.run(
        [str(VENV_BIN / "dvc"), "queue", "stop"],
        cwd=repo, env=environment(), capture_output=True, check=False, timeout=120,
    )
    deadline = time.monotonic() + 60
    while processes_in(repo) and time.monotonic() < deadline:
        time.sleep(2)
    leftovers = processes_in(repo)
    killed = []
    for process in leftovers:
        try:
            killed.append(" ".join(process.cmdline()))
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=10)
    return killed


def queue_states(repo: Path) -> dict[str, str]:
    """Experiment name -> its state in ``dvc queue status`` (Queued, Running, Success,
    Failed); empty when DVC is busy (the repository lock) and the call fails."""
    completed = subprocess.run(
        [str(VENV_BIN / "dvc"), "queue", "status"],
        cwd=repo, env=environment(), capture_output=True, text=True, check=False, timeout=120,
    )
    states = {}
    for line in completed.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[-1] in ("Queued", "Running", "Success", "Failed"):
            states[fields[1]] = fields[-1]
    return states


def experiments(repo: Path) -> dict[str, dict[str, Any]]:
    """Experiment name -> ``{"params": params.yaml's values, "metrics": summary.json's}``
    of the experiments ``dvc exp show --json`` lists on the checked-out commit."""
    shown = {}
    for row in json.loads(dvc(repo, "exp", "show", "--json")):
        for experiment in row.get("experiments") or []:
            for revision in experiment.get("revs", []):
                data = revision.get("data") or {}
                params = (data.get("params") or {}).get("params.yaml", {}).get("data", {})
                metrics = (data.get("metrics") or {}).get("reports/summary.json", {}).get("data", {})
                shown[revision.get("name") or experiment.get("name")] = {
                    "params": params,
                    "metrics": metrics,
                }
    return shown


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A git repository holding the pipeline and the tiny study, reproduced once (the
    baseline a sweep starts from). Nothing runs in it any more when the module ends."""
    root = tmp_path_factory.mktemp("queue")
    reproduced_project(root, queue_params())
    yield root
    stop_queue(root)


@pytest.mark.slow
def test_a_comma_grid_queues_one_experiment_per_value(repo: Path) -> None:
    # The documented grid: three values of train.optimizer.lr, named lr-1, lr-2, lr-3.
    output = dvc(repo, *documented_command("dvc exp run --queue -S 'train")[1:])
    names = ["lr-1", "lr-2", "lr-3"]
    try:
        assert output.count("Queued experiment") == 3, output
        assert {name: queue_states(repo).get(name) for name in names} == dict.fromkeys(names, "Queued")
        shown = experiments(repo)
        assert [shown[name]["params"]["train"]["optimizer"]["lr"] for name in names] == [0.01, 0.05, 0.1]
    finally:
        dvc(repo, "queue", "remove", *names)
    assert not set(names) & set(queue_states(repo))


@pytest.mark.slow
def test_two_queued_learning_rates_run_on_two_workers_into_the_projects_store(repo: Path) -> None:
    from mlflow.tracking import MlflowClient

    # Prepare: one queued experiment per learning rate.
    names = {lr: f"lr-{lr}" for lr in LEARNING_RATES}
    for lr, name in names.items():
        dvc(repo, "exp", "run", "--queue", "-S", f"train.optimizer.lr={lr}", "-n", name)
    assert {queue_states(repo).get(name) for name in names.values()} == {"Queued"}

    # Execute: two workers; DVC daemonises them, so keep them off this process's pipes.
    started = time.monotonic()
    subprocess.run(
        [str(VENV_BIN / "dvc"), "queue", "start", "-j", "2"],
        cwd=repo, env=environment(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, check=True, timeout=120,
    )
    states: dict[str, str] = {}
    try:
        while time.monotonic() - started < QUEUE_TIMEOUT_SECONDS:
            states = {name: queue_states(repo).get(name, "?") for name in names.values()}
            if all(state in ("Success", "Failed") for state in states.values()):
                break
            time.sleep(3)
    finally:
        killed = stop_queue(repo)
    if set(states.values()) != {"Success"}:
        logs = "\n".join(
            subprocess.run(
                [str(VENV_BIN / "dvc"), "queue", "logs", name],
                cwd=repo, env=environment(), capture_output=True, text=True, check=False,
            ).stdout
            for name in names.values()
        )
        pytest.fail(f"queued experiments did not all succeed: {states}\n{logs}")
    print(f"two queued experiments took {time.monotonic() - started:.0f} s")
    assert not killed, f"processes still running after `dvc queue stop`: {killed}"

    # Assert: DVC recorded each experiment with its learning rate and its metrics.
    shown = experiments(repo)
    for lr, name in names.items():
        assert shown[name]["params"]["train"]["optimizer"]["lr"] == float(lr)
        assert set(shown[name]["metrics"]) == {"fedavg"}
    accuracies = {lr: shown[name]["metrics"]["fedavg"]["final_accuracy"] for lr, name in names.items()}
    assert accuracies["0.01"] != accuracies["0.1"]
    # The documented table: one row per experiment, its learning rate and accuracy.
    table = dvc(repo, *documented_command("dvc exp show")[1:])
    for lr, name in names.items():
        (row,) = [line for line in table.splitlines() if f"[{name}]" in line]
        assert row.split()[-2:] == [f"{accuracies[lr]:.5g}", lr], table

    # ... and the project's store holds both, under one parent per experiment, with the
    # same final accuracy DVC recorded.
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("queue-test")
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    children = []
    for lr, name in names.items():
        (parent,) = [run for run in runs if run.info.run_name == name]
        assert parent.info.status == "FINISHED" and parent.data.tags["dvc.exp_name"] == name
        (child,) = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert child.info.run_name == f"fedavg-seed0@{name}"
        assert float(child.data.params["train.optimizer.lr"]) == float(lr)
        assert child.data.metrics["final_accuracy"] == pytest.approx(accuracies[lr])
        assert child.info.artifact_uri.startswith((repo / "mlruns").as_uri())
        children.append(child.info)
    # Two workers: the two trainings overlapped in time.
    first, second = sorted(children, key=lambda info: info.start_time)
    assert second.start_time < first.end_time
    assert not list((repo / ".dvc" / "tmp").glob("exps/**/mlflow.db"))
