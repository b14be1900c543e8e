"""The MLflow backend of :func:`fedplug.tracking.open_tracker`: one MLflow run per training
run (params, per-round metrics with ``step = round``, the summary, tags, artifacts and the
model), created as ``mlflow.start_run`` creates runs and resumed after a restart through a
small state file. Layout and resuming: docs/pipeline.md, "The MLflow backend".
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedplug.errors import TrackingError
from fedplug.project import ensure_experiment
from fedplug.run.results import RoundRecord, RunResult
from fedplug.safe_files import read_regular_bytes
from fedplug.tracking.outage import OnError, Outbox, bounded_http_requests
from fedplug.tracking.payloads import params_payload, round_metrics, summary_metrics
from fedplug.tracking.store_faults import StoreUnavailable, store_fault

logger = logging.getLogger("fedplug.tracking")

MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The experiment tag that records model training versus a GenAI app (``mlflow/server/js``:
``ExperimentKind``; the UI's "Experiment type" selector of earlier MLflow 3 releases sets and
reads it). MLflow 3.17's UI takes its mode from the "GenAI / Model training" switch and the
link instead (:mod:`fedplug.tracking.ui`); the tag still says what the experiment holds."""
TRAINING_EXPERIMENT_KIND = "custom_model_development"
"""Its value for model training ("Machine learning" in the UI's selector)."""


MAX_LOGGED_CLIENT_IDS = 10_000
"""Most client ids one round's participants artifact holds (:func:`round_participants`):
a round of more clients keeps its first ones and says it was cut."""


def round_participants_file(round_number: int) -> str:
    """The run artifact naming round ``round_number``'s clients: ``rounds/round-0001.json``."""
    return f"rounds/round-{round_number:04d}.json"


