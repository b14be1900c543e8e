"""Stage ``evaluate``: compare every run of the study in one report.

Reads ``study`` (target accuracy, seeds, name) and the labels of ``algorithms``; reads
``runs/<algorithm>/seed-<seed>/metrics.json`` for exactly those labels and seeds (folders of
algorithms no longer in the params are ignored) and, for wall time, the density stage's
``data/density/<algorithm>/info.json``. Writes to ``reports/``:

- ``comparison.md``: algorithm, seeds, final and best accuracy, rounds to target, total
  bytes, wall time;
- ``curves.png``: accuracy vs round and accuracy vs cumulative bytes, every algorithm on
  each chart;
- ``curves.csv``: the same curves in long format (the data of the DVC plots);
- ``summary.json``: per-algorithm metrics for ``dvc metrics show`` / ``dvc exp show``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DENSITY_DIR,
    REPORTS_DIR,
    RUNS_DIR,
    algorithm_labels,
    read_params,
    run_main,
    section,
    validate_model,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument("--runs", default=str(RUNS_DIR), help=f"runs folder (default {RUNS_DIR})")
    parser.add_argument(
        "--density", default=str(DENSITY_DIR), help=f"density folder (default {DENSITY_DIR})"
    )
    parser.add_argument(
        "--out", default=str(REPORTS_DIR), help=f"report folder (default {REPORTS_DIR})"
    )
    args = parser.parse_args(argv)

    from fedplug.config import StudyConfig
    from fedplug.report import load_run_metrics, write_report

    params = read_params(args.params)
    study = validate_model(StudyConfig, section(params, "study"), "study")
    runs = []
    for algorithm in algorithm_labels(params):
        setup_seconds = density_seconds(Path(args.density) / algorithm / "info.json")
        for seed in study.seeds:
            path = Path(args.runs) / algorithm / f"seed-{seed}" / "metrics.json"
            runs.append(load_run_metrics(path, algorithm, seed, setup_seconds))
    files = write_report(runs, args.out, study.target_accuracy, f"Study {study.name!r}")
    print(files.comparison.read_text())
    return 0


def density_seconds(info_path: Path) -> float:
    """Seconds the density stage spent on this algorithm (0 when it needed none)."""
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return 0.0
    seconds = info.get("seconds") if isinstance(info, dict) else None
    return float(seconds) if isinstance(seconds, (int, float)) else 0.0


if __name__ == "__main__":
    run_main(main)
