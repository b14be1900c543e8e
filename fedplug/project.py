"""The project a run belongs to: its root folder, its local MLflow store, and parent runs.

:func:`project_root` (``DVC_ROOT`` first, so ``dvc exp run --temp`` runs land in the
original project), :func:`ensure_experiment` (artifacts beside ``mlflow.db``),
:func:`relocate_local_store` (a copied project's store names its own ``mlruns/``) and
:func:`find_or_create_parent_run` (a parent run per study or DVC experiment).
Guide: docs/pipeline.md, 'Where runs go: the project's store' and 'A project you can copy'.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from fedplug.errors import TrackingError

STORE_NAME = "mlflow.db"
ARTIFACTS_FOLDER = "mlruns"
PARENT_TAG = "fedplug.parent"
"""Tag that identifies a parent run (its value: the study or DVC experiment key)."""
SQLITE_PREFIX = "sqlite:///"


def project_root(
    params_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """The project's root folder.

    Args:
        params_path: the params file a script read (default None).
        environ: environment to read ``DVC_ROOT`` from (default ``os.environ``).

    Returns:
        ``$DVC_ROOT`` when DVC runs the process (it names the original repository even in a
        ``--temp`` or queued experiment's temporary copy), else the folder of
        ``params_path``, else the current directory; always absolute.
    """
    environ = os.environ if environ is None else environ
    dvc_root = environ.get("DVC_ROOT", "").strip()
    if dvc_root and Path(dvc_root).is_dir():
        return Path(dvc_root).resolve()
    if params_path is not None:
        return Path(params_path).resolve().parent
    return Path.cwd().resolve()


def local_store_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI (None for any other URI)."""
    if not uri.startswith(SQLITE_PREFIX):
        return None
    return Path(uri.removeprefix(SQLITE_PREFIX))


def experiment_artifact_location(uri: str) -> str | None:
    """``file://<folder of mlflow.db>/mlruns`` for a local store (every experiment's runs
    in ``mlruns/<run id>/``, as :mod:`fedplug.tracking` creates them); None (the server
    decides) for any other store."""
    database = local_store_path(uri)
    if database is None:
        return None
    return (database.resolve().parent / ARTIFACTS_FOLDER).as_uri()


def ensure_experiment(client: Any, experiment_name: str, uri: str) -> str:
    """The id of MLflow experiment ``experiment_name``, created if missing (in a local
    store with the artifact location :func:`experiment_artifact_location`).

    Raises:
        TrackingError: the experiment was deleted, or MLflow refused to create it.
    """
    from mlflow.exceptions import MlflowException

    try:
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None:
            try:
                return str(
                    client.create_experiment(
                        experiment_name,
                        artifact_location=experiment_artifact_location(uri),
                    )
                )
            except MlflowException:
                # Another process (a parallel stage) created it in between.
                experiment = client.get_experiment_by_name(experiment_name)
                if experiment is None:
                    raise
    except MlflowException as error:
        raise TrackingError(
            f"MLflow at {uri} refused to create experiment {experiment_name!r}: {error.message}"
        ) from None
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {experiment_name!r} was deleted; restore it "
            "(`mlflow experiments restore`) or choose another name"
        )
    return str(experiment.experiment_id)


# --------------------------------------------------------------- copied projects


def _local_path(location: str) -> tuple[bool, Path] | None:
    """``(is a file URI, path)`` of a local artifact location, None for a remote one."""
    if location.startswith("file://"):
        return True, Path(unquote(urlparse(location).path))
    if location.startswith("/"):
        return False, Path(location)
    return None


def relocate_project_store(uri: str, root: str | os.PathLike[str]) -> int:
    """:func:`relocate_local_store` when ``uri`` is the project's own default store
    ``<root>/mlflow.db``; any other store (a shared sqlite file, a server) is left alone,
    since its artifact paths are its owner's choice. Returns the experiments relocated."""
    database = local_store_path(uri)
    if database is None or database.resolve() != (Path(root) / STORE_NAME).resolve():
        return 0
    return relocate_local_store(uri)


def relocate_local_store(uri: str) -> int:
    """Point a copied local store's artifact paths at its own ``mlruns/``.

    Every experiment whose artifact location is a local ``<other folder>/mlruns`` or
    ``<other folder>/mlruns/<id>`` gets the same under the folder of ``mlflow.db``, and the
    artifact paths of its runs, logged models and model versions follow. A store whose
    paths already point at its own folder, a missing database and non-``sqlite:///`` URIs
    are left alone.

    Returns:
        The number of experiments relocated (0: nothing to do).
    """
    database = local_store_path(uri)
    if database is None or not database.is_file():
        return 0
    own = database.parent.resolve() / ARTIFACTS_FOLDER
    connection = sqlite3.connect(database, timeout=60)
    try:
        tables = {
            row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        if "experiments" not in tables:
            return 0
        moves = []
        for experiment_id, location in connection.execute(
            "SELECT experiment_id, artifact_location FROM experiments"
        ):
            local = _local_path(location or "")
            if local is None:
                continue
            is_uri, path = local
            if path.name == ARTIFACTS_FOLDER:  # file://<folder>/mlruns (fedplug's layout)
                base, target = path, own
            elif path.parent.name == ARTIFACTS_FOLDER:  # <folder>/mlruns/<id> (MLflow's default)
                base, target = path.parent, own / path.name
            else:
                continue
            if base == own:
                continue
            moves.append((experiment_id, location, target.as_uri() if is_uri else str(target)))
        if not moves:
            return 0
        with connection:  # one transaction: a reader sees the old paths or the new ones
            for experiment_id, old, new in moves:
                connection.execute(
                    "UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                    (new, experiment_id),
                )
                for table, column, scoped in (
                    ("runs", "artifact_uri", True),
                    ("logged_models", "artifact_location", True),
                    ("model_versions", "storage_location", False),
                    ("model_versions", "source", False),
                ):
                    if table not in tables:
                        continue
                    where = f"substr({column}, 1, ?) = ?"
                    arguments: list[Any] = [new, len(old) + 1, len(old) + 1, old + "/"]
                    if scoped:
                        where += " AND experiment_id = ?"
                        arguments.append(experiment_id)
                    connection.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE {where}",
                        arguments,
                    )
        return len(moves)
    except sqlite3.Error as error:
        raise TrackingError(
            f"could not update the artifact paths of the copied store {database}: {error}; "
            "is another process writing it? Try again"
        ) from None
    finally:
        connection.close()


