"""Run one experiment end to end and write its outputs (the I/O edge of the library)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import torch
import yaml

from fedplug.data.build import build_federation
from fedplug.plugins import default_registry
from fedplug.registry import Registry
from fedplug.simulation.checkpoint import read_checkpoint
from fedplug.simulation.results import RoundRecord, RunResult
from fedplug.simulation.simulator import RoundObserver, Simulator, resolve_device

REPORTED_PACKAGES = ("fedplug", "torch", "numpy", "pydantic", "pluggy", "ortools", "flwr", "mlflow", "dvc")


def default_output_dir(config: Any) -> Path:
    """``runs/<dataset>-<aggregator>-<hash of data+train>``: the same command finds its own
    checkpoint, and the name says what ran (not the study, whose dataset ``--set`` may
    have changed)."""
    resolved = json.dumps({"data": config.data.model_dump(mode="json"), "train": config.train.model_dump(mode="json")}, sort_keys=True)
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:10]
    return Path("runs") / f"{config.data.dataset.name}-{config.train.aggregator.name}-{digest}"


def run_experiment(
    config: Any,
    out_dir: str | os.PathLike[str] | None,
    *,
    registry: Registry | None = None,
    observers: Iterable[RoundObserver] = (),
    resume: bool = True,
    federation: Any = None,
) -> tuple[RunResult, Simulator]:
    """Build the federation, train, and (when ``out_dir`` is given) write
    ``metrics.json``, ``config.yaml`` (the resolved config), ``run_info.json`` and a
    per-round ``checkpoint.pt`` there: :func:`prepare_experiment`, then
    :func:`train_experiment`."""
    simulator = prepare_experiment(
        config, out_dir, registry=registry, observers=observers, resume=resume, federation=federation
    )
    return train_experiment(config, simulator, out_dir, resume=resume), simulator


def prepare_experiment(
    config: Any,
    out_dir: str | os.PathLike[str] | None,
    *,
    registry: Registry | None = None,
    observers: Iterable[RoundObserver] = (),
    resume: bool = True,
    federation: Any = None,
) -> Simulator:
    """Everything that can refuse a run, before anything is written: the federation,
    the simulator, and the checkpoint in ``out_dir`` when resuming (a corrupt one, or
    one of another config, is refused). More observers can join ``simulator.observers``
    before :func:`train_experiment`."""
    registry = registry or default_registry()
    out = Path(out_dir) if out_dir is not None else None
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
    config: Any, simulator: Simulator, out_dir: str | os.PathLike[str] | None, *, resume: bool = True
) -> RunResult:
    """Train a prepared experiment and write its files to ``out_dir`` (when given)."""
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_yaml(out / "config.yaml", config.model_dump(mode="json"))
        write_json(out / "run_info.json", run_info())
    result = simulator.run(resume=resume)
    if out is not None:
        write_json(out / "metrics.json", result.summary())
        torch.save(simulator.model.state_dict(), out / "model.pt")
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
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(temporary, path)


def write_yaml(path: Path, data: Any) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
