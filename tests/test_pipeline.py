"""The DVC pipeline, run for real in a temporary git repository on a tiny synthetic study
(2 algorithms, one of them FedDisk, 2 rounds): outputs, metrics, plots, experiments, and
which stages a params change reruns. Plus the report's pure functions (fast)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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
    run_metrics_from_summary,
    summarize,
    summary_metrics,
    write_report,
)
from fedplug.simulation.results import rounds_to_target

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
    assert metrics["b"]["wall_seconds"] == 17.0
    assert metrics["a"] == {
        "final_accuracy": 0.9,
        "best_accuracy": 0.95,
        "rounds_to_target": 2.0,
        "total_bytes": 300,
        "wall_seconds": 10.0,
    }
    table = comparison_markdown([a, b], 0.9, "t")
    assert (
        "| b | 0, 1 | 0.8600 ± 0.0600 | 0.8600 ± 0.0600 | 2 (1/2 seeds) | 200 B | 17.0 s |" in table
    )
    assert "| a | 0 | 0.9000 | 0.9500 | 2 | 300 B | 10.0 s |" in table
    assert "rounds to 90%" in table


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
            "loss_transform": {"name": "cross_entropy"},
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


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A git repository holding the pipeline and a tiny study, reproduced once."""
    root = tmp_path_factory.mktemp("pipeline")
    for name in PROJECT_FILES:
        source, target = REPO / name, root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    (root / ".gitignore").write_text("mlflow.db\nmlruns/\n")
    sh(root, "git", "init", "-q")
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "pipeline")
    output = dvc(root, "repro")
    assert ran(output) == {"download", "partition", "pretrain_density", "evaluate"} | TRAIN_STAGES
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "reproduced")
    yield root


@pytest.mark.slow
def test_repro_writes_every_output_and_dvc_reads_metrics_and_plots(repo: Path) -> None:
    for path in (
        "data/raw/manifest.json",
        "data/partition/partition.npz",
        "data/partition/class_counts.csv",
        "data/partition/heatmap.png",
        "data/density/fedavg/info.json",
        "data/density/feddisk/info.json",
        "reports/comparison.md",
        "reports/curves.png",
        "reports/curves.csv",
        "reports/summary.json",
    ):
        assert (repo / path).is_file(), path
    for algorithm in ("fedavg", "feddisk"):
        folder = repo / "runs" / algorithm / "seed-0"
        for name in (
            "metrics.json",
            "rounds.csv",
            "curves.png",
            "model.pt",
            "config.yaml",
            "run_info.json",
        ):
            assert (folder / name).is_file(), folder / name
        assert not (folder / "checkpoint.pt").exists()  # resume state goes once the run is complete
        assert json.loads((folder / "metrics.json").read_text())["rounds"] == 2
    info = json.loads((repo / "data/density/feddisk/info.json").read_text())
    assert info["needs_density"] and (repo / "data/density/feddisk" / info["file"]).is_file()
    assert (
        json.loads((repo / "data/density/fedavg/info.json").read_text())["needs_density"] is False
    )
    # The FedDisk run trained on exactly the weights the density stage left.
    config = yaml.safe_load((repo / "runs/feddisk/seed-0/config.yaml").read_text())
    assert config["train"]["loss_transform"]["cache_dir"] == "data/density/feddisk"

    metrics = json.loads(dvc(repo, "metrics", "show", "--json"))
    workspace = metrics.get("workspace", metrics.get(""))  # the key depends on the DVC version
    shown = workspace["data"]["reports/summary.json"]["data"]
    summary = json.loads((repo / "reports/summary.json").read_text())
    assert shown == summary and set(shown) == {"fedavg", "feddisk"}
    final = json.loads((repo / "runs/fedavg/seed-0/metrics.json").read_text())["final_accuracy"]
    assert shown["fedavg"]["final_accuracy"] == pytest.approx(final)
    table = (repo / "reports/comparison.md").read_text()
    assert "| fedavg | 0 |" in table and "| feddisk | 0 |" in table

    dvc(repo, "plots", "show", "-o", "plots_html")
    page = (repo / "plots_html" / "index.html").read_text()
    assert "Test accuracy vs communication round" in page and '"algorithm": "feddisk"' in page
    assert "heatmap.png" in page

    assert ran(dvc(repo, "repro")) == set()  # nothing changed: nothing runs
    assert changed(repo) == set()


@pytest.mark.slow
def test_training_param_reruns_training_but_not_the_data_stages(repo: Path) -> None:
    # `dvc exp run -S` sets the param, reproduces, and records an experiment.
    output = dvc(repo, "exp", "run", "-S", "train.rounds=3", "-n", "three-rounds")
    assert ran(output) == TRAIN_STAGES | {"evaluate"}
    assert "Stage 'partition' didn't change, skipping" in output
    assert json.loads((repo / "runs/fedavg/seed-0/metrics.json").read_text())["rounds"] == 3
    experiments = json.loads(dvc(repo, "exp", "show", "--json"))
    names = {
        experiment.get("name")
        for row in experiments
        for experiment in (row.get("experiments") or [])
    }
    assert "three-rounds" in names


@pytest.mark.slow
def test_one_algorithms_params_rerun_only_its_training(repo: Path) -> None:
    set_params(
        repo,
        lambda params: params["algorithms"]["fedavg"].update(optimizer={"name": "sgd", "lr": 0.2}),
    )
    assert changed(repo) == {"pretrain_density", "train@fedavg-0", "evaluate"}
    output = dvc(repo, "repro")
    # The density stage re-checks its (persisted) weights in seconds; FedDisk's folder is
    # unchanged, so FedDisk is not retrained.
    assert ran(output) == {"pretrain_density", "train@fedavg-0", "evaluate"}
    assert "feddisk: feddisk weights kept" in output


@pytest.mark.slow
def test_partition_change_reruns_everything_after_it(repo: Path) -> None:
    set_params(repo, lambda params: params["data"]["partition"].update(alpha=0.3))
    # Every stage after the partition reads `data` (it builds the federation), so all of
    # them are out of date at once; `evaluate` follows when the runs change (see the
    # experiment test above). The download stage reads only data.dataset and data.root.
    assert changed(repo) == {"partition", "pretrain_density"} | TRAIN_STAGES
    assert ran(dvc(repo, "repro", "--dry")) == {"partition", "pretrain_density"} | TRAIN_STAGES
    set_params(repo, lambda params: params["data"]["dataset"].update(num_train=500))
    assert changed(repo) == {"download", "partition", "pretrain_density"} | TRAIN_STAGES
