"""Every file a user command reads back is checked before it is read (issue 44, finding 4
and build item 4): a FIFO planted where ``fedplug run`` reads its fault trace, where
``fedplug compare`` and the pipeline's evaluate stage read a run folder, where a study
reads its results file, its ``tuned.json`` or a run folder's ``config.yaml``, or where the
MLflow backend reads ``mlflow_run.json`` in ``--out``, used to make ``open()`` wait for a
writer forever (or, behind an ``is_file()`` test, to be taken for no file at all). Each
case plants one and expects one line naming it, at once.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from test_file_checks import TINY, unblocked_after
from test_study import BASE as STUDY_BASE
from test_study import load_runner

from fedplug.cli import main
from fedplug.errors import FedplugError
from fedplug.study import parse_study

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "0.5__fedavg__d0s0"
"""The one run of :func:`study_spec`'s study."""


@dataclass(frozen=True)
class Planted:
    """A scene with a FIFO where a command reads a file, and that command."""

    fifo: Path
    command: Callable[[], str]
    """Runs the user's command; returns the one error line it ends with."""


# ------------------------------------------------------------------------------ helpers


def run_cli(*argv: str) -> tuple[int, str]:
    """``fedplug <argv>`` in process: (exit code, stderr)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, stderr.getvalue()


def one_line(stderr: str) -> str:
    """The single error line of a refused command (no traceback, nothing else)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("fedplug: error: "), stderr
    return lines[0]


