"""One tracking observer for every runtime: :func:`open_tracker`.

Every runtime opens its run with :func:`open_tracker` and gets a :class:`Tracker`, which
logs params, per-round metrics, tags (:func:`standard_tags`), the result and the model to
every backend in ``tracking.backends`` (built in: ``mlflow``, ``tensorboard``; a plugin
adds one through ``fedplug_register_trackers``). What each holds: docs/pipeline.md,
"The MLflow backend".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Protocol, runtime_checkable

from fedplug.components import SLOTS as ALGORITHM_SLOTS
from fedplug.errors import TrackingError
from fedplug.run.results import RoundRecord, RunResult
from fedplug.tracking.store_faults import StoreUnavailable

logger = logging.getLogger("fedplug.tracking")

MLFLOW_STATE_NAME = "mlflow_run.json"
"""File in the run's output folder that remembers the MLflow run id for resuming."""
TENSORBOARD_FOLDER = "tensorboard"
"""Folder in the run's output folder that holds the TensorBoard event files."""
DVC_ENVIRONMENT_TAGS = {"DVC_EXP_NAME": "dvc.exp_name", "DVC_EXP_BASELINE_REV": "dvc.baseline_rev"}
"""What ``dvc exp run`` sets in a stage's environment (dvc/env.py,
dvc/repo/experiments/queue/base.py), and the tag each becomes."""


@runtime_checkable
class TrackerBackend(Protocol):
    """One place runs are logged to (MLflow, TensorBoard, a plugin's)."""

    logged_rounds: set[int]
    """Rounds this backend already holds; :class:`Tracker` never sends them again."""

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_round(self, record: RoundRecord) -> None: ...
    def log_result(self, result: RunResult) -> None: ...
    def log_model(self, model: Any, input_example: Any, *, registered_model_name: str | None = None) -> str | None: ...
    def log_artifacts(self, paths: Mapping[str, str | os.PathLike[str]]) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def finish(self) -> None: ...
    def fail(self) -> None: ...


@dataclass(frozen=True)
class TrackerContext:
    """What a backend factory receives: everything :func:`open_tracker` was given."""

    config: Any
    """The validated experiment config (``study``, ``tracking``, ``data``, ``train``)."""
    out_dir: Path | None
    """The run's output folder (resume state, event files); None: keep nothing on disk."""
    run_name: str
    experiment_name: str
    tags: Mapping[str, str]
    """Every tag of the run (:func:`standard_tags` and the caller's)."""
    fingerprint: str
    """Identifies the training run; an interrupted run is continued only when it matches."""
    resume: bool
    parent: str | None
    """The parent MLflow run id of a nested run (None: a top-level run)."""
    project_root: Path
    """Folder of the default local MLflow store ``mlflow.db``."""
    uri: str | None
    """An MLflow tracking URI chosen by the caller (None: decide from ``tracking``)."""
    keep_finished: bool = False
    """The output folder keeps its finished run: remember it there, so that the same run
    started again logs nothing (``fedplug run``; see :func:`open_tracker`)."""


BackendFactory = Callable[[TrackerContext], TrackerBackend]


