"""Run one experiment end to end and write its outputs (the I/O edge of the library)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import torch
import yaml

from fedplug.data.build import build_federation
from fedplug.output_folder import Legacy, claim, files_named, inspect, write_atomically, write_text
from fedplug.plugins import default_registry
from fedplug.registry import Registry
from fedplug.run.checkpoint import read_checkpoint
from fedplug.run.model import resolve_device
from fedplug.run.results import RoundRecord, RunResult
from fedplug.simulation.simulator import RoundObserver, Simulator

TRACKER_FILES = files_named(("mlflow_run.json",))
"""A folder holding only the tracker's state is fedplug's: a library caller opens the tracker
(:func:`fedplug.tracking.open_tracker`, which writes it) on ``out_dir`` before
:func:`run_experiment` claims the folder."""
RUN_FILES = files_named(
    ("config.yaml", "run_info.json", "metrics.json", "model.pt", "checkpoint.pt", "mlflow_run.json")
)
"""The files a run folder written before markers existed holds."""


def run_folder_layout(fingerprint: str) -> Legacy:
    """The ``legacy`` test of a run's output folder (:mod:`fedplug.output_folder`): a folder
    holding only the tracker's state, or only a run's files whose ``config.yaml`` is this
    config's (a run of an earlier fedplug, which the same command resumes), is adopted; any
    other folder without a marker is refused."""

    def recognise(folder: Path) -> list[str] | None:
        tracker_only = TRACKER_FILES(folder)
        if tracker_only is not None:
            return tracker_only
        files = RUN_FILES(folder)
        if files is None or "config.yaml" not in files:
            return None
        try:
            document = yaml.safe_load((folder / "config.yaml").read_text())
            written_for = sections_fingerprint(document["data"], document["train"])
        except (OSError, yaml.YAMLError, TypeError, KeyError):
            return None
        return files if written_for == fingerprint else None

    return recognise
REPORTED_PACKAGES = ("fedplug", "torch", "numpy", "pydantic", "pluggy", "ortools", "flwr", "mlflow", "dvc")


def default_output_dir(
    config: Any, algorithm: str | None = None, base: str | os.PathLike[str] | None = None
) -> Path:
    """``<base>/runs/<dataset>-<algorithm label>-<hash of data+train>`` (``base``: the
    config file's folder, where the MLflow store is; default None = a relative ``runs/``):
    the same command finds its own checkpoint, and the name says what ran (not the study,
    whose dataset ``--set`` may have changed). The label is :func:`algorithm_label`."""
    digest = output_fingerprint(config)[:10]
    name = f"{config.data.dataset.name}-{algorithm_label(config, algorithm)}-{digest}"
    return (Path(base) if base is not None else Path()) / "runs" / name


def algorithm_label(config: Any, algorithm: str | None = None) -> str:
    """What trained, in a folder name: ``algorithm`` (the ``--algorithm`` entry of the
    params file) when given, else the algorithm slots whose component is not the default,
    in slot order, joined by ``+`` (``fedprox+fedavgm``), else the aggregator (``fedavg``).
    Characters other than letters, digits and ``._+-`` become ``_``."""
    from fedplug.config import ALGORITHM_SLOTS, DEFAULT_COMPONENTS

    if algorithm:
        label = algorithm
    else:
        chosen = [getattr(config.train, slot).name for slot in ALGORITHM_SLOTS]
        label = "+".join(
            name for slot, name in zip(ALGORITHM_SLOTS, chosen, strict=True) if name != DEFAULT_COMPONENTS[slot]
        ) or config.train.aggregator.name
    return re.sub(r"[^A-Za-z0-9._+-]", "_", label)


def output_fingerprint(config: Any) -> str:
    """The hash of the resolved ``data`` and ``train`` sections: what an output folder's
    marker says it holds (:mod:`fedplug.output_folder`), so a folder holding another
    config's run is refused before it could be overwritten. It is computed before any
    data is loaded, unlike the checkpoint's fingerprint, which also covers the federation."""
    return sections_fingerprint(config.data.model_dump(mode="json"), config.train.model_dump(mode="json"))


def sections_fingerprint(data: Any, train: Any) -> str:
    """sha256 of the resolved ``data`` and ``train`` sections, as JSON with sorted keys."""
    resolved = json.dumps({"data": data, "train": train}, sort_keys=True)
    return hashlib.sha256(resolved.encode()).hexdigest()


def run_experiment(
    config: Any,
    out_dir: str | os.PathLike[str] | None,
    *,
    registry: Registry | None = None,
    observers: Iterable[RoundObserver] = (),
    resume: bool = True,
    federation: Any = None,
    force: bool = False,
) -> tuple[RunResult, Simulator]:
    """Build the federation, train, and (when ``out_dir`` is given) write
    ``metrics.json``, ``config.yaml`` (the resolved config), ``run_info.json`` and a
    per-round ``checkpoint.pt`` there: :func:`prepare_experiment`, then
    :func:`train_experiment`. ``force`` (default False) replaces a fedplug folder of
    another config (:func:`fedplug.output_folder.claim`); the run then starts over."""
    resume = resume and not replaces_output(config, out_dir, force)
    simulator = prepare_experiment(
        config, out_dir, registry=registry, observers=observers, resume=resume, federation=federation, force=force
    )
    return train_experiment(config, simulator, out_dir, resume=resume, force=force), simulator


def replaces_output(config: Any, out_dir: str | os.PathLike[str] | None, force: bool) -> bool:
    """Whether writing ``config``'s run to ``out_dir`` replaces another config's fedplug
    folder (only with ``force``): its checkpoint is then not resumed but deleted.

    Raises:
        ConfigError: ``out_dir`` is refused (:func:`fedplug.output_folder.inspect`).
    """
    if out_dir is None:
        return False
    fingerprint = output_fingerprint(config)
    return inspect(out_dir, fingerprint, force=force, legacy=run_folder_layout(fingerprint)) == "replace"


def prepare_experiment(
    config: Any,
    out_dir: str | os.PathLike[str] | None,
    *,
    registry: Registry | None = None,
    observers: Iterable[RoundObserver] = (),
    resume: bool = True,
    federation: Any = None,
    force: bool = False,
) -> Simulator:
    """Everything that can refuse a run, before anything is written: ``out_dir`` (a folder
    fedplug did not write, or of another config without ``force``, or one another run
    holds: :func:`fedplug.output_folder.inspect`), the federation, the simulator, and the
    checkpoint in ``out_dir`` when resuming (a corrupt one, or one of another config, is
    refused). More observers can join ``simulator.observers`` before
    :func:`train_experiment`."""
    registry = registry or default_registry()
    out = Path(out_dir) if out_dir is not None else None
    if replaces_output(config, out, force):
        resume = False  # the other config's checkpoint is deleted when the folder is claimed
    checkpoint = out / "checkpoint.pt" if out is not None else None
    if federation is None:
        federation = build_federation(config.data, registry, resolve_device(config.train.device))
    simulator = Simulator(
        config.train,
        federation,
        registry,
        target_accuracy=config.study.target_accuracy,
        checkpoint_path=checkpoint,
        observers=observers,
    )
    # Refuse a corrupt checkpoint, or one of another config, and data the loss transform's
    # setup phase cannot use, before anything is printed or written: out_dir keeps the
    # config.yaml that belongs to its checkpoint.
    simulator.prepare(resume=resume)
    return simulator


def train_experiment(
    config: Any,
    simulator: Simulator,
    out_dir: str | os.PathLike[str] | None,
    *,
    resume: bool = True,
    force: bool = False,
) -> RunResult:
    """Train a prepared experiment and write its files to ``out_dir`` (when given), which
    is claimed meanwhile (:func:`fedplug.output_folder.claim`: locked against a second run,
    marked with :func:`output_fingerprint`; ``force`` as in :func:`run_experiment`)."""
    if out_dir is None:
        return simulator.run(resume=resume)
    out = Path(out_dir)
    fingerprint = output_fingerprint(config)
    with claim(out, fingerprint, force=force, legacy=run_folder_layout(fingerprint)):
        write_yaml(out / "config.yaml", config.model_dump(mode="json"))
        write_json(out / "run_info.json", run_info())
        result = simulator.run(resume=resume)
        write_json(out / "metrics.json", result.summary())
        state = simulator.model.state_dict()
        write_atomically(out / "model.pt", lambda handle: torch.save(state, handle), what="model")
    return result


def checkpointed_rounds(out_dir: str | os.PathLike[str]) -> list[RoundRecord]:
    """The rounds the checkpoint in ``out_dir`` holds (empty without a readable one).

    A resumed run's tracker logs them before training continues, so its steps stay in
    order; :func:`run_experiment` still refuses a checkpoint of another config."""
    path = Path(out_dir) / "checkpoint.pt"
    if not path.is_file():
        return []
    try:
        state = read_checkpoint(path)  # weights only: a crafted file is refused, not run
        return [RoundRecord.from_dict(record) for record in state["history"]]
    except Exception:  # unreadable, refused or foreign: prepare_experiment reports it
        return []


def run_info() -> dict[str, Any]:
    """Versions, machine and git commit, stored with every run for reproducibility."""
    versions = {}
    for package in REPORTED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "packages": versions,
        "git_commit": git_commit(),
    }


def git_commit(folder: str | os.PathLike[str] | None = None) -> str | None:
    """The commit checked out in ``folder``'s git repository (default: the current
    folder), or None outside a repository."""
    try:
        completed = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False,
            cwd=folder,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return completed.stdout.strip() or None if completed.returncode == 0 else None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON, atomically and never through a symlink
    (:func:`fedplug.output_folder.write_atomically`)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_yaml(path: Path, data: Any) -> None:
    """Write ``data`` as YAML, like :func:`write_json`."""
    write_text(path, yaml.safe_dump(data, sort_keys=False))
