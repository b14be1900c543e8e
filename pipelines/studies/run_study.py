"""Run one paper-reproduction study: every grid cell x algorithm x seed, then its report.

    python pipelines/studies/run_study.py pipelines/studies/fedshift.yaml
    python pipelines/studies/run_study.py pipelines/studies/fedshift.yaml --set data.dataset=fashion_mnist
    python pipelines/studies/run_study.py pipelines/studies/fedshift.yaml --no-mlflow --report-only

Each run trains into ``<out>/<run-id>/`` (default ``reports/studies/<name>[-<suffix>]``)
with :func:`fedplug.experiment.run_experiment`: ``metrics.json``, ``config.yaml``,
``run_info.json``, ``model.pt``. The runner is resumable: a run whose ``metrics.json``
exists is skipped, and a run killed mid-way continues from its per-round checkpoint. Each
run is logged to the MLflow experiment ``study-<name>`` (``base.tracking.uri``, else
``$MLFLOW_TRACKING_URI``, else the project's ``sqlite:///<root>/mlflow.db``) unless
``--no-mlflow``, as a child run (named by its run id) of one parent run per study output
folder (named after it, found again by its tag ``fedplug.parent``, so a resumed study
adds to the same parent). At the end (and with ``--report-only`` without training) it
writes ``summary.md``, ``summary.json`` and the spec's plots; after training, these go to
the parent run too (metrics ``<cell labels>/<algorithm>.<column>``, e.g.
``0.1/fedavgm0.9.final_accuracy``), which is marked FINISHED.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "pipelines"))

from common import run_main, set_torch_threads  # noqa: E402

CHECKPOINT_NAME = "checkpoint.pt"
TRACKING_STATE_NAME = "mlflow_run.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="study file, e.g. pipelines/studies/fedshift.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the base config, e.g. data.dataset=fashion_mnist (repeatable)")
    parser.add_argument("--out", default=None, help="output folder (default reports/studies/<name>, plus "
                        "-<dataset> when --set changes the dataset)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    parser.add_argument("--report-only", action="store_true", help="train nothing; report the finished runs")
    parser.add_argument("--only", default=None, help="train only runs whose id contains this text")
    args = parser.parse_args(argv)

    from fedplug.config import read_yaml
    from fedplug.plugins import default_registry
    from fedplug.study import expand_study, parse_study

    spec = parse_study(read_yaml(args.spec), args.spec)
    registry = default_registry()
    runs = expand_study(spec, registry, args.overrides)
    out = Path(args.out) if args.out else default_out(spec.name, runs)
    out.mkdir(parents=True, exist_ok=True)
    parent = None
    if not args.report_only:
        parent = train_all(spec, runs, out, registry, mlflow=not args.no_mlflow, only=args.only)
    write_study_report(spec, runs, out)
    if parent is not None:
        log_study_summary(parent, out)
    return 0


class StudyParent(NamedTuple):
    """The MLflow parent run of a study output folder."""

    uri: str
    run_id: str


def parent_key(out: Path, root: Path) -> str:
    """``study:<out folder>``, relative to the project root when inside it."""
    resolved = out.resolve()
    try:
        return f"study:{resolved.relative_to(root)}"
    except ValueError:
        return f"study:{resolved}"


def log_study_summary(parent: StudyParent, out: Path) -> None:
    """The study's summary on the parent run, then FINISHED: one metric per summary row and
    column (``<cell labels>/<algorithm>.<column>``, e.g. ``0.1/fedavgm0.9.final_accuracy``),
    ``summary.md``, ``summary.json`` and the figures."""
    from fedplug.project import log_parent_summary

    rows = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else []
    metrics = {}
    for row in rows:
        label = "/".join(str(row[key]) for key in row if isinstance(row[key], str))
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[f"{label}.{key}"] = value
    files = [("", out / "summary.md"), ("", out / "summary.json")]
    files += [("figures", figure) for figure in sorted(out.glob("*.png"))]
    log_parent_summary(parent.uri, parent.run_id, metrics, files)
    print(f"study: summary logged to MLflow parent run {parent.run_id} at {parent.uri}")


def default_out(name: str, runs: list[Any]) -> Path:
    """``reports/studies/<name>`` for MNIST, ``reports/studies/<name>-<dataset>`` otherwise,
    so runs on another dataset never mix with (or skip because of) the MNIST ones."""
    dataset = runs[0].config.data.dataset.name
    return Path("reports/studies") / (name if dataset == "mnist" else f"{name}-{dataset}")


def train_all(
    spec: Any, runs: list[Any], out: Path, registry: Any, *, mlflow: bool, only: str | None
) -> StudyParent | None:
    """Train the runs that have no ``metrics.json`` yet, reusing one federation for runs
    that share a data config; returns the MLflow parent run (None without MLflow or when
    nothing was left to train)."""
    from fedplug.data.build import build_federation
    from fedplug.simulation.simulator import resolve_device
    from fedplug.study import pending_runs

    todo = [run for run in pending_runs(runs, out) if only is None or only in run.run_id]
    print(f"study {spec.name}: {len(runs)} runs, {len(runs) - len(pending_runs(runs, out))} done, "
          f"{len(todo)} to train -> {out}", flush=True)
    if not todo:
        return None
    parent = None
    if mlflow:
        from fedplug.project import find_or_create_parent_run, project_root, relocate_project_store
        from fedplug.tracking import choose_tracking_uri

        tracking = runs[0].config.tracking
        root = project_root(ROOT / "params.yaml")  # $DVC_ROOT under DVC, else this checkout
        target = choose_tracking_uri(tracking.uri, tracking.fallback_to_local, root)
        if target.fallback_reason:
            print(f"study: WARNING: {target.fallback_reason}; logging to {target.uri}", file=sys.stderr)
        relocate_project_store(target.uri, root)
        parent = StudyParent(target.uri, find_or_create_parent_run(
            target.uri, f"study-{spec.name}", parent_key(out, root), out.name,
            tags={"fedplug.study": spec.name},
        ))
        print(f"study {spec.name}: MLflow parent run {parent.run_id} at {target.uri}", flush=True)
    set_torch_threads()
    cached_key, federation = None, None
    for index, run in enumerate(todo, 1):
        key = json.dumps(run.config.data.model_dump(mode="json"), sort_keys=True)
        if key != cached_key:
            federation = None  # free the previous one first: only one federation in memory
            federation = build_federation(run.config.data, registry, resolve_device(run.config.train.device))
            cached_key = key
        started = time.perf_counter()
        summary = train_one(spec, run, out / run.run_id, registry, federation, parent)
        print(f"[{index}/{len(todo)}] {run.run_id}: final accuracy {summary['final_accuracy']:.4f}, "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    return parent


def train_one(spec: Any, run: Any, folder: Path, registry: Any, federation: Any,
              parent: StudyParent | None) -> dict[str, Any]:
    """Train one run into ``folder`` (resuming its checkpoint), logged to MLflow as a child
    of ``parent`` (nothing logged when ``parent`` is None)."""
    from fedplug.experiment import run_experiment
    from fedplug.simulation.simulator import config_fingerprint
    from fedplug.tracking import open_tracker

    folder.mkdir(parents=True, exist_ok=True)
    tags = {f"study.{axis}": label for axis, label in run.cell.items()}
    tags.update({"study.name": spec.name, "fedplug.algorithm": run.algorithm, "fedplug.seed": str(run.seed)})
    tracker = open_tracker(
        run.config, folder, run_name=run.run_id, enabled=parent is not None,
        parent=parent.run_id if parent is not None else None, tags=tags,
        fingerprint=config_fingerprint(run.config.train, federation), project_root=ROOT,
        experiment_name=f"study-{spec.name}", uri=parent.uri if parent is not None else None,
    )
    if tracker.resumed and parent is not None:
        tracker.set_tags({"mlflow.parentRunId": parent.run_id})
    try:
        result, simulator = run_experiment(run.config, folder, registry=registry, observers=[tracker.log_round],
                                           federation=federation)
        tracker.log_result(result)
        for name in ("config.yaml", "metrics.json", "run_info.json"):
            tracker.log_artifacts({"": folder / name})
        tracker.log_model(simulator.model, federation.test_x[:5])
    except BaseException:
        tracker.fail()
        raise
    tracker.finish()
    (folder / CHECKPOINT_NAME).unlink(missing_ok=True)
    return result.summary()


def write_study_report(spec: Any, runs: list[Any], out: Path) -> None:
    """``summary.md``, ``summary.json`` and the spec's plots, from the finished runs."""
    from fedplug.report import plot_comparison, run_metrics_from_summary
    from fedplug.study import (
        FinishedRun, plot_bars, plot_cpd_box, plot_heatmap, plot_vs_axis, summary_markdown, summary_rows,
    )

    finished = []
    for run in runs:
        path = out / run.run_id / "metrics.json"
        if path.is_file():
            finished.append(FinishedRun(run, json.loads(path.read_text())))
    if not finished:
        print(f"study {spec.name}: no finished runs in {out}; nothing to report")
        return
    target = finished[0].run.config.study.target_accuracy
    dataset = finished[0].run.config.data.dataset.name
    rows = summary_rows(finished, target)
    axes = list(spec.grid)
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    figures: list[str] = []
    for plot in spec.plots:
        if plot.kind == "curves":
            for cell in dict.fromkeys(item.run.cell_id for item in finished):
                members = [item for item in finished if item.run.cell_id == cell]
                metrics = [run_metrics_from_summary(item.run.algorithm, item.run.seed, item.summary) for item in members]
                name = f"curves_{cell}.png"
                label = ", ".join(f"{axis}={value}" for axis, value in members[0].run.cell.items())
                plot_comparison(metrics, out / name, f"{spec.name} on {dataset}" + (f": {label}" if label else ""), target)
                figures.append(name)
        elif plot.kind == "vs_axis":
            name = f"{plot.metric}_vs_{plot.axis}.png"
            plot_vs_axis(rows, plot.axis, plot.metric, out / name, f"{spec.name} on {dataset}", plot.log_x)
            figures.append(name)
        elif plot.kind == "cpd_box":
            name = "cpd_box.png"
            plot_cpd_box(finished, out / name, f"{spec.name} on {dataset}: per-round median CPD")
            figures.append(name)
        elif plot.kind == "heatmap":
            name = f"{plot.metric}_heatmap.png"
            plot_heatmap(rows, spec.grid, plot.rows, plot.columns, plot.panels, plot.metric, out / name,
                         f"{spec.name} on {dataset}: {plot.metric.replace('_', ' ')}")
            figures.append(name)
        elif plot.kind == "bars":
            name = f"{plot.metric}_bars.png"
            plot_bars(rows, axes, plot.metric, out / name, f"{spec.name} on {dataset}: {plot.metric.replace('_', ' ')}")
            figures.append(name)
    lines = [
        f"# Study {spec.name} ({dataset})",
        "",
        spec.description.strip(),
        "",
        f"{len(finished)} of {len(runs)} runs finished. Accuracy is on the global test set; with several "
        "seeds, mean ± std over the seeds. Rounds to target: first round at or above the target.",
        "",
        summary_markdown(rows, axes, target),
        *[f"![{name}]({name})\n" for name in figures],
    ]
    (out / "summary.md").write_text("\n".join(lines))
    print(f"study {spec.name}: report in {out / 'summary.md'}")


if __name__ == "__main__":
    run_main(main)
