"""What a study's hyperparameter search (:mod:`fedplug.study.tuning`) keeps outside its
trials file: the choices in ``tuned.json`` and its MLflow runs (the tuning parent run of a
study folder, each trial's run nested under it, the choices logged on the parent).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedplug.registry import Registry
from fedplug.safe_files import read_regular_bytes
from fedplug.study.spec import StudySpec

TUNED_NAME = "tuned.json"
"""The file in a study folder that keeps each search's choice."""

OpenTracker = Callable[[Any, int, Mapping[str, Any]], Any]
"""Opens a trial's tracker: (the trial's config, its number, its values) -> tracker."""


@dataclass
class TuningTracking:
    """Where trials are logged: the MLflow store and the tuning parent run."""

    uri: str
    parent: str
    experiment: str
    root: Path


def read_tuned(path: Path) -> dict[str, dict[str, Any]]:
    """``tuned.json``'s entries (empty when it is missing or unreadable: the searches run again).

    Raises:
        ConfigError: a FIFO, socket or device lies at ``path`` (refused in one line, not
            waited on).
    """
    try:
        content = json.loads(
            read_regular_bytes(path, what="tuning choices", advice="remove it (the searches run again)")
        )
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def write_tuned(out: Path, entries: Mapping[str, Any], fingerprint: str, legacy: Any) -> None:
    """Write ``tuned.json`` into the claimed study folder ``out``."""
    from fedplug.output_folder import claim, write_text

    with claim(out, fingerprint, legacy=legacy, force_option=None):
        write_text(out / TUNED_NAME, json.dumps(entries, indent=2, sort_keys=True) + "\n")


def open_tuning_parent(spec: StudySpec, config: Any, out: Path, mlflow_root: Path) -> TuningTracking:
    """The study folder's tuning parent run (created on first use), in the store the
    study's runs log to: ``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else the
    project's."""
    from fedplug.project import find_or_create_parent_run, project_root, relocate_project_store
    from fedplug.tracking import choose_tracking_uri

    root = project_root(mlflow_root / "params.yaml")
    target = choose_tracking_uri(config.tracking.uri, config.tracking.fallback_to_local, root)
    relocate_project_store(target.uri, root)
    experiment = f"study-{spec.name}"
    resolved = out.resolve()
    try:
        key = f"tune:{resolved.relative_to(root)}"
    except ValueError:
        key = f"tune:{resolved}"
    parent = find_or_create_parent_run(target.uri, experiment, key, f"{out.name}-tuning",
                                       tags={"fedplug.study": spec.name, "fedplug.tuning": "true"})
    print(f"study {spec.name}: tuning logged to MLflow parent run {parent} at {target.uri}", flush=True)
    return TuningTracking(target.uri, parent, experiment, root)


def trial_tracker_opener(spec: StudySpec, algorithm: str, tracking: TuningTracking | None,
                         registry: Registry | None) -> OpenTracker:
    """Opens each trial's MLflow run, nested under the tuning parent (a tracker that logs
    nothing without ``tracking``)."""
    from fedplug.tracking.observer import Tracker, open_tracker

    def open_trial(config: Any, number: int, values: Mapping[str, Any]) -> Any:
        if tracking is None:
            return Tracker({})
        tags = {"fedplug.algorithm": algorithm, "study.name": spec.name, "tune.trial": str(number),
                **{f"tune.{path}": repr(value) for path, value in values.items()}}
        return open_tracker(config, None, run_name=f"{algorithm}-trial{number}", parent=tracking.parent, tags=tags,
                            resume=False, project_root=tracking.root, experiment_name=tracking.experiment,
                            uri=tracking.uri, backends=["mlflow"], enabled=True, registry=registry)

    return open_trial


def log_tuning_summary(tracking: TuningTracking, choices: Mapping[str, Any], out: Path) -> None:
    """The choices on the tuning parent run (``<algorithm>.<path>`` and
    ``<algorithm>.best_value``; ``<algorithm>/<cell id>.…`` with ``per_cell``, MLflow
    refusing ``@`` in a name; ``tuned.json``), then FINISHED. ``choices``: search key ->
    :class:`~fedplug.study.tuning.Choice`."""
    from fedplug.project import log_parent_summary

    metrics: dict[str, float] = {}
    for choice_key, choice in choices.items():
        key = choice_key.replace("@", "/")
        metrics[f"{key}.best_value"] = choice.value
        for path, value in choice.params.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[f"{key}.{path}"] = float(value)
    log_parent_summary(tracking.uri, tracking.parent, metrics, [("", out / TUNED_NAME)])