def round_participants(record: RoundRecord) -> dict[str, Any]:
    """Who trained in ``record``'s round, as its MLflow artifact holds it: ``clients`` (at
    most :data:`MAX_LOGGED_CLIENT_IDS`; ``truncated`` says whether some were left out),
    ``chains`` (a grouper's chains; null when every client trained alone, or when cut)
    and ``participants``, the full count."""
    clients = list(record.clients or [])
    truncated = len(clients) > MAX_LOGGED_CLIENT_IDS
    return {
        "round": record.round,
        "participants": record.participants,
        "clients": clients[:MAX_LOGGED_CLIENT_IDS],
        "chains": None if truncated else record.chains,
        "truncated": truncated,
    }


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class MlflowTracker:
    """Logs one training run to MLflow, resuming the same MLflow run after a restart.

    Use :meth:`open`; then :meth:`log_params`, :meth:`log_round` (an observer for
    ``run_experiment(..., observers=[tracker.log_round])``), :meth:`log_history`,
    :meth:`log_result`, :meth:`log_artifacts` and :meth:`finish` (or :meth:`fail`).
    A server that stops answering costs a bounded wait and, with ``tracking.on_error:
    continue`` (the default), never stops training: the calls are kept and sent when it
    answers again (:mod:`fedplug.tracking.outage`). Any other MLflow failure surfaces as
    :class:`~fedplug.errors.TrackingError`.
    """

    def __init__(
        self,
        client: Any,
        run_id: str,
        state_path: Path | None,
        resumed: bool,
        logged_rounds: set[int],
        on_error: OnError = "continue",
        *,
        complete: bool = False,
        keep_finished: bool = False,
        experiment_id: str | None = None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.outbox = Outbox(str(client.tracking_uri), run_id, on_error)
        """Sends every logging call, keeping them through an outage of the server
        (:mod:`fedplug.tracking.outage`)."""
        self.state_path = state_path
        self.resumed = resumed
        """True when an earlier, interrupted MLflow run was re-opened."""
        self.logged_rounds = logged_rounds
        """Rounds (steps) whose metrics the MLflow run already holds."""
        self.complete = complete
        """True when the state file names this config's run as finished: the MLflow run
        holds everything already, and every logging call is skipped."""
        self.keep_finished = keep_finished
        """:meth:`finish` keeps the state file, marked finished, instead of deleting it."""
        self._experiment_id = experiment_id

    @classmethod
    def open(
        cls,
        uri: str,
        experiment_name: str,
        run_name: str,
        *,
        tags: Mapping[str, str] | None = None,
        state_path: str | os.PathLike[str] | None = None,
        fingerprint: str | None = None,
        parent_run_id: str | None = None,
        resume: bool = True,
        on_error: OnError = "continue",
        keep_finished: bool = False,
    ) -> MlflowTracker:
        """Start a run in ``experiment_name`` (created if missing), or re-open the run
        recorded in ``state_path`` when its fingerprint and URI match (a finished one is
        re-opened :attr:`complete`: nothing is logged to it again).

        Args:
            uri: tracking URI (from :func:`fedplug.tracking.mlflow_store.choose_tracking_uri`).
            experiment_name: the study's name.
            run_name: e.g. ``fedavg-seed0``.
            tags: set on a new run (default none).
            state_path: file that remembers the run id for resuming (default None: never
                resume).
            fingerprint: identifies the training run (the simulator's config fingerprint);
                a state file with another fingerprint is replaced, and the interrupted run
                it names is marked KILLED.
            parent_run_id: start a nested run under this run (default None: top level).
            resume: False never re-opens the recorded run (an unfinished one is marked
                KILLED).
            on_error: ``tracking.on_error``, what a server that stops answering later
                does to the run (:mod:`fedplug.tracking.outage`; default ``"continue"``).
            keep_finished: :meth:`finish` marks the state file finished instead of
                deleting it (default False), for an output folder that keeps its finished
                run (``fedplug run``'s, whose checkpoint stays).

        Opening waits a bounded time for the server (:func:`bounded_http_requests`).

        Raises:
            StoreUnavailable: the store is locked, corrupt, read-only or full
                (:mod:`fedplug.tracking.store_faults`); nothing was logged.
            TrackingError: MLflow refused to start the run.
        """
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        state_file = Path(state_path) if state_path is not None else None
        try:
            with bounded_http_requests():
                return cls._open(
                    MlflowClient(tracking_uri=uri),
                    uri,
                    experiment_name,
                    run_name,
                    tags,
                    state_file,
                    fingerprint,
                    parent_run_id,
                    resume,
                    on_error,
                    keep_finished,
                )
        except Exception as error:
            # A locked, corrupt, read-only or full store fails deep in sqlalchemy: name
            # the cause, and let open_tracker follow tracking.on_error.
            fault = store_fault(error)
            if fault is not None:
                raise StoreUnavailable(uri, fault) from None
            if isinstance(error, MlflowException):
                raise TrackingError(
                    f"MLflow at {uri} refused to start the run: {error.message}"
                ) from None
            raise

    @classmethod
    def _open(
        cls,
        client: Any,
        uri: str,
        experiment_name: str,
        run_name: str,
        tags: Mapping[str, str] | None,
        state_file: Path | None,
        fingerprint: str | None,
        parent_run_id: str | None,
        resume: bool,
        on_error: OnError,
        keep_finished: bool = False,
    ) -> MlflowTracker:
        """The body of :meth:`open`, whose MLflow errors it reports."""
        from mlflow.exceptions import MlflowException

        previous = _read_state(state_file)
        if previous and previous.get("tracking_uri") == uri:
            run_id: str | None = previous["run_id"]
            recorded: Any = None
            try:
                recorded = client.get_run(run_id)
            except MlflowException:
                run_id = None
            else:
                if recorded.info.lifecycle_stage == "deleted":
                    run_id = None  # deleted in the UI: log the run again
            finished = bool(previous.get("finished"))
            same_run = run_id is not None and resume and previous.get("fingerprint") == fingerprint
            if same_run and finished and recorded.info.status == "FINISHED":
                # The same command again after it finished: the MLflow run holds it all.
                mark_training_experiment(client, recorded.info.experiment_id)
                steps = {int(metric.step) for metric in client.get_metric_history(run_id, "accuracy")}
                return cls(client, run_id, state_file, resumed=False, logged_rounds=steps,
                           on_error=on_error, complete=True, keep_finished=keep_finished,
                           experiment_id=recorded.info.experiment_id)
            if same_run and not finished:
                mark_training_experiment(client, recorded.info.experiment_id)
                client.update_run(run_id, status="RUNNING")
                steps = {int(metric.step) for metric in client.get_metric_history(run_id, "accuracy")}
                return cls(client, run_id, state_file, resumed=True, logged_rounds=steps, on_error=on_error,
                           keep_finished=keep_finished, experiment_id=recorded.info.experiment_id)
            if run_id is not None and not finished:
                # An interrupted run of another config: it will never be continued.
                client.set_terminated(run_id, "KILLED")
        experiment_id = ensure_experiment(client, experiment_name, uri)
        mark_training_experiment(client, experiment_id)
        run = client.create_run(experiment_id, run_name=run_name, tags=start_run_tags(tags, parent_run_id))
        run_id = run.info.run_id
        if state_file is not None:
            _write_state(
                state_file, {"run_id": run_id, "fingerprint": fingerprint, "tracking_uri": uri}
            )
        return cls(client, run_id, state_file, resumed=False, logged_rounds=set(), on_error=on_error,
                   keep_finished=keep_finished, experiment_id=experiment_id)

    @property
    def uri(self) -> str:
        """The tracking URI this run lives at."""
        return str(self.client.tracking_uri)

    @property
    def experiment_id(self) -> str | None:
        """The id of the run's experiment (None: not known when the run was opened)."""
        return self._experiment_id

    # ---------------------------------------------------------------- logging

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (values converted by :func:`params_payload`), 100 per request."""
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in params_payload(params).items()]
        for chunk in _chunks(items, MAX_PARAMS_PER_BATCH):
            self._call("log params", self.client.log_batch, self.run_id, params=chunk)

    def log_round(self, record: RoundRecord) -> None:
        """Log one round's metrics at ``step = record.round``, and the clients that
        trained in it as the artifact :func:`round_participants_file`, unless already
        logged."""
        self.log_history([record])

    def log_history(self, records: Iterable[RoundRecord]) -> None:
        """Log every record whose round the MLflow run does not hold yet."""
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        pending = [record for record in records if record.round not in self.logged_rounds]
        metrics = [
            Metric(key, value, timestamp, record.round)
            for record in pending
            for key, value in round_metrics(record).items()
        ]
        for chunk in _chunks(metrics, MAX_METRICS_PER_BATCH):
            self._call("log round metrics", self.client.log_batch, self.run_id, metrics=chunk)
        for record in pending:
            if record.clients is not None:  # None: a round restored from an older checkpoint
                text = json.dumps(round_participants(record))
                path = round_participants_file(record.round)
                self._call(f"upload {path}", self.client.log_text, self.run_id, text, path)
        self.logged_rounds.update(record.round for record in pending)

    def log_result(self, result: RunResult) -> None:
        """Log the rounds not yet logged, the summary metrics and the derived params
        (under ``derived.``)."""
        from mlflow.entities import Metric

        self.log_history(result.history)
        timestamp = int(time.time() * 1000)
        final_step = len(result.history)
        metrics = [
            Metric(key, value, timestamp, final_step)
            for key, value in summary_metrics(result).items()
        ]
        self._call("log summary metrics", self.client.log_batch, self.run_id, metrics=metrics)
        self.log_params({f"derived.{key}": value for key, value in result.derived_params.items()})

    def log_artifacts(self, paths: Mapping[str, str | os.PathLike[str]]) -> None:
        """Upload files: ``{artifact folder: local file}`` (folder ``""`` = the root)."""
        for folder, path in paths.items():
            if not Path(path).is_file():
                raise TrackingError(f"cannot log {path} to MLflow: the file does not exist")
            self._call(
                f"upload {path}", self.client.log_artifact, self.run_id, str(path), folder or None
            )

    def log_model(
        self,
        model: Any,
        input_example: Any,
        *,
        name: str = "model",
        registered_model_name: str | None = None,
    ) -> str:
        """Log ``model`` as an MLflow PyTorch model at ``runs:/<run id>/<name>``.

        Args:
            model: a ``torch.nn.Module`` (its class must be importable where it is loaded).
            input_example: a small batch of inputs (``numpy.ndarray`` or ``torch.Tensor``);
                stored with the model, and the signature (input and output shapes) is
                inferred from it and the model's output on it.
            name: the model's artifact folder (default ``"model"``).
            registered_model_name: also register it as a new version of this model in the
                model registry (default None: not registered).

        Returns:
            The model URI ``runs:/<run id>/<name>``.
        """
        if self.complete:
            return f"runs:/{self.run_id}/{name}"  # logged when the run finished
        import numpy as np
        import torch
        from mlflow.models import infer_signature

        example = (
            input_example.detach().cpu().numpy()
            if isinstance(input_example, torch.Tensor)
            else np.asarray(input_example)
        )
        model = copy.deepcopy(model).to("cpu").eval()  # the caller's model stays where it is
        with torch.no_grad():
            output = model(torch.as_tensor(example)).numpy()
        # Distribution versions (torch.__version__ may carry a local tag such as +cu130).
        requirements = [
            f"{package}=={version}"
            for package in ("torch", "numpy", "fedplug")
            if (version := _package_version(package))
        ]
        # Through the outbox: a model the server cannot take now is sent when it answers.
        self._call(
            "log the model",
            self._upload_model,
            model,
            name=name,
            example=example,
            signature=infer_signature(example, output),
            registered_model_name=registered_model_name,
            requirements=requirements,
        )
        return f"runs:/{self.run_id}/{name}"

    def _upload_model(
        self,
        model: Any,
        *,
        name: str,
        example: Any,
        signature: Any,
        registered_model_name: str | None,
        requirements: list[str],
    ) -> None:
        """``mlflow.pytorch.log_model`` into this run, the process-wide URI left as it was."""
        import mlflow
        import mlflow.pytorch
        from mlflow.tracking._tracking_service import utils as tracking_utils

        # set_tracking_uri pins a process-wide URI and sets $MLFLOW_TRACKING_URI: put both
        # back exactly as they were, so later runs in this process still follow the env.
        previous_global_uri = tracking_utils._tracking_uri
        previous_env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        previous_experiment = os.environ.get("MLFLOW_EXPERIMENT_ID")
        # mlflow.pytorch.log_model writes through the fluent API, which reads the global URI
        # and, without an active run, puts the LoggedModel in the *active* experiment (the
        # Default one): then runs:/<id>/model does not resolve. Name the run's experiment.
        experiment_id = self.client.get_run(self.run_id).info.experiment_id
        mlflow.set_tracking_uri(self.uri)
        os.environ["MLFLOW_EXPERIMENT_ID"] = experiment_id
        try:
            mlflow.pytorch.log_model(
                pytorch_model=model,
                name=name,
                input_example=example,
                signature=signature,
                registered_model_name=registered_model_name,
                pip_requirements=requirements,  # explicit: inferring them spawns a process
                run_id=self.run_id,
            )
        finally:
            tracking_utils._tracking_uri = previous_global_uri
            if previous_env_uri is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = previous_env_uri
            if previous_experiment is None:
                os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
            else:
                os.environ["MLFLOW_EXPERIMENT_ID"] = previous_experiment

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run (overwriting tags of the same name)."""
        from mlflow.entities import RunTag

        items = [RunTag(key, str(value)) for key, value in tags.items()]
        self._call("set tags", self.client.log_batch, self.run_id, tags=items)

    def finish(self) -> None:
        """Mark the run FINISHED and forget the resume state (with :attr:`keep_finished`:
        mark it finished); while calls are still unsent (the server is down), keep the
        state, so that running the same command again re-opens this run and sends what it
        lacks. A :attr:`complete` run is left as it is."""
        if self.complete:
            return
        self._call("finish the run", self.client.set_terminated, self.run_id, "FINISHED")
        if self.outbox.close() and self.state_path is not None:
            state = _read_state(self.state_path)
            if self.keep_finished and state is not None and state["run_id"] == self.run_id:
                _write_state(self.state_path, {**state, "finished": True})
            else:
                self.state_path.unlink(missing_ok=True)

    def fail(self) -> None:
        """Mark the run FAILED but keep the resume state, so a re-run continues it.
        Never raises: it is called while another error is on its way up."""
        from mlflow.exceptions import MlflowException

        if self.complete:
            return  # the finished run stays FINISHED
        try:
            if self.outbox.pending and not self.outbox.flush(now=True):
                return  # the server is down: the resumed run sends what it lacks
            with bounded_http_requests():
                self.client.set_terminated(self.run_id, "FAILED")
        except (MlflowException, OSError, TrackingError) as error:  # the original error matters more
            logger.warning("could not mark MLflow run %s as FAILED: %s", self.run_id, error)

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` through :attr:`outbox` (None when kept for later,
        or skipped: a :attr:`complete` run is logged no more).

        Raises:
            TrackingError: MLflow refused the call, or did not answer and
                ``tracking.on_error`` is ``"stop"``.
        """
        if self.complete:
            return None
        return self.outbox.send(what, method, *args, **kwargs)


def mark_training_experiment(client: Any, experiment_id: str) -> None:
    """Tag experiment ``experiment_id`` ``mlflow.experimentKind = custom_model_development``
    (model training: runs, metrics, charts; not a GenAI app's traces) unless it already has a
    kind (one chosen in the UI stays)."""
    from mlflow.exceptions import MlflowException

    if EXPERIMENT_KIND_TAG in (client.get_experiment(experiment_id).tags or {}):
        return
    try:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT_KIND)
    except MlflowException:
        # Parallel runs (Ray tasks on one sqlite store) tag a new experiment at once: a
        # SQL store refuses the second insert, and the tag it refused is already there.
        if EXPERIMENT_KIND_TAG not in (client.get_experiment(experiment_id).tags or {}):
            raise


def start_run_tags(
    tags: Mapping[str, str] | None, parent_run_id: str | None = None
) -> dict[str, str]:
    """The tags ``mlflow.start_run`` gives a new run: what MLflow's run context providers
    resolve (source name and type, git commit, user), then ``tags``, then
    ``mlflow.parentRunId`` for a nested run."""
    from mlflow.tracking.context.registry import resolve_tags

    resolved = {key: str(value) for key, value in resolve_tags(dict(tags or {})).items()}
    if parent_run_id is not None:
        resolved["mlflow.parentRunId"] = parent_run_id
    return resolved


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _read_state(path: Path | None) -> dict[str, Any] | None:
    """The run recorded in the state file ``path`` (None: no file, or not a run's state).

    Raises:
        ConfigError: something other than a regular file lies at ``path`` (a FIFO is
            refused in one line, not waited on).
    """
    if path is None:
        return None
    try:
        state = json.loads(read_regular_bytes(path, what="MLflow run state", advice="remove it (it only names the MLflow run to resume)"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("run_id"), str) else None


def _write_state(path: Path, state: dict[str, Any]) -> None:
    """Atomically, through a unique temporary name, never through a symlink
    (:func:`fedplug.output_folder.write_text`)."""
    from fedplug.output_folder import write_text

    write_text(path, json.dumps(state, indent=2) + "\n")