# ------------------------------------------------------------------- parent runs


def find_parent_run(client: Any, experiment_id: str, key: str) -> Any | None:
    """The oldest run of ``experiment_id`` tagged ``fedplug.parent = key`` (None: none)."""
    quoted = key.replace("\\", "\\\\").replace("'", "\\'")
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{quoted}'",
        max_results=10,
        order_by=["attributes.start_time ASC"],
    )
    return runs[0] if runs else None


def find_or_create_parent_run(
    uri: str,
    experiment_name: str,
    key: str,
    run_name: str,
    tags: Mapping[str, str] | None = None,
) -> str:
    """The id of the parent run ``key`` in ``experiment_name``, created on first use.

    Idempotent: every process that asks for the same key gets the same run (the oldest run
    tagged ``fedplug.parent = key``; a duplicate created by a concurrent process is
    deleted). A finished parent that receives new children is set back to RUNNING.

    Args:
        uri: tracking URI.
        experiment_name: the MLflow experiment (created if missing, see
            :func:`ensure_experiment`).
        key: identifies the group, e.g. ``dvc-exp:three-rounds@1a2b3c4`` or
            ``study:fedshift``.
        run_name: the parent's display name.
        tags: more tags for a new parent (the source and git tags MLflow's
            ``start_run`` sets are added).

    Raises:
        TrackingError: MLflow failed.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from mlflow.tracking.context.registry import resolve_tags

    try:
        client = MlflowClient(tracking_uri=uri)
        experiment_id = ensure_experiment(client, experiment_name, uri)
        existing = find_parent_run(client, experiment_id, key)
        if existing is not None:
            if existing.info.status != "RUNNING":
                client.update_run(existing.info.run_id, status="RUNNING")
            return str(existing.info.run_id)
        run = client.create_run(
            experiment_id,
            run_name=run_name,
            tags=resolve_tags({**dict(tags or {}), PARENT_TAG: key}),
        )
        oldest = find_parent_run(client, experiment_id, key)
        if oldest is not None and oldest.info.run_id != run.info.run_id:
            client.delete_run(run.info.run_id)
            return str(oldest.info.run_id)
        return str(run.info.run_id)
    except MlflowException as error:
        raise TrackingError(
            f"MLflow at {uri} could not find or create the parent run {key!r}: {error.message}"
        ) from None


def log_parent_summary(
    uri: str,
    run_id: str,
    metrics: Mapping[str, float],
    files: Sequence[tuple[str, str | os.PathLike[str]]],
    status: str = "FINISHED",
) -> None:
    """Give a parent run the group's comparison and end it: ``metrics`` (e.g.
    ``fedavg.final_accuracy``, no step) and ``files`` (``(artifact folder, file)`` pairs,
    folder ``""`` = the root; missing files are skipped), then ``status``.

    Raises:
        TrackingError: MLflow failed.
    """
    import math
    import time

    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    timestamp = int(time.time() * 1000)
    values = [
        Metric(key, float(value), timestamp, 0)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ]
    try:
        for start in range(0, len(values), 1000):
            client.log_batch(run_id, metrics=values[start : start + 1000])
        for folder, path in files:
            if Path(path).is_file():
                client.log_artifact(run_id, str(path), folder or None)
        client.set_terminated(run_id, status)
    except MlflowException as error:
        raise TrackingError(
            f"MLflow at {uri} could not log the summary of parent run {run_id}: {error.message}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedplug.project relocate [ROOT]``: point the artifact paths of
    ``ROOT/mlflow.db`` (default: the current folder's) at ``ROOT/mlruns`` (``make ui`` runs
    it first, so a copied project's UI shows its own artifacts)."""
    import sys

    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] != "relocate" or len(arguments) > 2:
        print("usage: python -m fedplug.project relocate [PROJECT_ROOT]", file=sys.stderr)
        return 2
    root = Path(arguments[1]) if len(arguments) == 2 else Path.cwd()
    moved = relocate_local_store(f"{SQLITE_PREFIX}{(root / STORE_NAME).resolve()}")
    if moved:
        print(
            f"{root / STORE_NAME}: artifact paths of {moved} experiment(s) now point at "
            f"{root / ARTIFACTS_FOLDER}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
