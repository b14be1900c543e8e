"""Stage ``evaluate``: compare every run of the study in one report.

Reads ``study`` (target accuracy, seeds, name) and the labels of ``algorithms``; reads
``reports/runs/<algorithm>/seed-<seed>/metrics.json`` for exactly those labels and seeds (folders of
algorithms no longer in the params are ignored) and, for wall time, the setup stage's
``data/setup/<algorithm>/timing.json``. Writes to ``reports/``:

- ``comparison.md``: algorithm, seeds, final and best accuracy, rounds to target, total
  bytes, wall time;
- ``curves.png``: accuracy vs round and accuracy vs cumulative bytes, every algorithm on
  each chart;
- ``curves.csv``: the same curves in long format (the data of the DVC plots);
- ``summary.json``: per-algorithm metrics (DVC metrics) for ``dvc exp show`` / ``dvc exp
  diff``; ``dvc metrics diff --all --no-path`` lists them a line each (``dvc metrics show``
  puts them all in one row).

Those four are DVC outputs committed to git and hold only what the params and the code
determine, so a re-run reproduces them byte for byte. The measured wall times (each run's
``timings.json``, the setup stage's ``timing.json``) go to ``wall_times.md`` beside them,
which is neither a DVC output nor in git, to the terminal and to MLflow.

The same comparison goes to the MLflow parent run of this DVC experiment (metrics
``<algorithm>.final_accuracy``, ..., and the files), which is then marked FINISHED;
``tracking`` is read but, as in the train stage, not a DVC dep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    REPORTS_DIR,
    RUNS_DIR,
    SETUP_DIR,
    algorithm_labels,
    dvc_run_group,
    read_params,
    run_main,
    section,
    validate_model,
)

from fedplug.safe_files import read_regular_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument("--runs", default=str(RUNS_DIR), help=f"runs folder (default {RUNS_DIR})")
    parser.add_argument(
        "--setup", default=str(SETUP_DIR), help=f"setup stage's folder (default {SETUP_DIR})"
    )
    parser.add_argument(
        "--out", default=str(REPORTS_DIR), help=f"report folder (default {REPORTS_DIR})"
    )
    args = parser.parse_args(argv)

    from fedplug.config import StudyConfig
    from fedplug.report import load_run_metrics, summarize, wall_time_markdown, write_report

    params = read_params(args.params)
    study = validate_model(StudyConfig, section(params, "study"), "study")
    runs = []
    for algorithm in algorithm_labels(params):
        setup_seconds = measured_seconds(Path(args.setup) / algorithm / "timing.json", "seconds")
        for seed in study.seeds:
            folder = Path(args.runs) / algorithm / f"seed-{seed}"
            run = load_run_metrics(folder / "metrics.json", algorithm, seed, setup_seconds)
            train_seconds = measured_seconds(folder / "timings.json", "total_seconds")
            runs.append(dataclasses.replace(run, train_seconds=train_seconds))
    title = f"Study {study.name!r}"
    files = write_report(runs, args.out, study.target_accuracy, title)
    wall_times = wall_time_markdown(summarize(runs, study.target_accuracy), title)
    (Path(args.out) / "wall_times.md").write_text(wall_times)
    print(read_regular_bytes(files.comparison).decode())
    print(wall_times)
    log_to_parent_run(params, study.name, files, args.params, runs)
    return 0


def log_to_parent_run(
    params: dict, study_name: str, files: Any, params_path: str, runs: list[Any]
) -> None:
    """Give the MLflow parent run of this DVC experiment (or ``dvc repro``) the
    comparison (metrics ``<algorithm>.<metric>``, the report files) and mark it FINISHED:
    every train stage of the group has run before this stage. Nothing when
    ``tracking.enabled`` is false or no train stage created the parent."""
    from fedplug.config import TrackingConfig
    from fedplug.project import (
        ensure_experiment,
        find_parent_run,
        log_parent_summary,
        project_root,
    )
    from fedplug.tracking import choose_tracking_uri

    tracking = validate_model(TrackingConfig, section(params, "tracking"), "tracking")
    if not tracking.enabled:
        return
    root = project_root(params_path)
    target = choose_tracking_uri(tracking.uri, tracking.fallback_to_local, root)
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from fedplug.errors import TrackingError

    client = MlflowClient(tracking_uri=target.uri)
    try:
        if client.get_experiment_by_name(study_name) is None:
            return
    except MlflowException as error:
        raise TrackingError(f"MLflow at {target.uri} failed: {error.message}") from None
    parent = find_parent_run(
        client, ensure_experiment(client, study_name, target.uri), dvc_run_group(root).key
    )
    if parent is None:
        return
    summary = json.loads(read_regular_bytes(files.summary))
    metrics = {
        f"{algorithm}.{key}": value
        for algorithm, values in summary.items()
        for key, value in values.items()
    }
    for algorithm in summary:
        seconds = [run.wall_seconds for run in runs if run.algorithm == algorithm]
        metrics[f"{algorithm}.wall_seconds"] = round(sum(seconds) / len(seconds), 2)
    log_parent_summary(
        target.uri,
        parent.info.run_id,
        metrics,
        [
            ("", files.comparison),
            ("", files.curves_png),
            ("", files.summary),
            ("", files.comparison.parent / "wall_times.md"),
        ],
    )
    print(f"evaluate: comparison logged to MLflow parent run {parent.info.run_id} at {target.uri}")


def measured_seconds(path: Path, key: str) -> float:
    """A measured time from a timings file (0 when the file, or the key, is missing: the
    setup stage writes none for an algorithm without a setup phase, and a
    queued experiment brings back only the DVC outputs); a FIFO, socket or device there
    is refused in one line, not waited on."""
    try:
        timings = json.loads(read_regular_bytes(path, what="timings file", advice="delete it and run its stage again"))
    except (OSError, ValueError):
        return 0.0
    seconds = timings.get(key) if isinstance(timings, dict) else None
    return float(seconds) if isinstance(seconds, (int, float)) else 0.0


if __name__ == "__main__":
    run_main(main)