def fifo_at(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def cli_refusal(*argv: str) -> Callable[[], str]:
    """``fedplug <argv>``, which must end with exit status 2 and one error line."""

    def command() -> str:
        code, stderr = run_cli(*argv)
        assert code == 2, stderr
        return one_line(stderr)

    return command


def raised_line(call: Callable[[], Any], prefix: str) -> str:
    """The line ``prefix<error>`` that a stage's ``run_main`` prints for the
    :class:`FedplugError` ``call`` raises (it must raise one, of one line)."""
    with pytest.raises(FedplugError) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message, message
    return prefix + message


def load_stage(path: Path) -> ModuleType:
    """A pipeline script as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"fedplug_stage_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def study_spec(folder: Path, **changes: Any) -> Path:
    """A one-run study (two rounds of a small MLP on synthetic data) written as a spec file."""
    spec = {
        "name": "tiny",
        "base": copy.deepcopy(STUDY_BASE),
        "grid": {"alpha": {"0.5": {"data.partition.alpha": 0.5}}},
        "algorithms": {"fedavg": {}},
        "seeds": [0],
        "plots": [],
        **changes,
    }
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def report_only(spec: Path, out: Path, *extra: str) -> Callable[[], str]:
    """The study runner with ``--report-only`` (it trains nothing), refused in one line."""
    argv = [str(spec), "--no-mlflow", "--report-only", "--out", str(out), *extra]
    return lambda: raised_line(lambda: load_runner().main(argv), "fedplug pipeline: error: ")


def marked_study_folder(spec: Path, out: Path) -> None:
    """``out`` as a study run writes it (its marker, nothing else): a FIFO planted in it
    then reaches the study's reads instead of the folder check, which refuses the
    unmarked folder of a FIFO before anything is read."""
    assert load_runner().main([str(spec), "--no-mlflow", "--report-only", "--no-results", "--out", str(out)]) == 0
    assert (out / ".fedplug-output.json").is_file()


# -------------------------------------------------------------------------------- scenes


def faults_trace(tmp_path: Path) -> Planted:
    fifo = fifo_at(tmp_path / "trace.csv")
    config = copy.deepcopy(TINY)
    config["train"]["faults"] = {"dropout": {"trace": str(fifo)}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(config))
    return Planted(fifo, cli_refusal("run", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "out"), "--quiet"))


def compare_pipeline_metrics(tmp_path: Path) -> Planted:
    fifo = fifo_at(tmp_path / "runs" / "fedavg" / "seed-0" / "metrics.json")
    return Planted(fifo, cli_refusal("compare", str(tmp_path / "runs")))


def compare_run_config(tmp_path: Path) -> Planted:
    folder = tmp_path / "runs" / "synthetic-fedavg-0123456789"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"history": [], "rounds": 0}))
    fifo = fifo_at(folder / "config.yaml")
    return Planted(fifo, cli_refusal("compare", str(tmp_path / "runs")))


def evaluate_stage(tmp_path: Path, planted: str) -> Planted:
    """The pipeline's evaluate stage (the study's report) over ``runs/fedavg/seed-0``,
    with a FIFO as that folder's ``planted`` file."""
    params = {
        "study": {"name": "fifo", "seeds": [0], "target_accuracy": 0.5},
        "tracking": {"enabled": False},
        "algorithms": {"fedavg": {}},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    folder = tmp_path / "runs" / "fedavg" / "seed-0"
    folder.mkdir(parents=True)
    history = [{"round": 1, "accuracy": 0.5, "cumulative_bytes": 10}]
    (folder / "metrics.json").write_text(json.dumps({"history": history, "rounds": 1, "final_accuracy": 0.5}))
    if planted == "metrics.json":
        (folder / planted).unlink()
    fifo = fifo_at(folder / planted)
    argv = ["--params", str(tmp_path / "params.yaml"), "--runs", str(tmp_path / "runs"),
            "--setup", str(tmp_path / "setup"), "--out", str(tmp_path / "reports")]
    stage = load_stage(ROOT / "pipelines" / "evaluate.py")
    return Planted(fifo, lambda: raised_line(lambda: stage.main(argv), "fedplug pipeline: error: "))


def study_results_file(tmp_path: Path) -> Planted:
    fifo = fifo_at(tmp_path / "results" / "tiny.jsonl")
    return Planted(fifo, report_only(study_spec(tmp_path), tmp_path / "out", "--results", str(fifo)))


def study_run_config(tmp_path: Path) -> Planted:
    spec, out = study_spec(tmp_path), tmp_path / "out"
    marked_study_folder(spec, out)
    fifo = fifo_at(out / RUN_ID / "config.yaml")
    return Planted(fifo, report_only(spec, out, "--no-results"))


def study_tuned_json(tmp_path: Path) -> Planted:
    from fedplug.study.tuning import TUNED_NAME, write_tuned

    tune = {"validation_fraction": 0.2, "sampler": "grid", "params": {"train.optimizer.lr": [0.1, 0.3]}}
    spec, out = study_spec(tmp_path, tune=tune), tmp_path / "out"
    runner = load_runner()
    parsed = parse_study(yaml.safe_load(spec.read_text()), str(spec))
    write_tuned(out, {}, runner.study_fingerprint(parsed), None)  # the folder as a study's search leaves it
    (out / TUNED_NAME).unlink()
    fifo = fifo_at(out / TUNED_NAME)
    return Planted(fifo, report_only(spec, out, "--no-results"))


def mlflow_state(tmp_path: Path) -> Planted:
    """The MLflow backend opening the run of ``--out``, whose ``mlflow_run.json`` is a FIFO."""
    from fedplug.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowTracker.open(uri, "fifo", "first").finish()  # the store as a run leaves it (its set-up takes seconds)
    fifo = fifo_at(tmp_path / "out" / "mlflow_run.json")

    def command() -> str:
        return raised_line(
            lambda: MlflowTracker.open(uri, "fifo", "fedavg-seed0", state_path=fifo, fingerprint="f"),
            "fedplug: error: ",
        )

    return Planted(fifo, command)


SCENES: dict[str, Callable[[Path], Planted]] = {
    "faults-trace": faults_trace,
    "compare-pipeline-metrics": compare_pipeline_metrics,
    "compare-run-config": compare_run_config,
    "evaluate-metrics": lambda tmp_path: evaluate_stage(tmp_path, "metrics.json"),
    "evaluate-timings": lambda tmp_path: evaluate_stage(tmp_path, "timings.json"),
    "study-results-file": study_results_file,
    "study-run-config": study_run_config,
    "study-tuned-json": study_tuned_json,
    "mlflow-run-state": mlflow_state,
}
"""What each case plants: one place a user command reads a file back."""
EXPECTED_WHAT = {
    "faults-trace": "train.faults.dropout.trace: file",
    "evaluate-metrics": "run metrics",
    "evaluate-timings": "timings file",
    "study-results-file": "study results file",
    "study-run-config": "run config",
    "study-tuned-json": "tuning choices",
    "mlflow-run-state": "MLflow run state",
}
"""The words naming the file in the refusal (those cases whose reader names it)."""


# --------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("scene", list(SCENES))
def test_a_fifo_where_a_command_reads_a_file_is_refused_in_one_line(tmp_path: Path, scene: str) -> None:
    planted = SCENES[scene](tmp_path)

    with unblocked_after(planted.fifo):
        line = planted.command()

    assert f"{str(planted.fifo)!r} is a FIFO, not a regular file" in line, line
    if scene in EXPECTED_WHAT:
        assert f"{EXPECTED_WHAT[scene]} {str(planted.fifo)!r}" in line, line
    assert planted.fifo.exists() and not planted.fifo.is_file()  # refused, not replaced

