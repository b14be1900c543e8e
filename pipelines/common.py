"""What every pipeline stage shares: reading its slice of params.yaml, validating it with
the library's pydantic models, quiet telemetry, torch threads, and turning user errors into
one clear line and exit status 2.

Stages run from the repository root (DVC's working directory for ``dvc.yaml``), so every
default path here is relative to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

# Telemetry off in everything the pipeline starts (the Makefile exports the same).
for _name, _value in (
    ("MLFLOW_DISABLE_TELEMETRY", "true"),
    ("DVC_NO_ANALYTICS", "1"),
    ("DO_NOT_TRACK", "1"),
):
    os.environ.setdefault(_name, _value)

from pydantic import BaseModel, ValidationError

from fedplug.config import component_entry, deep_merge, format_validation_error, read_yaml
from fedplug.errors import ConfigError, FedplugError

PARAMS_FILE = Path("params.yaml")
PARTITION_DIR = Path("data/partition")
SETUP_DIR = Path("data/setup")
# The pipeline's training runs live apart from `runs/`, where `fedplug run` writes ad-hoc
# runs: an ad-hoc run must not make the `evaluate` stage (which depends on this folder) stale.
RUNS_DIR = Path("reports/runs")
REPORTS_DIR = Path("reports")
THREADS_VARIABLE = "FEDPLUG_TORCH_THREADS"  # fedplug.threads.THREADS_VARIABLE

Model = TypeVar("Model", bound=BaseModel)


def read_params(path: str | os.PathLike[str] = PARAMS_FILE) -> dict[str, Any]:
    """The whole params file as a dict (each stage then takes only its slice)."""
    return read_yaml(path)


def section(params: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """``params["a"]["b"]`` for ``"a.b"``; ``default`` when a key is missing."""
    node: Any = params
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def validate_model(model: type[Model], data: Any, where: str) -> Model:
    """Validate ``data`` with ``model``; errors name the dotted path under ``where``."""
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as error:
        raise ConfigError(
            "invalid config:\n" + format_validation_error(error, data, prefix=where)
        ) from None


def validate_component(registry: Any, kind: str, data: Any, where: str) -> Any:
    """Validate one component entry (``{"name": ..., params}``) with the config class
    registered under its name, e.g. ``data.dataset`` or ``train.loss_transform``."""
    data = component_entry(data)
    if not isinstance(data, dict) or "name" not in data:
        raise ConfigError(
            f"invalid config:\n{where}: missing 'name:'; choose one of: {', '.join(registry.names(kind))}"
        )
    if data["name"] not in registry.names(kind):
        raise ConfigError(
            f"invalid config:\n{where}: unknown {kind[:-1].replace('_', ' ')} {data['name']!r}; "
            f"registered: {', '.join(registry.names(kind))}"
        )
    return validate_model(registry.get(kind, data["name"]).config_class, data, where)


def algorithm_labels(params: dict[str, Any]) -> list[str]:
    """The labels of ``algorithms`` (the train matrix), in file order."""
    algorithms = params.get("algorithms") or {}
    if not isinstance(algorithms, dict) or not algorithms:
        raise ConfigError(
            "params.yaml: `algorithms` must map at least one label to train overrides, e.g. fedavg: {}"
        )
    for label, override in algorithms.items():
        if override is not None and not isinstance(override, dict):
            raise ConfigError(
                f"algorithms.{label}: expected a mapping of train overrides, got {type(override).__name__}"
            )
    return [str(label) for label in algorithms]


def merged_train_slot(params: dict[str, Any], label: str, slot: str) -> Any:
    """``train.<slot>`` with ``algorithms.<label>.<slot>`` applied (as
    :func:`fedplug.config.with_algorithm` would), without touching other slots."""
    base = (
        {slot: section(params, f"train.{slot}")}
        if section(params, f"train.{slot}") is not None
        else {}
    )
    override = (params.get("algorithms") or {}).get(label) or {}
    merged = deep_merge(base, {slot: override[slot]} if slot in override else {})
    return merged.get(slot)


def set_torch_threads(train: Any = None) -> int:
    """torch's threads for a stage, chosen as every fedplug runtime chooses them
    (:func:`fedplug.threads.choose_threads`): ``train.threads`` when a validated ``train``
    section is given, else ``$FEDPLUG_TORCH_THREADS``, else 1 (the models are small, and on
    a shared few-core machine extra threads mostly wait on each other); returns the count.

    Raises:
        ConfigError: ``$FEDPLUG_TORCH_THREADS`` is not a whole number from 0 to 1024.
    """
    from fedplug.threads import choose_run_threads, choose_threads

    if train is not None:
        return choose_run_threads(train)
    return choose_threads(None)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """Run a stage's ``main``; a :class:`FedplugError` becomes one line on stderr and exit
    status 2 (DVC then stops and shows it)."""
    try:
        status = main(argv)
    except FedplugError as error:
        print(f"fedplug pipeline: error: {error}", file=sys.stderr)
        status = 2
    sys.exit(status)


def load_federation(
    data_config: Any, registry: Any, device: Any, partition_path: str | os.PathLike[str]
) -> Any:
    """The federation of ``data_config`` on ``device``, split by the partition stage's file.

    Raises:
        DataError: the partition file is missing or was made for another dataset or
            client count (re-run the partition stage).
    """
    from fedplug.data.build import build_federation, load_dataset
    from fedplug.data.partitions import load_partition
    from fedplug.errors import DataError

    dataset = load_dataset(data_config, registry)
    partition = load_partition(partition_path)
    partition.validate(dataset.num_train)
    if partition.num_clients != data_config.num_clients:
        raise DataError(
            f"{partition_path} splits the data over {partition.num_clients} clients but data.num_clients is "
            f"{data_config.num_clients}; re-run the partition stage (`dvc repro partition`)"
        )
    return build_federation(data_config, registry, device, dataset=dataset, partition=partition)


def validate_device(value: Any, where: str) -> str:
    """Check a ``train.device`` value with the library's own field definition."""
    from pydantic import create_model

    from fedplug.config import TrainConfigBase

    device_slice = create_model("DeviceSlice", device=(str, TrainConfigBase.model_fields["device"]))
    return validate_model(
        device_slice, {"device": "cpu" if value is None else value}, where.rsplit(".", 1)[0]
    ).device


