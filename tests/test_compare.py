"""``fedplug compare``: algorithms x metrics over seeds from run folders or MLflow, ranked,
within 100 columns; numbers checked against means and standard deviations by hand."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedplug.cli import main
from fedplug.compare import (
    Symbols,
    mean_std,
    render_table,
    run_from_metrics,
    runs_from_folders,
    shorten_name,
    summarize,
)

ROOT = Path(__file__).resolve().parent.parent


def write_run(folder: Path, final: float, best: float, rounds: int | None, target: float = 0.9, **extra: Any) -> None:
    folder.mkdir(parents=True)
    metrics = {
        "final_accuracy": final, "best_accuracy": best, "rounds": 10, "target_accuracy": target,
        "rounds_to_target": rounds, "total_bytes": 79_684_000, "total_seconds": 8.5, "history": [], **extra,
    }
    (folder / "metrics.json").write_text(json.dumps(metrics))


@pytest.fixture
def pipeline_runs(tmp_path: Path) -> Path:
    """reports/runs as the pipeline writes it: three algorithms, 3, 2 and 1 seeds."""
    runs = tmp_path / "reports" / "runs"
    for seed, (final, best, rounds) in enumerate([(0.80, 0.82, 6), (0.85, 0.88, 8), (0.90, 0.91, None)]):
        write_run(runs / "fedavg" / f"seed-{seed}", final, best, rounds)
    for seed, (final, best) in enumerate([(0.90, 0.93), (0.92, 0.95)]):
        write_run(runs / "fedprox" / f"seed-{seed}", final, best, 5)
    write_run(runs / "iwds" / "seed-0", 0.88, 0.96, 4)
    return runs


def compare(*argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``fedplug compare ARGV``."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["compare", *argv])
    return code, stdout.getvalue(), stderr.getvalue()


def rows_of(output: str) -> dict[str, list[str]]:
    """``{algorithm: [cells...]}`` of the table (cells split on two spaces)."""
    lines = output.splitlines()[3:]  # title, header, rule
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("  ") if cell.strip()]
        rows[cells[1]] = cells
    return rows


# ------------------------------------------------------------------- statistics


def test_mean_and_population_std_by_hand() -> None:
    # (0.80 + 0.85 + 0.90) / 3 = 0.85; deviations -0.05, 0, 0.05: variance 0.005 / 3.
    statistic = mean_std([0.80, 0.85, 0.90])
    assert statistic is not None
    assert statistic.mean == pytest.approx(0.85)
    assert statistic.std == pytest.approx(math.sqrt(0.005 / 3))
    assert statistic.count == 3
    assert mean_std([]) is None


# ------------------------------------------------------------------- the table


def test_pipeline_runs_give_means_stds_and_seed_counts(pipeline_runs: Path) -> None:
    # Execute
    code, output, stderr = compare(str(pipeline_runs), "--width", "100")
    # Assert: fedavg final (0.80, 0.85, 0.90): 0.85 ± sqrt(0.005/3) = 0.0408; best (0.82,
    # 0.88, 0.91): 0.87, deviations -0.05, 0.01, 0.04 -> sqrt(0.0042/3) = 0.0374; rounds to
    # target reached by 2 of 3 seeds: (6 + 8) / 2 = 7 ± 1. fedprox: 0.91 ± 0.01, 0.94 ± 0.01.
    assert code == 0, stderr
    rows = rows_of(output)
    assert rows["fedavg"][2:] == ["3", "0.8500 ± 0.0408", "0.8700 ± 0.0374", "7.0 ± 1.0 (2/3)"]
    assert rows["fedprox"][2:] == ["2", "0.9100 ± 0.0100", "0.9400 ± 0.0100", "5.0 ± 0.0"]
    assert rows["iwds"][2:] == ["1", "0.8800", "0.9600", "4"]
    assert "rounds to 90%" in output.splitlines()[1]
    assert "ranked by mean final accuracy" in output.splitlines()[0]


def test_ranking_follows_by(pipeline_runs: Path) -> None:
    # final: fedprox 0.91, iwds 0.88, fedavg 0.85; best: iwds 0.96, fedprox 0.94, fedavg 0.87;
    # rounds: every seed of iwds (4) and fedprox (5) reached it, 2 of 3 of fedavg's.
    orders = {}
    for by in ("final", "best", "rounds"):
        code, output, stderr = compare(str(pipeline_runs), "--by", by)
        assert code == 0, stderr
        orders[by] = [(cells[0], cells[1]) for cells in rows_of(output).values()]
    assert orders["final"] == [("1", "fedprox"), ("2", "iwds"), ("3", "fedavg")]
    assert orders["best"] == [("1", "iwds"), ("2", "fedprox"), ("3", "fedavg")]
    assert orders["rounds"] == [("1", "iwds"), ("2", "fedprox"), ("3", "fedavg")]


def test_fedplug_run_folders_group_seeds_of_one_config(tmp_path: Path) -> None:
    # Prepare: runs/ of `fedplug run`: fedprox with seeds 0 and 1 (one config), and a
    # fedavg folder of another config.
    runs = tmp_path / "runs"
    config = {"data": {"num_clients": 10}, "train": {"rounds": 10, "loss_transform": {"name": "fedprox"}}}
    for seed, (final, digest) in enumerate([(0.70, "1a2b3c4d5e"), (0.80, "6f7a8b9c0d")]):
        folder = runs / f"mnist-fedprox-{digest}"
        write_run(folder, final, final, None)
        config["train"]["seed"] = seed
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    other = runs / "mnist-fedavg-0123456789"
    write_run(other, 0.9, 0.9, 3)
    (other / "config.yaml").write_text(yaml.safe_dump({"data": {}, "train": {"seed": 0}}))
    # Execute
    code, output, stderr = compare(str(runs))
    # Assert: (0.70 + 0.80) / 2 = 0.75 ± 0.05 over 2 seeds.
    assert code == 0, stderr
    rows = rows_of(output)
    assert rows["mnist-fedprox"][2:4] == ["2", "0.7500 ± 0.0500"]
    assert rows["mnist-fedprox"][-1] == "never"
    assert rows["mnist-fedavg"][2:4] == ["1", "0.9000"]


def test_runs_of_two_configs_under_one_name_are_told_apart(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for rounds, digest in ((5, "1a2b3c4d5e"), (10, "6f7a8b9c0d")):
        folder = runs / f"mnist-fedavg-{digest}"
        write_run(folder, 0.8, 0.8, None)
        (folder / "config.yaml").write_text(yaml.safe_dump({"data": {}, "train": {"seed": 0, "rounds": rounds}}))
    code, output, stderr = compare(str(runs))
    assert code == 0, stderr
    names = list(rows_of(output))
    assert len(names) == 2 and all(name.startswith("mnist-fedavg-") for name in names)


def test_long_names_and_every_column_fit_100_columns(tmp_path: Path) -> None:
    # Prepare: names of 80 characters that differ only at their end, all five metrics.
    runs = tmp_path / "runs"
    stem = "fedavg_with_a_very_long_label_" * 3
    for index in range(3):
        for seed in range(3):
            write_run(runs / f"{stem}{index}" / f"seed-{seed}", 0.5 + 0.1 * index + 0.01 * seed, 0.9, seed + 1)
    # Execute
    code, output, stderr = compare(str(runs), "--metrics", "final,best,rounds,bytes,seconds", "--width", "100")
    # Assert: every line fits; names are cut in the middle and stay distinct; no column lost.
    assert code == 0, stderr
    lines = output.splitlines()
    assert max(len(line) for line in lines) <= 100
    names = [cells[1] for cells in rows_of(output).values()]
    assert len(set(names)) == 3 and all("…" in name for name in names)
    assert [name[-1] for name in names] == ["2", "1", "0"]  # ranked by final accuracy
    assert "not shown" not in output


def test_a_narrow_width_leaves_out_columns_and_says_which() -> None:
    runs = [run_from_metrics(f"algorithm-{index}", 0, {"final_accuracy": 0.5, "best_accuracy": 0.6,
                                                      "rounds_to_target": None, "total_bytes": 1e6,
                                                      "total_seconds": 2.0}) for index in range(2)]
    lines = render_table(summarize(runs), ["final", "best", "rounds", "bytes", "seconds"], width=40)
    assert max(len(line) for line in lines) <= 40
    assert lines[-1].startswith("not shown (wider than 40 columns):")


def test_shorten_name_keeps_start_and_end() -> None:
    assert shorten_name("fedavg_faults_dropout_0.5", 15, Symbols()) == "fedavg_…out_0.5"
    assert shorten_name("fedavg", 15, Symbols()) == "fedavg"


# ------------------------------------------------------------------- errors


def test_a_missing_folder_is_one_line_saying_what_to_do(tmp_path: Path) -> None:
    code, output, stderr = compare(str(tmp_path / "nowhere"))
    assert code == 2 and output == ""
    assert len(stderr.strip().splitlines()) == 1
    assert "is not a folder of runs" in stderr and "make repro" in stderr


def test_a_folder_without_runs_is_one_line_saying_what_to_do(tmp_path: Path) -> None:
    code, _, stderr = compare(str(tmp_path))
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1
    assert "no finished runs (metrics.json)" in stderr and "--mlflow" in stderr


def test_a_missing_mlflow_store_is_one_line_and_creates_nothing(tmp_path: Path) -> None:
    store = tmp_path / "mlflow.db"
    code, _, stderr = compare("--mlflow", "mnist-dirichlet", "--tracking-uri", f"sqlite:///{store}")
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert "no MLflow store" in stderr
    assert not store.exists()


# ------------------------------------------------------------------- MLflow


def test_mlflow_runs_give_the_same_table(tmp_path: Path) -> None:
    # Prepare: an experiment with a parent run, fedavg seeds 0 and 1 under it, an older
    # duplicate of fedavg seed 0 (replaced by the latest) and a run without fedplug tags.
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("study", artifact_location=(tmp_path / "mlruns").as_uri())

    def log(name: str, metrics: dict[str, float], tags: dict[str, str], start: int) -> str:
        run = client.create_run(experiment, run_name=name, tags=tags, start_time=start)
        for key, value in metrics.items():
            client.log_metric(run.info.run_id, key, value)
        client.log_param(run.info.run_id, "study.target_accuracy", "0.9")
        client.set_terminated(run.info.run_id)
        return run.info.run_id

    parent = log("repro-abc", {}, {"fedplug.parent": "repro-abc"}, 1)
    child = {"mlflow.parentRunId": parent}
    log("old", {"final_accuracy": 0.1, "best_accuracy": 0.1}, {"fedplug.algorithm": "fedavg", "fedplug.seed": "0"}, 2)
    log("a", {"final_accuracy": 0.80, "best_accuracy": 0.82, "rounds_to_target": 6},
        {"fedplug.algorithm": "fedavg", "fedplug.seed": "0", **child}, 3)
    log("b", {"final_accuracy": 0.90, "best_accuracy": 0.91},
        {"fedplug.algorithm": "fedavg", "fedplug.seed": "1", **child}, 4)
    # Execute
    code, output, stderr = compare("--mlflow", "study", "--tracking-uri", uri)
    under_parent = compare("--mlflow", "study", "--tracking-uri", uri, "--parent", "repro-abc")
    unknown = compare("--mlflow", "nope", "--tracking-uri", uri)
    # Assert: (0.80 + 0.90) / 2 = 0.85 ± 0.05; one of two seeds reached 90% in 6 rounds.
    assert code == 0, stderr
    assert rows_of(output)["fedavg"][2:] == ["2", "0.8500 ± 0.0500", "0.8650 ± 0.0450", "6 (1/2)"]
    assert under_parent[0] == 0 and rows_of(under_parent[1]) == rows_of(output)
    assert unknown[0] == 2 and "experiments there: Default, study" in unknown[2]


# ------------------------------------------------------------------- make compare


def test_make_compare_runs_fedplug_compare_with_args() -> None:
    # -n: print the recipe only (the install prerequisite must not reinstall in a test).
    # Not a sub-make of `make test` (which would print "Entering/Leaving directory").
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    dry_run = subprocess.run(
        ["make", "--no-print-directory", "-n", "compare", "ARGS=--by best"],
        cwd=ROOT, capture_output=True, text=True, check=True, env=env,
    )
    assert dry_run.stdout.strip().splitlines()[-1] == ".venv/bin/fedplug compare --by best"


# ------------------------------------------------------------------- the docs


def documented_block(marker: str) -> list[str]:
    """The lines of the fenced block right after ``<!-- marker -->`` in docs/pipeline.md."""
    lines = (ROOT / "docs" / "pipeline.md").read_text().splitlines()
    start = lines.index(f"<!-- {marker} -->") + 2
    end = lines.index("```", start)
    return lines[start:end]


def test_the_documented_example_is_the_commands_output(
    pipeline_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Execute: in the project's folder, with the default folder, as `make compare` runs it.
    monkeypatch.chdir(pipeline_runs.parent.parent)
    code, output, stderr = compare("--width", "100")
    # Assert
    assert code == 0, stderr
    assert output.splitlines() == documented_block("compare-example")


def test_a_pipeline_run_folder_keeps_its_seconds_in_timings_json(tmp_path: Path) -> None:
    # Prepare: the pipeline writes metrics.json without measured times and puts them in
    # timings.json beside it (so that dvc.lock reproduces).
    runs = tmp_path / "runs"
    for seed, seconds in enumerate((3.0, 5.0)):
        folder = runs / "fedavg" / f"seed-{seed}"
        write_run(folder, 0.8, 0.9, 4)
        metrics = json.loads((folder / "metrics.json").read_text())
        del metrics["total_seconds"]
        (folder / "metrics.json").write_text(json.dumps(metrics))
        (folder / "timings.json").write_text(json.dumps({"total_seconds": seconds}))
    # Execute
    (run,) = summarize(runs_from_folders([runs]))
    # Assert: the mean of the measured times, 4.0 s.
    assert run.seconds is not None and run.seconds.mean == pytest.approx(4.0)
