"""The DVC pipeline, run for real in a temporary git repository on a tiny synthetic study
(2 algorithms, one of them FedDisk, 2 rounds): outputs, metrics, plots, experiments, which
stages a params change reruns, the MLflow runs nested under their DVC experiment, a queued
experiment and a copied project logging to their own store. Plus the report's pure
functions and the store relocation (fast)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedplug.errors import DataError
from fedplug.report import (
    comparison_markdown,
    curve_rows,
    format_bytes,
    ranked,
    run_metrics_from_summary,
    summarize,
    summary_metrics,
    wall_time_markdown,
    write_report,
)
from fedplug.run.results import rounds_to_target, split_wall_clock

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
# The pipeline's files; of pipelines/ only the stage scripts (other pipelines, such as the
# paper studies in pipelines/studies/, have their own dvc.yaml and are not part of it).
PROJECT_FILES = (
    "dvc.yaml",
    ".dvcignore",
    *(f"pipelines/{path.name}" for path in sorted((REPO / "pipelines").glob("*.py"))),
    "fedplug",
    ".dvc/config",
    ".dvc/.gitignore",
    ".dvc/plots",
)
TRAIN_STAGES = {"train@fedavg-0", "train@feddisk-0"}


# ------------------------------------------------------------------ report (fast)


def history(*accuracies: float, bytes_per_round: int = 100) -> list[dict[str, Any]]:
    return [
        {
            "round": index + 1,
            "accuracy": accuracy,
            "loss": 1.0,
            "cumulative_bytes": bytes_per_round * (index + 1),
        }
        for index, accuracy in enumerate(accuracies)
    ]


def run(
    algorithm: str, seed: int, *accuracies: float, seconds: float = 10.0, setup: float = 0.0
) -> Any:
    summary = {
        "history": history(*accuracies),
        "total_bytes": 100 * len(accuracies),
        "total_seconds": seconds,
    }
    return run_metrics_from_summary(algorithm, seed, summary, setup_seconds=setup)


def test_rounds_to_target_is_the_first_round_at_or_above_it() -> None:
    assert rounds_to_target(history(0.5, 0.9, 0.85, 0.95), 0.9) == 2
    assert rounds_to_target(history(0.5, 0.6), 0.9) is None
    # metrics.json writes a NaN accuracy as null: such a round never reaches the target.
    assert rounds_to_target([{"round": 1, "accuracy": None}, {"round": 2, "accuracy": 0.9}], 0.9) == 2


def test_summaries_average_seeds_and_count_who_reached_the_target() -> None:
    runs = [
        run("b", 1, 0.6, 0.8),
        run("a", 0, 0.5, 0.95, 0.9),
        run("b", 0, 0.7, 0.92, seconds=20.0, setup=4.0),
    ]
    a, b = summarize(runs, target=0.9)
    assert (a.algorithm, b.algorithm) == ("b", "a")  # order of first appearance
    assert a.seeds == [0, 1]  # seeds sorted
    assert a.final_accuracy == [0.92, 0.8]
    assert a.rounds_to_target == [2, None]
    assert a.wall_seconds == [24.0, 10.0]
    metrics = summary_metrics([a, b])
    assert metrics["b"]["final_accuracy"] == pytest.approx((0.92 + 0.8) / 2)
    assert metrics["b"]["rounds_to_target"] == 2.0  # mean over the seeds that reached it
    assert metrics["a"] == {
        "final_accuracy": 0.9,
        "best_accuracy": 0.95,
        "rounds_to_target": 2.0,
        "total_bytes": 300,
    }
    # Ranked by mean final accuracy: a (0.90) above b (0.86), whatever the input order.
    table = comparison_markdown([a, b], 0.9, "t")
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows == [
        "| 1 | a | 0 | 0.9000 | 0.9500 | 2 | 300 B |",
        "| 2 | b | 0, 1 | 0.8600 ± 0.0600 | 0.8600 ± 0.0600 | 2 (1/2 seeds) | 200 B |",
    ]
    assert "rounds to 90%" in table and " s |" not in table  # no measured time in it
    # The wall times (setup included: b's seed 0 ran 20 s + 4 s of density) are apart.
    assert "| b | 0, 1 | 17.0 s |" in wall_time_markdown([a, b], "t")


def test_ranking_breaks_ties_by_best_accuracy_and_puts_runs_without_rounds_last() -> None:
    summaries = summarize(
        [run("empty", 0), run("x", 0, 0.9, 0.8), run("y", 0, 0.7, 0.8), run("z", 0, 0.5, 0.85)],
        target=0.9,
    )
    assert [summary.algorithm for summary in ranked(summaries)] == ["z", "x", "y", "empty"]


def test_split_wall_clock_keeps_everything_but_the_measured_times() -> None:
    summary = {
        "final_accuracy": 0.5,
        "total_seconds": 3.5,
        "setup_seconds": 1.0,
        "history": [{"round": 1, "accuracy": 0.5, "seconds": 1.5}, {"round": 2, "seconds": 2.0}],
    }
    reproducible, timings = split_wall_clock(summary)
    assert reproducible == {"final_accuracy": 0.5, "history": [{"round": 1, "accuracy": 0.5}, {"round": 2}]}
    assert timings == {"total_seconds": 3.5, "setup_seconds": 1.0, "round_seconds": [1.5, 2.0]}
    assert summary["history"][0]["seconds"] == 1.5  # the input is not changed


def test_format_bytes_uses_decimal_units() -> None:
    assert [format_bytes(x) for x in (999, 1000, 47_810_400, 2.5e9)] == [
        "999 B",
        "1.0 kB",
        "47.8 MB",
        "2.5 GB",
    ]


def test_curve_rows_are_long_format_and_metrics_need_a_history(tmp_path: Path) -> None:
    rows = curve_rows([run("a", 3, 0.5, 0.6)])
    assert rows == [
        {
            "algorithm": "a",
            "seed": 3,
            "round": 1,
            "accuracy": 0.5,
            "loss": 1.0,
            "cumulative_bytes": 100,
        },
        {
            "algorithm": "a",
            "seed": 3,
            "round": 2,
            "accuracy": 0.6,
            "loss": 1.0,
            "cumulative_bytes": 200,
        },
    ]
    with pytest.raises(DataError, match="history"):
        run_metrics_from_summary("a", 0, {"final_accuracy": 1.0})
    with pytest.raises(DataError, match="no runs"):
        write_report([], tmp_path, 0.9, "t")


def test_write_report_writes_the_four_files(tmp_path: Path) -> None:
    files = write_report(
        [run("a", 0, 0.5, 0.7), run("b", 0, 0.6, 0.8)], tmp_path / "r", 0.75, "Study"
    )
    assert json.loads(files.summary.read_text())["b"]["rounds_to_target"] == 2
    assert files.curves_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        files.curves_csv.read_text().splitlines()[0]
        == "algorithm,seed,round,accuracy,loss,cumulative_bytes"
    )
    assert files.comparison.read_text().startswith("# Study")


def test_a_copied_store_points_its_artifacts_at_itself(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from fedplug.project import ensure_experiment, relocate_local_store, relocate_project_store

    original, copied = tmp_path / "original", tmp_path / "copied"
    original.mkdir()
    uri = f"sqlite:///{original / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = ensure_experiment(client, "study", uri)
    run_id = client.create_run(experiment_id).info.run_id
    (tmp_path / "note.txt").write_text("hello")
    client.log_artifact(run_id, str(tmp_path / "note.txt"))
    assert client.get_run(run_id).info.artifact_uri.startswith((original / "mlruns").as_uri())
    relocate_local_store(uri)  # MLflow's default experiment: ./mlruns/0 of the cwd -> the store's
    assert relocate_local_store(uri) == 0  # now every path is its own
    assert client.get_run(run_id).info.artifact_uri.startswith((original / "mlruns").as_uri())
    shutil.copytree(original, copied)

    copied_uri = f"sqlite:///{copied / 'mlflow.db'}"
    # Only a project's own store is rewritten: this one is not <tmp_path>/mlflow.db.
    assert relocate_project_store(copied_uri, tmp_path) == 0
    assert relocate_project_store(copied_uri, copied) >= 1
    assert relocate_local_store(copied_uri) == 0
    copy_client = MlflowClient(tracking_uri=copied_uri)
    assert copy_client.get_run(run_id).info.artifact_uri == (
        copied / "mlruns" / run_id / "artifacts"
    ).as_uri()
    assert copy_client.get_experiment(experiment_id).artifact_location == (copied / "mlruns").as_uri()
    # MLflow's default experiment (created with the cwd's ./mlruns/0) follows too.
    assert copy_client.get_experiment("0").artifact_location.startswith(str(copied / "mlruns"))
    downloaded = copy_client.download_artifacts(run_id, "note.txt", str(tmp_path))
    assert Path(downloaded).read_text() == "hello"
    # The original still points at itself.
    assert client.get_run(run_id).info.artifact_uri.startswith((original / "mlruns").as_uri())


def test_project_root_follows_dvc_root_and_group_names_the_experiment(tmp_path: Path) -> None:
    import sys

    from fedplug.project import project_root

    sys.path.insert(0, str(REPO / "pipelines"))
    from common import dvc_run_group

    assert project_root("sub/params.yaml", environ={}) == (Path.cwd() / "sub").resolve()
    assert project_root("params.yaml", environ={"DVC_ROOT": str(tmp_path)}) == tmp_path
    experiment = dvc_run_group(
        tmp_path, {"DVC_EXP_NAME": "lucky-cat", "DVC_EXP_BASELINE_REV": "0123456789abcdef"}
    )
    assert (experiment.key, experiment.label) == ("dvc-exp:lucky-cat@0123456", "lucky-cat")
    assert experiment.tags == {"dvc.exp_name": "lucky-cat", "dvc.baseline_rev": "0123456789abcdef"}
    outside_git = dvc_run_group(tmp_path, {})
    assert (outside_git.key, outside_git.label) == ("dvc-repro:no-git", "repro")


# -------------------------------------------------------------- DVC (slow, real)


def tiny_params() -> dict[str, Any]:
    # DVC requires every param a stage lists to be spelled out in params.yaml.
    return {
        "study": {"name": "pipeline-test", "seeds": [0], "target_accuracy": 0.5},
        "tracking": {"uri": None, "fallback_to_local": False},
        "data": {
            "dataset": {
                "name": "synthetic",
                "num_train": 400,
                "num_test": 100,
                "num_features": 6,
                "num_classes": 3,
                "class_separation": 3.0,
            },
            "partition": {"name": "dirichlet_class", "alpha": 1.0, "min_size": 10},
            "num_clients": 3,
            "local_test_fraction": 0.2,
            "seed": 0,
            "root": "data/raw",
        },
        "train": {
            "model": {"name": "logreg"},
            # The setup stage reads all four slots (any of them may have a setup phase).
            "sampler": {"name": "uniform"},
            "loss_transform": {"name": "cross_entropy"},
            "aggregator": {"name": "fedavg"},
            "grouper": {"name": "none"},
            "device": "cpu",
            "rounds": 2,
            "batch_size": 20,
            "optimizer": {"name": "sgd", "lr": 0.5},
        },
        "algorithms": {
            "fedavg": {},
            "feddisk": {
                "loss_transform": {
                    "name": "feddisk",
                    "made_hidden": 4,
                    "made_max_epochs": 1,
                    "global_rounds": 1,
                    "classifier_epochs": 1,
                }
            },
        },
    }


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",  # the stages' `python` is the venv's
        MLFLOW_DISABLE_TELEMETRY="true",
        DVC_NO_ANALYTICS="1",
        DO_NOT_TRACK="1",
        GIT_AUTHOR_NAME="test",
        GIT_AUTHOR_EMAIL="test@example.com",
        GIT_COMMITTER_NAME="test",
        GIT_COMMITTER_EMAIL="test@example.com",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def sh(repo: Path, *command: str) -> str:
    """Run a command in ``repo``; fail the test with its output when it fails."""
    completed = subprocess.run(
        command,
        cwd=repo,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if completed.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} exited {completed.returncode}:\n{completed.stdout}\n{completed.stderr}"
        )
    return completed.stdout + completed.stderr


def dvc(repo: Path, *arguments: str) -> str:
    return sh(repo, str(VENV_BIN / "dvc"), *arguments)


def ran(output: str) -> set[str]:
    """The stages a `dvc repro` output says it ran."""
    return {
        line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")
    }


def changed(repo: Path) -> set[str]:
    """The stages `dvc status` reports as changed."""
    return set(json.loads(dvc(repo, "status", "--json")))


def set_params(repo: Path, change: Any) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    change(params)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def reproduced_project(root: Path, params: dict[str, Any]) -> str:
    """The project's pipeline files in ``root`` with ``params`` as its params.yaml, a git
    repository committed before and after one ``dvc repro``; that repro's output."""
    for name in PROJECT_FILES:
        source, target = REPO / name, root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copy2(REPO / ".gitignore", root / ".gitignore")  # the project's: what stays out of git
    sh(root, "git", "init", "-q")
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "pipeline")
    output = dvc(root, "repro")
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "reproduced")
    return output


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A git repository holding the pipeline and a tiny study, reproduced once."""
    root = tmp_path_factory.mktemp("pipeline")
    output = reproduced_project(root, tiny_params())
    assert ran(output) == {"download", "partition", "setup", "evaluate"} | TRAIN_STAGES
    yield root


@pytest.mark.slow
def test_repro_writes_every_output_and_dvc_reads_metrics_and_plots(repo: Path) -> None:
    for path in (
        "data/raw/manifest.json",
        "data/partition/partition.npz",
        "data/partition/class_counts.csv",
        "data/partition/heatmap.png",
        "data/setup/fedavg/info.json",
        "data/setup/feddisk/info.json",
        "reports/comparison.md",
        "reports/curves.png",
        "reports/curves.csv",
        "reports/summary.json",
    ):
        assert (repo / path).is_file(), path
    for algorithm in ("fedavg", "feddisk"):
        folder = repo / "reports/runs" / algorithm / "seed-0"
        for name in (
            "metrics.json",
            "rounds.csv",
            "curves.png",
            "model.pt",
            "config.yaml",
            "run_info.json",
            "timings.json",
        ):
            assert (folder / name).is_file(), folder / name
        assert not (folder / "checkpoint.pt").exists()  # resume state goes once the run is complete
        assert json.loads((folder / "metrics.json").read_text())["rounds"] == 2
    (entry,) = json.loads((repo / "data/setup/feddisk/info.json").read_text())["setup"]
    assert entry["component"] == "feddisk" and (repo / "data/setup/feddisk" / entry["file"]).is_file()
    assert json.loads((repo / "data/setup/fedavg/info.json").read_text())["setup"] == []
    # The FedDisk run trained on exactly the weights the setup stage left.
    config = yaml.safe_load((repo / "reports/runs/feddisk/seed-0/config.yaml").read_text())
    assert config["train"]["loss_transform"]["cache_dir"] == "data/setup/feddisk"

    metrics = json.loads(dvc(repo, "metrics", "show", "--json"))
    workspace = metrics.get("workspace", metrics.get(""))  # the key depends on the DVC version
    shown = workspace["data"]["reports/summary.json"]["data"]
    summary = json.loads((repo / "reports/summary.json").read_text())
    assert shown == summary and set(shown) == {"fedavg", "feddisk"}
    final = json.loads((repo / "reports/runs/fedavg/seed-0/metrics.json").read_text())["final_accuracy"]
    assert shown["fedavg"]["final_accuracy"] == pytest.approx(final)
    table = (repo / "reports/comparison.md").read_text()
    assert "| fedavg | 0 |" in table and "| feddisk | 0 |" in table and "| rank |" in table

    dvc(repo, "plots", "show", "-o", "plots_html")
    page = (repo / "plots_html" / "index.html").read_text()
    assert "Test accuracy vs communication round" in page and '"algorithm": "feddisk"' in page
    assert "heatmap.png" in page

    assert ran(dvc(repo, "repro")) == set()  # nothing changed: nothing runs
    assert changed(repo) == set()
    # An ad-hoc `fedplug run` writes under runs/: not a pipeline output or dep.
    (repo / "runs/adhoc").mkdir(parents=True)
    (repo / "runs/adhoc/metrics.json").write_text("{}")
    assert changed(repo) == set()


@pytest.mark.slow
def test_a_rerun_from_scratch_leaves_the_committed_tree_unchanged(
    repo: Path, tmp_path: Path
) -> None:
    """`make repro` on a fresh clone must leave `git status` clean: every DVC output (so
    dvc.lock) and every committed report reproduces byte for byte; measured times and the
    machine stay beside them (timings.json, run_info.json, wall_times.md), out of git."""
    copy = tmp_path / "clone"
    sh(repo, "git", "clone", "-q", str(repo), str(copy))
    assert not (copy / "reports/runs").exists() and (copy / "dvc.lock").is_file()
    # Every stage but evaluate runs; evaluate is skipped because its inputs (the run folders,
    # the setup folder) reproduced with the hashes dvc.lock holds.
    assert ran(dvc(copy, "repro")) == {"download", "partition", "setup"} | TRAIN_STAGES
    assert sh(copy, "git", "status", "--porcelain") == ""
    dvc(copy, "repro", "-f", "evaluate")  # and evaluate itself reproduces the committed reports
    assert sh(copy, "git", "status", "--porcelain") == ""
    run = copy / "reports/runs/fedavg/seed-0"
    timings = json.loads((run / "timings.json").read_text())
    assert timings["total_seconds"] > 0 and len(timings["round_seconds"]) == 2
    assert "seconds" not in json.loads((run / "metrics.json").read_text())["history"][0]
    assert (run / "run_info.json").is_file() and "wall time" in (copy / "reports/wall_times.md").read_text()


def test_dvc_status_is_quiet_about_the_paper_studies() -> None:
    """The studies' committed dvc.lock matches their specs, runner and results files, so a
    plain `dvc status` lists none of them (they are not part of `make repro`)."""
    status = json.loads(dvc(REPO, "status", "--json", "pipelines/studies/dvc.yaml"))
    assert status == {}, (
        f"{sorted(status)} changed: run `dvc repro pipelines/studies/dvc.yaml` (it reuses the "
        "committed runs, seconds) and commit pipelines/studies/dvc.lock"
    )


@pytest.mark.slow
def test_training_param_reruns_training_but_not_the_data_stages(repo: Path) -> None:
    # `dvc exp run -S` sets the param, reproduces, and records an experiment.
    output = dvc(repo, "exp", "run", "-S", "train.rounds=3", "-n", "three-rounds")
    assert ran(output) == TRAIN_STAGES | {"evaluate"}
    assert "Stage 'partition' didn't change, skipping" in output
    assert json.loads((repo / "reports/runs/fedavg/seed-0/metrics.json").read_text())["rounds"] == 3
    experiments = json.loads(dvc(repo, "exp", "show", "--json"))
    names = {
        experiment.get("name")
        for row in experiments
        for experiment in (row.get("experiments") or [])
    }
    assert "three-rounds" in names


def store(repo: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")


def runs_of(repo: Path) -> list[Any]:
    client = store(repo)
    experiment = client.get_experiment_by_name("pipeline-test")
    return client.search_runs([experiment.experiment_id], max_results=1000)


def group(repo: Path, label: str) -> tuple[Any, list[Any]]:
    """The parent run named ``label`` and its children."""
    runs = runs_of(repo)
    parents = [run for run in runs if run.info.run_name == label and "fedplug.parent" in run.data.tags]
    assert len(parents) == 1, [(run.info.run_name, run.data.tags.get("fedplug.parent")) for run in runs]
    children = [
        run for run in runs if run.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id
    ]
    return parents[0], children


def artifact_folder(run: Any) -> Path:
    from mlflow.utils.file_utils import local_file_uri_to_path

    return Path(local_file_uri_to_path(run.info.artifact_uri))


@pytest.mark.slow
def test_runs_nest_under_their_dvc_experiment(repo: Path) -> None:
    commit = sh(repo, "git", "rev-parse", "HEAD~1").strip()  # the commit `dvc repro` ran on
    parent, children = group(repo, f"repro-{commit[:7]}")
    assert parent.data.tags["fedplug.parent"] == f"dvc-repro:{commit}"
    assert sorted(run.info.run_name for run in children) == [
        f"fedavg-seed0@repro-{commit[:7]}",
        f"feddisk-seed0@repro-{commit[:7]}",
    ]
    # The evaluate stage closed the parent with the comparison.
    summary = json.loads((repo / "reports/summary.json").read_text())
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["fedavg.final_accuracy"] == pytest.approx(
        summary["fedavg"]["final_accuracy"]
    )
    parent, children = group(repo, "three-rounds")
    assert parent.data.tags["fedplug.parent"].startswith("dvc-exp:three-rounds@")
    assert sorted(run.info.run_name for run in children) == [
        "fedavg-seed0@three-rounds",
        "feddisk-seed0@three-rounds",
    ]
    for child in children:
        assert child.data.tags["dvc.exp_name"] == "three-rounds"
        assert child.info.status == "FINISHED"
        steps = [m.step for m in store(repo).get_metric_history(child.info.run_id, "accuracy")]
        assert sorted(steps) == [1, 2, 3]
        # Artifacts beside the project's store.
        assert artifact_folder(child).is_relative_to(repo / "mlruns")
        assert (artifact_folder(child) / "config.yaml").is_file()


@pytest.mark.slow
def test_a_queued_experiment_logs_to_the_projects_store(repo: Path) -> None:
    # DVC runs a queued experiment in a temporary copy under .dvc/tmp/exps/ and deletes it.
    dvc(repo, "exp", "run", "--queue", "-S", "train.rounds=1", "-n", "queued")
    # The worker DVC starts runs on as a daemon: keep it off this process's pipes.
    subprocess.run(
        [str(VENV_BIN / "dvc"), "queue", "start"], cwd=repo, env=environment(),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        check=True, timeout=120,
    )
    try:
        deadline = time.monotonic() + 900
        status = ""
        while time.monotonic() < deadline:
            status = next(
                (line for line in dvc(repo, "queue", "status").splitlines() if " queued " in line), ""
            )
            if "Success" in status or "Failed" in status:
                break
            time.sleep(5)
        if "Success" not in status:
            logs = subprocess.run(
                [str(VENV_BIN / "dvc"), "queue", "logs", "queued"],
                cwd=repo, env=environment(), capture_output=True, text=True, check=False,
            )
            pytest.fail(f"queued experiment did not succeed: {status!r}\n{logs.stdout}{logs.stderr}")
    finally:
        subprocess.run(
            [str(VENV_BIN / "dvc"), "queue", "stop"],
            cwd=repo, env=environment(), capture_output=True, check=False, timeout=120,
        )
    parent, children = group(repo, "queued")
    assert parent.info.status == "FINISHED"
    assert sorted(run.info.run_name for run in children) == [
        "fedavg-seed0@queued",
        "feddisk-seed0@queued",
    ]
    for child in children:
        assert child.data.params["train.rounds"] == "1"
        assert artifact_folder(child).is_relative_to(repo / "mlruns")
        assert (artifact_folder(child) / "metrics.json").is_file()
    assert not list((repo / ".dvc/tmp").glob("exps/*/mlflow.db"))


@pytest.mark.slow
def test_a_copied_project_logs_to_its_own_store(
    repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    copy = tmp_path_factory.mktemp("copied") / "project"
    shutil.copytree(repo, copy, symlinks=True)
    before = set((repo / "mlruns").iterdir())
    set_params(
        copy,
        lambda params: params["algorithms"]["fedavg"].update(optimizer={"name": "sgd", "lr": 0.3}),
    )
    dvc(copy, "exp", "run", "-n", "in-copy")
    parent, children = group(copy, "in-copy")
    assert [run.info.run_name for run in children] == ["fedavg-seed0@in-copy"]
    # New and old runs' artifacts are the copy's; the original's store did not change.
    for run in runs_of(copy):
        assert artifact_folder(run).is_relative_to(copy / "mlruns"), run.info.artifact_uri
    assert (artifact_folder(children[0]) / "metrics.json").is_file()
    assert set((repo / "mlruns").iterdir()) == before
    assert not [run for run in runs_of(repo) if run.info.run_name.endswith("@in-copy")]


@pytest.mark.slow
def test_one_algorithms_params_rerun_only_its_training(repo: Path) -> None:
    set_params(
        repo,
        lambda params: params["algorithms"]["fedavg"].update(optimizer={"name": "sgd", "lr": 0.2}),
    )
    assert changed(repo) == {"setup", "train@fedavg-0", "evaluate"}
    output = dvc(repo, "repro")
    # The setup stage re-checks its (persisted) files in seconds; FedDisk's folder is
    # unchanged, so FedDisk is not retrained.
    assert ran(output) == {"setup", "train@fedavg-0", "evaluate"}
    assert re.search(r"setup: feddisk: loss_transform feddisk: \S+\.npz kept", output)


@pytest.mark.slow
def test_partition_change_reruns_everything_after_it(repo: Path) -> None:
    set_params(repo, lambda params: params["data"]["partition"].update(alpha=0.3))
    # Every stage after the partition reads `data` (it builds the federation), so all of
    # them are out of date at once; `evaluate` follows when the runs change (see the
    # experiment test above). The download stage reads only data.dataset and data.root.
    assert changed(repo) == {"partition", "setup"} | TRAIN_STAGES
    assert ran(dvc(repo, "repro", "--dry")) == {"partition", "setup"} | TRAIN_STAGES
    set_params(repo, lambda params: params["data"]["dataset"].update(num_train=500))
    assert changed(repo) == {"download", "partition", "setup"} | TRAIN_STAGES
