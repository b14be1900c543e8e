"""Start a fedplug experiment on FedML: ``mpirun`` with one server and W worker ranks.

:func:`run_fedml` (or ``python -m fedplug.adapters.fedml run CONFIG --out DIR``) writes
what ``fedplug run`` writes plus FedML's config, log and home folder, and logs the run to
MLflow itself (not rank 0, which runs behind the loopback guard).
Guide: docs/fedml.md, 'Quick start' and 'Tracking'.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedplug.errors import ConfigError, FedplugError, TrainingError
from fedplug.run.results import RunResult
from fedplug.safe_files import read_regular_bytes

if TYPE_CHECKING:
    from fedplug.tracking import Tracker

from . import guard
from .rank import ABANDONED_FILE
from .runtime import check_supported, fedml_config

logger = logging.getLogger("fedplug.adapters.fedml")

DEFAULT_WORKERS = 2
DEFAULT_TIMEOUT_SECONDS = 3600.0
LOG_TAIL_CHARACTERS = 4000
STOP_GRACE_SECONDS = 10.0


@dataclass
class FedMLRun:
    """The outcome of :func:`run_fedml`."""

    result: RunResult
    out_dir: Path
    blocked_network: dict[int, list[str]]
    """Per rank, the connections the loopback guard refused (empty when FedML stayed on
    this machine)."""
    seconds: float
    """Wall time of the ``mpirun`` command, process start-up included."""
    abandoned_ranks: list[int] = field(default_factory=list)
    """Worker ranks that missed a ``client_timeout_seconds`` deadline and had not finished
    when the run was over; rank 0 saved the result and ended the job without them
    (normally empty)."""
    mlflow_run_id: str | None = None
    """The MLflow run the launcher logged (None: tracking off)."""
    mlflow_uri: str | None = None
    """Its tracking URI."""
    model_uri: str | None = None
    """``runs:/<id>/model``: the final model as an MLflow model (None: tracking off)."""


def find_mpirun() -> str:
    """The ``mpirun`` on ``PATH``.

    Raises:
        FedplugError: Open MPI is not installed.
    """
    path = shutil.which("mpirun")
    if path is None:
        raise FedplugError(
            "mpirun not found: the FedML adapter runs FedML over MPI; install Open MPI "
            "(Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev, or `make fedml-venv` as root)"
        )
    return path


def run_fedml(
    config: Any,
    out_dir: str | os.PathLike[str],
    *,
    workers: int = DEFAULT_WORKERS,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    threads_per_rank: int = 1,
    python: str | None = None,
    track: bool | None = None,
    algorithm: str | None = None,
    project_root: str | os.PathLike[str] | None = None,
) -> FedMLRun:
    """Run a validated experiment ``config`` on FedML and return its result.

    Args:
        config: a validated experiment (:func:`fedplug.config.load_experiment`).
        out_dir: the run folder (created).
        workers: worker ranks W (default 2); client ``k`` trains on worker ``k mod W``.
        timeout: seconds before the whole MPI job is killed (default 3600).
        threads_per_rank: torch/OpenMP threads of each rank (default 1; the ranks share
            the machine's cores).
        python: the interpreter of the FedML environment (default: this one).
        track: log the run through :func:`fedplug.tracking.open_tracker` (default None:
            the config's ``tracking.enabled``).
        algorithm: the tracked run's label: its name ``<algorithm>-seed<seed>-<dataset>-<config
            hash>`` and tag ``fedplug.algorithm`` (default: the aggregator's name).
        project_root: folder of the default local store ``mlflow.db`` (default
            ``$DVC_ROOT``, else the working folder).

    Raises:
        ConfigError: the config asks for something FedML cannot run.
        TrainingError: a rank failed or the job timed out; the message quotes the
            failing rank's error and the log's tail.
        TrackingError: tracking is on and the tracking server does not answer (before
            any rank starts).
    """
    check_supported(config)
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if threads_per_rank < 1:
        raise ConfigError(f"--threads-per-rank must be at least 1, got {threads_per_rank}")
    if config.train.failures.max_round_retries > 0:
        logger.warning(
            "train.failures.max_round_retries = %d is not used on FedML: FedML cannot replay a round, so a "
            "round with too many failed clients stops the run",
            config.train.failures.max_round_retries,
        )
    if python is None and importlib.util.find_spec("fedml") is None:
        raise FedplugError(
            "FedML is not installed in this Python environment; build the FedML one with `make fedml-venv` "
            "and run .venv-fedml/bin/python -m fedplug.adapters.fedml"
        )
    from fedplug.project import project_root as find_project_root
    from fedplug.tracking.naming import open_command_line_tracker

    mpirun = find_mpirun()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Never resumes: a FedML run starts from round 1 every time.
    tracker = open_command_line_tracker(
        config,
        out,
        "fedml",
        algorithm=algorithm,
        resume=False,
        project_root=project_root if project_root is not None else find_project_root(),
        enabled=track,
    )
    with tracker:  # FINISHED on success, FAILED on an error
        try:
            run = _run_mpi(config, out, mpirun, workers, timeout, threads_per_rank, python)
        except FedplugError:
            if tracker.enabled:
                _log_partial_history(tracker, out / "run_result.json")
            raise
        if tracker.enabled:
            _log_finished_run(tracker, config, run)
            run.mlflow_run_id, run.mlflow_uri = tracker.run_id, tracker.uri
            run.model_uri = tracker.model_uri
    return run


def _log_finished_run(tracker: Tracker, config: Any, run: FedMLRun) -> None:
    """The result, the final model (rebuilt here from ``model.pt`` with the server's
    test inputs as the input example) and the run's files."""
    import torch

    from fedplug.data.build import load_dataset
    from fedplug.plugins import default_registry

    tracker.log_result(run.result)
    registry = default_registry()
    dataset = load_dataset(config.data, registry)
    with torch.random.fork_rng(devices=[]):
        model = registry.build(
            "models", config.train.model, tuple(dataset.input_shape), dataset.num_classes
        )
    from fedplug.run.checkpoint import load_weights_only

    # Weights only: a model.pt swapped in for a crafted pickle is refused, never run.
    state = load_weights_only(
        run.out_dir / "model.pt", "model file", "delete the run folder and run again"
    )
    model.load_state_dict(state)
    model.eval()
    tracker.log_model(model, torch.as_tensor(dataset.test_x[:5], dtype=torch.float32))
    for name in ("config.yaml", "run_info.json", "metrics.json", "fedml_config.yaml"):
        tracker.log_artifacts({"": run.out_dir / name})  # one call each: the key is the folder


def _log_partial_history(tracker: Tracker, path: Path) -> None:
    """The rounds a failed run finished (rank 0 writes them after every round)."""
    try:
        tracker.log_history(_load_result(path).history)
    except (OSError, ValueError, KeyError, TypeError):  # no rounds, or a half-written file
        return


def _run_mpi(
    config: Any,
    out: Path,
    mpirun: str,
    workers: int,
    timeout: float,
    threads_per_rank: int,
    python: str | None,
) -> FedMLRun:
    from fedplug.run_folder import run_info, write_json, write_yaml

    for stale in [
        *out.glob("error-rank*.json"),
        *out.glob("network-rank*.json"),
        out / "metrics.json",
        out / "run_result.json",
        out / ABANDONED_FILE,
    ]:
        stale.unlink(missing_ok=True)
    resolved = config.model_dump(mode="json")
    write_yaml(out / "config.yaml", resolved)
    # The ranks read the data where this process does: a relative data.root is the config
    # file's folder's (DataConfigBase.root_path), which the ranks cannot know.
    data_root = str(config.data.root_path().resolve())
    write_json(out / "experiment.json", {**resolved, "data": {**resolved["data"], "root": data_root}})
    write_yaml(out / "fedml_config.yaml", fedml_config(config, workers))
    write_json(out / "run_info.json", run_info())
    home = out / "fedml_home"
    home.mkdir(exist_ok=True)
    environment = {**os.environ, **guard.fedml_environment(str(home.resolve()), threads_per_rank)}
    command = [
        mpirun,
        "-np",
        str(workers + 1),
        python or sys.executable,
        "-m",
        "fedplug.adapters.fedml.rank",
        "--experiment",
        str(out / "experiment.json"),
        "--fedml-config",
        str(out / "fedml_config.yaml"),
        "--out",
        str(out),
        "--workers",
        str(workers),
    ]
    log_path = out / "fedml.log"
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(process)
            raise TrainingError(
                f"the FedML run did not finish within {timeout:.0f} s and was stopped; "
                f"log {log_path}:\n{_tail(log_path)}"
            ) from None
    seconds = time.perf_counter() - started
    abandoned = _abandoned_ranks(out)
    if returncode != 0 and abandoned is None:
        raise _rank_failure(out, returncode, log_path)
    if abandoned:
        logger.warning(
            "the FedML run finished without worker rank(s) %s, which missed a "
            "train.failures.client_timeout_seconds deadline (or, without one, the server's "
            "one-hour wait for a step) and did not finish; their clients' "
            "updates were dropped (see %s)",
            abandoned,
            log_path,
        )
    summary_path = out / "run_result.json"
    if not summary_path.exists() or not (out / "model.pt").exists():
        raise TrainingError(
            f"mpirun exited 0 but the server wrote no result; log {log_path}:\n{_tail(log_path)}"
        )
    return FedMLRun(
        result=_load_result(summary_path),
        out_dir=out,
        blocked_network=_blocked_network(out),
        seconds=seconds,
        abandoned_ranks=abandoned or [],
    )


def _abandoned_ranks(out: Path) -> list[int] | None:
    """The ranks of rank 0's ``abandoned-ranks.json`` (``None``: no such note, or an
    unreadable one)."""
    try:
        return [int(rank) for rank in _read_rank_json(out / ABANDONED_FILE)["ranks"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End ``mpirun`` and its ranks: SIGTERM (mpirun forwards it to every rank and cleans
    up), then SIGKILL to the whole process group after a grace period."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        process.wait()


def _read_rank_json(path: Path) -> Any:
    """The JSON a rank wrote into the run folder: a FIFO, socket or device planted there is
    refused in one line, not waited on."""
    return json.loads(read_regular_bytes(path, what="FedML rank file", advice="remove it and run again"))


def _load_result(path: Path) -> RunResult:
    return RunResult.from_dict(_read_rank_json(path))


def _blocked_network(out: Path) -> dict[int, list[str]]:
    found = {}
    for path in sorted(out.glob("network-rank*.json")):
        found[int(path.stem.removeprefix("network-rank"))] = _read_rank_json(path)
    return found


def _rank_failure(out: Path, returncode: int, log_path: Path) -> FedplugError:
    errors = [_read_rank_json(path) for path in sorted(out.glob("error-rank*.json"))]
    if not errors:
        return TrainingError(
            f"mpirun exited with code {returncode}; log {log_path}:\n{_tail(log_path)}"
        )
    first = errors[0]
    message = f"rank {first['rank']} failed: {first['type']}: {first['message']}"
    if first["type"] == "ConfigError":
        return ConfigError(message)
    traceback_file = out / f"error-rank{first['rank']}.json"
    return TrainingError(f"{message}\n(full traceback in {traceback_file}, log {log_path})")


def _tail(path: Path) -> str:
    try:
        return read_regular_bytes(path).decode(errors="replace")[-LOG_TAIL_CHARACTERS:]
    except (OSError, FedplugError):  # the tail only adds to another error's message
        return "(no log)"


def _project_of(config_path: str) -> Path:
    from fedplug.project import project_root

    return project_root(config_path)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedplug.adapters.fedml run CONFIG --out DIR [--workers W] ...``"""
    parser = argparse.ArgumentParser(
        prog="python -m fedplug.adapters.fedml",
        description="Run a fedplug experiment on FedML over MPI.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run an experiment config on FedML")
    run_parser.add_argument("config", help="fedplug experiment YAML (params.yaml is one)")
    run_parser.add_argument("--out", required=True, help="run folder")
    run_parser.add_argument(
        "--workers", type=int, default=DEFAULT_WORKERS, help="worker ranks (default 2)"
    )
    run_parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value, e.g. --set train.rounds=5",
    )
    run_parser.add_argument("--algorithm", help="apply the file's algorithms.<NAME> entry to train")
    run_parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help="seconds before the job is killed (default 3600)",
    )
    run_parser.add_argument(
        "--threads-per-rank", type=int, default=1, help="torch threads per rank (default 1)"
    )
    tracking = run_parser.add_mutually_exclusive_group()
    tracking.add_argument(
        "--track",
        dest="track",
        action="store_true",
        default=None,
        help="log the run to MLflow even when tracking.enabled is false",
    )
    tracking.add_argument(
        "--no-track", dest="track", action="store_false", help="log nothing to MLflow"
    )
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from fedplug.config import load_experiment

    try:
        config = load_experiment(options.config, options.overrides, options.algorithm)
        run = run_fedml(
            config,
            options.out,
            workers=options.workers,
            timeout=options.timeout,
            threads_per_rank=options.threads_per_rank,
            track=options.track,
            algorithm=options.algorithm,
            project_root=_project_of(options.config),
        )
    except FedplugError as error:
        print(f"fedplug (FedML): error: {error}", file=sys.stderr)
        return 2
    summary = run.result.summary()
    refused = sum(len(attempts) for attempts in run.blocked_network.values())
    print(
        f"final accuracy {summary['final_accuracy']:.4f} after {summary['rounds']} rounds on FedML "
        f"({options.workers} workers, {run.seconds:.0f} s); refused outside connections: {refused}; "
        f"wrote {run.out_dir / 'metrics.json'}"
    )
    if run.mlflow_run_id is not None:
        print(f"MLflow run {run.mlflow_run_id} in {run.mlflow_uri}; model {run.model_uri}")
    return 0
