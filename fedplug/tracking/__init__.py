"""Tracking: every fedplug run logged to MLflow (and, optionally, TensorBoard or a
plugin's tracker) through one observer, :func:`open_tracker` (:mod:`.observer`), which
every runtime calls. Backends: :mod:`.mlflow_tracker` (one MLflow run per run, resumed
after a restart) and :mod:`.tensorboard_tracker`; beside them :mod:`.mlflow_store` (where
MLflow runs go, the server check), :mod:`.payloads` (what every backend logs),
:mod:`.outage` (calls kept while the server is down), :mod:`.store_faults` (a locked,
corrupt, read-only or full store named in one line), :mod:`.naming` (the experiment and
run names of ``fedplug run``) and :mod:`.ui` (links that open MLflow's UI on the runs).
The built-in backends register through the hook ``fedplug_register_trackers`` below,
exactly as a third-party plugin registers its own.
"""

from __future__ import annotations

from fedplug.hookspecs import RegisterTracker, hookimpl
from fedplug.project import (
    experiment_artifact_location as local_artifact_location,  # the older name
)
from fedplug.tracking.mlflow_store import (
    HEALTH_TIMEOUT_SECONDS,
    LOCAL_STORE_NAME,
    TrackingTarget,
    check_server,
    choose_tracking_uri,
    is_remote,
    local_tracking_uri,
    resolve_tracking_uri,
)
from fedplug.tracking.mlflow_tracker import MlflowTracker, start_run_tags
from fedplug.tracking.observer import (
    MLFLOW_STATE_NAME,
    TENSORBOARD_FOLDER,
    BackendFactory,
    Tracker,
    TrackerBackend,
    TrackerContext,
    config_fingerprint,
    open_mlflow,
    open_tensorboard,
    open_tracker,
    standard_tags,
)
from fedplug.tracking.payloads import params_payload, round_metrics, run_tags, summary_metrics

__all__ = [
    "HEALTH_TIMEOUT_SECONDS",
    "LOCAL_STORE_NAME",
    "MLFLOW_STATE_NAME",
    "TENSORBOARD_FOLDER",
    "BackendFactory",
    "MlflowTracker",
    "Tracker",
    "TrackerBackend",
    "TrackerContext",
    "TrackingTarget",
    "check_server",
    "choose_tracking_uri",
    "config_fingerprint",
    "is_remote",
    "local_artifact_location",
    "local_tracking_uri",
    "open_tracker",
    "params_payload",
    "resolve_tracking_uri",
    "round_metrics",
    "run_tags",
    "standard_tags",
    "start_run_tags",
    "summary_metrics",
]


@hookimpl
def fedplug_register_trackers(register: RegisterTracker) -> None:
    register("mlflow", open_mlflow)
    register("tensorboard", open_tensorboard)