@dataclass(frozen=True)
class RunGroup:
    """The DVC experiment (or plain ``dvc repro``) a train stage belongs to: the train
    stages of one experiment are nested under one MLflow parent run."""

    key: str
    """Finds the parent run (its ``fedplug.parent`` tag), e.g. ``dvc-exp:three-rounds@1a2b3c4``."""
    label: str
    """The parent run's name and the suffix of its children's names, e.g. ``three-rounds``."""
    tags: dict[str, str]
    """Tags of the parent run."""


def dvc_run_group(root: Path, environ: Mapping[str, str] | None = None) -> RunGroup:
    """The group of this stage: the DVC experiment named by ``DVC_EXP_NAME`` (DVC sets it,
    with ``DVC_EXP_BASELINE_REV``, in every ``dvc exp run``, queued and ``--temp`` ones
    included), else a plain ``dvc repro`` of the commit checked out in ``root``.

    Experiment names are unique per baseline commit only, so the key holds both; a
    resumed stage of the same experiment (or a ``dvc repro`` of the same commit) finds the
    same parent."""
    environ = os.environ if environ is None else environ
    name = environ.get("DVC_EXP_NAME", "").strip()
    baseline = environ.get("DVC_EXP_BASELINE_REV", "").strip()[:7]
    if name:
        tags = {"dvc.exp_name": name}
        if baseline:
            tags["dvc.baseline_rev"] = environ["DVC_EXP_BASELINE_REV"].strip()
        return RunGroup(f"dvc-exp:{name}@{baseline}", name, tags)
    commit = git_head(root)
    label = f"repro-{commit[:7]}" if commit else "repro"
    return RunGroup(f"dvc-repro:{commit or 'no-git'}", label, {"dvc.repro_rev": commit or ""})


def git_head(root: Path) -> str | None:
    """The commit checked out in ``root`` (None outside git)."""
    try:
        completed = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = completed.stdout.strip()
    return commit if completed.returncode == 0 and commit else None
