"""Where MLflow runs go: the tracking URI (``tracking.uri``, ``MLFLOW_TRACKING_URI`` or the
project's ``sqlite:///<project>/mlflow.db``), a remote server's health probe before any
training, and the local store's artifact folder. Details: docs/pipeline.md, "MLflow"."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedplug.errors import TrackingError

LOCAL_STORE_NAME = "mlflow.db"
HEALTH_TIMEOUT_SECONDS = 3.0
REMOTE_SCHEMES = ("http://", "https://")


def local_tracking_uri(project_root: str | os.PathLike[str]) -> str:
    """``sqlite:///<absolute project root>/mlflow.db``, the default local store."""
    return f"sqlite:///{(Path(project_root) / LOCAL_STORE_NAME).resolve()}"


def resolve_tracking_uri(
    configured: str | None,
    project_root: str | os.PathLike[str],
    environ: Mapping[str, str] | None = None,
) -> str:
    """The tracking URI to use.

    Args:
        configured: ``tracking.uri`` from the params (default None: not set).
        project_root: folder of the local store ``mlflow.db``.
        environ: environment to read ``MLFLOW_TRACKING_URI`` from (default None:
            ``os.environ``).

    Returns:
        ``configured`` when set, else ``MLFLOW_TRACKING_URI`` when set and not empty, else
        :func:`local_tracking_uri`.
    """
    environ = os.environ if environ is None else environ
    if configured:
        return configured
    from_environment = environ.get("MLFLOW_TRACKING_URI", "").strip()
    if from_environment:
        return from_environment
    return local_tracking_uri(project_root)


def is_remote(uri: str) -> bool:
    """True for an MLflow tracking server (``http://`` or ``https://``)."""
    return uri.lower().startswith(REMOTE_SCHEMES)


def check_server(uri: str, timeout: float = HEALTH_TIMEOUT_SECONDS) -> None:
    """Probe ``<uri>/health`` of a tracking server.

    Args:
        uri: an ``http(s)://`` tracking URI; other schemes are not probed.
        timeout: seconds to wait for the answer (default 3).

    Raises:
        TrackingError: no answer within ``timeout`` seconds, a refused connection, or a
            status other than 200.
    """
    if not is_remote(uri):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise TrackingError(
            f"the MLflow tracking server {uri} does not answer ({reason}); start it, fix "
            "tracking.uri or MLFLOW_TRACKING_URI, or set tracking.fallback_to_local: true to "
            "log to the local store instead"
        ) from None
    if status != 200:
        raise TrackingError(
            f"the MLflow tracking server {uri} answered {url} with HTTP {status}; is it an "
            "MLflow server? Fix tracking.uri or MLFLOW_TRACKING_URI, or set "
            "tracking.fallback_to_local: true"
        )


@dataclass(frozen=True)
class TrackingTarget:
    """Where a run will be logged, decided before training starts."""

    uri: str
    """The tracking URI to log to."""
    requested_uri: str
    """The URI the config or environment asked for."""
    fallback_reason: str | None = None
    """Why the local store is used instead of ``requested_uri`` (None: no fallback)."""


def choose_tracking_uri(
    configured: str | None,
    fallback_to_local: bool,
    project_root: str | os.PathLike[str],
    environ: Mapping[str, str] | None = None,
    timeout: float = HEALTH_TIMEOUT_SECONDS,
) -> TrackingTarget:
    """Resolve the URI and make sure it can be used, before any training.

    Args:
        configured: ``tracking.uri`` (default None).
        fallback_to_local: ``tracking.fallback_to_local``: on an unreachable server, use
            the local store (True) or raise (False).
        project_root: folder of the local store.
        environ: environment for ``MLFLOW_TRACKING_URI`` (default ``os.environ``).
        timeout: seconds to wait for the server's health check (default 3).

    Raises:
        TrackingError: the server is unreachable and ``fallback_to_local`` is False, or a
            local ``sqlite:`` store's folder does not exist.
    """
    requested = resolve_tracking_uri(configured, project_root, environ)
    try:
        check_server(requested, timeout)
    except TrackingError as error:
        if not fallback_to_local:
            raise
        return TrackingTarget(
            local_tracking_uri(project_root), requested, fallback_reason=str(error)
        )
    if requested.startswith("sqlite:///"):
        folder = Path(requested.removeprefix("sqlite:///")).parent
        if not folder.is_dir():
            raise TrackingError(
                f"the tracking store {requested} lies in {folder}, which does not exist; "
                "create the folder or fix tracking.uri / MLFLOW_TRACKING_URI"
            )
    return TrackingTarget(requested, requested)