class Tracker:
    """Logs one training run to every backend; returned by :func:`open_tracker`.

    A round observer: pass :meth:`log_round` as ``observers=[tracker.log_round]``. Use it
    as a context manager to :meth:`finish` on success and :meth:`fail` on an exception.
    Rounds a backend already holds (a resumed run) are never logged twice.
    """

    def __init__(self, backends: Mapping[str, TrackerBackend], register_model: str | None = None) -> None:
        self.backends = dict(backends)
        """The open backends by name (``"mlflow"``, ``"tensorboard"``, ...)."""
        self.register_model = register_model
        self.model_uri: str | None = None
        """``runs:/<run id>/model`` once :meth:`log_model` logged to MLflow."""

    # --------------------------------------------------------------- identity

    @property
    def mlflow(self) -> Any:
        """The MLflow backend (a :class:`~fedplug.tracking.MlflowTracker`), or None."""
        return self.backends.get("mlflow")

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (None when MLflow is not a backend)."""
        return self.mlflow.run_id if self.mlflow is not None else None

    @property
    def uri(self) -> str | None:
        """The MLflow tracking URI (None when MLflow is not a backend)."""
        return self.mlflow.uri if self.mlflow is not None else None

    @property
    def experiment_id(self) -> str | None:
        """The MLflow experiment's id (None when MLflow is not a backend)."""
        return self.mlflow.experiment_id if self.mlflow is not None else None

    @property
    def resumed(self) -> bool:
        """True when a backend continued an interrupted run."""
        return any(getattr(backend, "resumed", False) for backend in self.backends.values())

    @property
    def complete(self) -> bool:
        """True when the MLflow run already holds this finished run (opened with
        ``keep_finished``): nothing new is logged to it."""
        return bool(self.mlflow is not None and getattr(self.mlflow, "complete", False))

    @property
    def logged_rounds(self) -> set[int]:
        """Rounds every backend already holds."""
        held = [set(backend.logged_rounds) for backend in self.backends.values()]
        return set.intersection(*held) if held else set()

    @property
    def enabled(self) -> bool:
        """False for the tracker of a run with tracking switched off (no backends)."""
        return bool(self.backends)

    # ---------------------------------------------------------------- logging

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (values as strings, lists as JSON)."""
        for backend in self.backends.values():
            backend.log_params(params)

    def log_round(self, record: RoundRecord) -> None:
        """Log one round at ``step = record.round`` to each backend that lacks it."""
        for backend in self.backends.values():
            if record.round not in backend.logged_rounds:
                backend.log_round(record)

    def log_history(self, records: Iterable[RoundRecord]) -> None:
        """Log many rounds (e.g. those a checkpoint restored)."""
        for record in records:
            self.log_round(record)

    def log_result(self, result: RunResult) -> None:
        """Log the rounds not logged yet, the summary metrics (``final_accuracy``, ...)
        and the derived params under ``derived.``."""
        self.log_history(result.history)
        for backend in self.backends.values():
            backend.log_result(result)

    def log_model(self, model: Any, input_example: Any) -> str | None:
        """Log the final model (MLflow: ``mlflow.pytorch.log_model`` with a signature
        inferred from ``input_example``, registered under ``tracking.register_model`` when
        that is set). Returns the MLflow model URI ``runs:/<run id>/model``, or None."""
        uri = None
        for name, backend in self.backends.items():
            logged = backend.log_model(model, input_example, registered_model_name=self.register_model)
            if name == "mlflow":
                uri = logged
        self.model_uri = uri
        return uri

    def log_artifacts(self, paths: Mapping[str, str | os.PathLike[str]]) -> None:
        """Upload files: ``{artifact folder: local file}`` (folder ``""`` = the root)."""
        for backend in self.backends.values():
            backend.log_artifacts(paths)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for backend in self.backends.values():
            backend.set_tags(tags)

    def finish(self) -> None:
        """Mark the run complete and forget its resume state."""
        for backend in self.backends.values():
            backend.finish()

    def fail(self) -> None:
        """Mark the run failed, keeping its resume state. Never raises."""
        for name, backend in self.backends.items():
            try:
                backend.fail()
            except Exception as error:  # the error on its way up matters more
                logger.warning("tracker %s could not mark the run as failed: %s", name, error)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        error_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error_type is None:
            self.finish()
        else:
            self.fail()


# ------------------------------------------------------------------------ opening


def open_tracker(
    config: Any,
    out_dir: str | os.PathLike[str] | None,
    *,
    run_name: str,
    parent: str | None = None,
    tags: Mapping[str, str] | None = None,
    resume: bool = True,
    fingerprint: str | None = None,
    project_root: str | os.PathLike[str] | None = None,
    experiment_name: str | None = None,
    uri: str | None = None,
    backends: Sequence[str] | None = None,
    enabled: bool | None = None,
    registry: Any = None,
    keep_finished: bool = False,
) -> Tracker:
    """Open the run's tracker, log its params and tags, and return it.

    Args:
        config: the validated experiment config.
        out_dir: the run's output folder: it keeps ``mlflow_run.json`` (the MLflow run to
            continue after an interruption) and ``tensorboard/`` (default None: nothing on
            disk, no resuming).
        run_name: e.g. ``fedavg-seed0``.
        parent: MLflow run id of the parent run; the run is nested under it (default None).
        tags: extra tags, set after :func:`standard_tags` (default none).
        resume: continue the run recorded in ``out_dir`` when its fingerprint matches
            (default True); False starts a new run.
        fingerprint: identifies the training run, e.g. the simulator's config fingerprint
            (default None: a hash of ``config.data`` and ``config.train``).
        project_root: folder of the default local store ``mlflow.db`` (default: the
            current folder).
        experiment_name: the MLflow experiment (default ``config.study.name``).
        uri: an MLflow tracking URI the caller already chose (default None:
            :func:`~fedplug.tracking.choose_tracking_uri` from ``tracking.uri`` and
            ``tracking.fallback_to_local``).
        backends: names of the backends (default ``config.tracking.backends``).
        enabled: track at all (default ``config.tracking.enabled``); False returns a
            tracker without backends that logs nothing.
        registry: the plugin registry whose trackers to use (default: the environment's).
        keep_finished: ``out_dir`` keeps the finished run (its checkpoint stays, as
            ``fedplug run``'s does): once finished, ``mlflow_run.json`` stays there marked
            finished, and opening the same run (same fingerprint) again logs nothing to
            MLflow (:attr:`Tracker.complete`) instead of a duplicate run (default False:
            the file is deleted, and a re-run is a new MLflow run).

    Raises:
        TrackingError: an unknown backend, an unreachable server, a missing package, a
            store that cannot be used with ``tracking.on_error: stop`` (with ``continue``,
            the default, one warning and the run goes on without it: :func:`open_backend`).
    """
    tracking = config.tracking
    if enabled is None:
        enabled = tracking.enabled
    if not enabled:
        return Tracker({})
    if registry is None:
        from fedplug.plugins import default_registry

        registry = default_registry()
    root = Path(project_root) if project_root is not None else Path.cwd()
    all_tags = {**standard_tags(config, root), **dict(tags or {})}
    context = TrackerContext(
        config=config,
        out_dir=Path(out_dir) if out_dir is not None else None,
        run_name=run_name,
        experiment_name=experiment_name or config.study.name,
        tags=all_tags,
        fingerprint=fingerprint or config_fingerprint(config),
        resume=resume,
        parent=parent,
        project_root=root,
        uri=uri,
        keep_finished=keep_finished,
    )
    names = list(dict.fromkeys(backends if backends is not None else tracking.backends))
    factories = {name: registry.tracker(name) for name in names}  # unknown names fail first
    opened: dict[str, TrackerBackend] = {}
    try:
        for name, factory in factories.items():
            backend = open_backend(factory, context)
            if backend is not None:
                opened[name] = backend
        tracker = Tracker(opened, register_model=tracking.register_model)
        from fedplug.config import flatten

        tracker.log_params(flatten(config))
    except BaseException:
        Tracker(opened).fail()
        raise
    return tracker


def open_backend(factory: BackendFactory, context: TrackerContext) -> TrackerBackend | None:
    """``factory(context)``, or None when its store cannot be used (locked, corrupt,
    read-only, full: :class:`~fedplug.tracking.store_faults.StoreUnavailable`) and
    ``tracking.on_error`` is ``continue``: one warning names the cause and the run trains
    without that backend. With ``stop`` the run ends there, before training, in one line.

    Raises:
        TrackingError: the store cannot be used and ``tracking.on_error`` is ``stop``.
    """
    try:
        return factory(context)
    except StoreUnavailable as unavailable:
        if getattr(context.config.tracking, "on_error", "continue") == "stop":
            raise TrackingError(unavailable.stopping()) from None
        # The output folder keeps its finished run (fedplug run): the same command, run
        # again, trains nothing and logs the whole run (its rounds are in the checkpoint).
        logger.warning("%s", unavailable.going_on(rerun_logs_it=context.keep_finished))
        return None


def config_fingerprint(config: Any) -> str:
    """A hash of ``config.data`` and ``config.train``: what makes two runs the same."""
    resolved = json.dumps(
        {"data": config.data.model_dump(mode="json"), "train": config.train.model_dump(mode="json")},
        sort_keys=True,
    )
    return hashlib.sha256(resolved.encode()).hexdigest()


def standard_tags(
    config: Any, project_root: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The tags every run carries: fedplug's version, the git commit, the dataset, the
    partition, the model, each algorithm slot, and under ``dvc exp run`` the experiment
    name and baseline rev."""
    from fedplug.run_folder import git_commit
    from fedplug.tracking.mlflow_tracker import _package_version

    environ = os.environ if environ is None else environ
    tags = {
        "fedplug.version": _package_version("fedplug") or "unknown",
        "dataset": config.data.dataset.name,
        "partition": config.data.partition.name,
        "model": config.train.model.name,
    }
    # The project's commit; for a project outside git, the commit fedplug itself runs from.
    commit = git_commit(project_root) or git_commit(Path(__file__).resolve().parent)
    if commit:
        tags["fedplug.git_commit"] = commit
    for slot in ALGORITHM_SLOTS:
        tags[slot] = getattr(config.train, slot).name
    for variable, tag in DVC_ENVIRONMENT_TAGS.items():
        if environ.get(variable):
            tags[tag] = environ[variable]
    return tags


# ----------------------------------------------------------------- built-in backends


def open_mlflow(context: TrackerContext) -> TrackerBackend:
    """MLflow: params, per-round metrics, tags, model (tracking.uri, default <project>/mlflow.db).

    Opens a :class:`~fedplug.tracking.MlflowTracker` run."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise TrackingError(
            "tracking.backends names mlflow, which is not installed; install it "
            "(pip install 'fedplug[pipeline]'), or pass --no-track / set tracking.enabled: false"
        ) from None
    from fedplug.tracking.mlflow_store import choose_tracking_uri
    from fedplug.tracking.mlflow_tracker import MlflowTracker

    uri = context.uri
    fallback_from = None
    if uri is None:
        tracking = context.config.tracking
        target = choose_tracking_uri(tracking.uri, tracking.fallback_to_local, context.project_root)
        uri = target.uri
        if target.fallback_reason:
            logger.warning("%s; logging to the local store %s instead", target.fallback_reason, uri)
            fallback_from = target.requested_uri
    tracker = MlflowTracker.open(
        uri,
        context.experiment_name,
        context.run_name,
        tags=context.tags,
        state_path=context.out_dir / MLFLOW_STATE_NAME if context.out_dir is not None else None,
        fingerprint=context.fingerprint,
        parent_run_id=context.parent,
        resume=context.resume,
        on_error=getattr(context.config.tracking, "on_error", "continue"),
        keep_finished=context.keep_finished,
    )
    if fallback_from:
        tracker.set_tags({"fedplug.tracking_fallback_from": fallback_from})
    return tracker


def open_tensorboard(context: TrackerContext) -> TrackerBackend:
    """TensorBoard: per-round scalars in <run folder>/tensorboard/ (pip install tensorboard)."""
    from fedplug.tracking.tensorboard_tracker import TensorBoardTracker

    if context.out_dir is None:
        raise TrackingError("the tensorboard tracker writes into the run's output folder; give the run an output folder")
    tracker = TensorBoardTracker.open(context.out_dir / TENSORBOARD_FOLDER, resume=context.resume)
    tracker.set_tags(context.tags)
    return tracker

