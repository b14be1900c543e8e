"""A run's output folder: its name, the fingerprint its marker holds, and the provenance
(versions, machine, git commit) written beside the results. Every runtime writes its run
folder through these, so a folder names the same run whichever runtime trained it."""

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
from typing import Any

import torch
import yaml

from fedplug.output_folder import Legacy, files_named, write_text
from fedplug.safe_files import read_regular_bytes

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
            # Not read_text(): a FIFO put there since the scan is refused, not waited on.
            document = yaml.safe_load(read_regular_bytes(folder / "config.yaml", what="run config"))
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
