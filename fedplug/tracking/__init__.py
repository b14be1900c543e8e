"""Tracking: every fedplug run logged to MLflow (and, optionally, TensorBoard or a
plugin's tracker) through one observer.

- :mod:`fedplug.tracking.observer`: :func:`open_tracker` and :class:`Tracker`, what every
  runtime calls; the backend protocol plugins implement (:class:`TrackerBackend`).
- :mod:`fedplug.tracking.mlflow_tracker`: the MLflow backend (one MLflow run per run,
  resumed after a restart).
- :mod:`fedplug.tracking.mlflow_store`: where MLflow runs go (URI resolution, the server
  check, the local store).
- :mod:`fedplug.tracking.payloads`: the metrics, params and tags every backend logs.
- :mod:`fedplug.tracking.outage`: keeping calls while the tracking server is down.
- :mod:`fedplug.tracking.tensorboard_tracker`: the TensorBoard backend.
- :mod:`fedplug.tracking.naming`: the experiment and run names of ``fedplug run``.
- :mod:`fedplug.tracking.ui`: links that open MLflow's UI on the runs.

Built-in backends are registered by the hook ``fedplug_register_trackers`` below, exactly
as a third-party plugin registers its own.
"""

from __future__ import annotations

from fedplug.hookspecs import RegisterTracker, hookimpl
from fedplug.tracking.mlflow_store import (
    HEALTH_TIMEOUT_SECONDS,
    LOCAL_STORE_NAME,
    TrackingTarget,
    check_server,
    choose_tracking_uri,
    is_remote,
    local_artifact_location,
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
