"""A ready ServerApp / ClientApp pair that runs any fedplug experiment on Flower.

``server_app`` / ``client_app`` for ``flwr run`` (the experiment in the run config,
``fedplug-config`` and friends; see ``examples/flower_app``), and
:func:`make_server_app` / :func:`make_client_app` for ``run_simulation``.
Design: docs/flower.md, 'Design notes: apps'.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ConfigRecord, Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedplug.config import (
    apply_override,
    parse_yaml,
    read_yaml,
    validate_experiment,
    with_algorithm,
)
from fedplug.data.build import load_dataset
from fedplug.errors import ConfigError
from fedplug.output_folder import claim, write_atomically
from fedplug.registry import Registry
from fedplug.run.model import resolve_device
from fedplug.run.results import RunResult
from fedplug.run_folder import (
    output_fingerprint,
    run_folder_layout,
    run_info,
    write_json,
    write_yaml,
)
from fedplug.threads import choose_run_threads

from .capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
from .flower_log import report_fedplug_errors_in_one_line
from .nodes import (
    experiment_message_config,
    handle_evaluate,
    handle_query,
    handle_setup_phase,
    handle_train,
)
from .records import number
from .setup_phase import register_setup_phases, setup_phase_names
from .strategy import FedplugStrategy, RoundObserver, central_evaluation

if TYPE_CHECKING:
    from fedplug.tracking import Tracker

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

RUN_CONFIG_PATH = "fedplug-config"
RUN_CONFIG_YAML = "fedplug-config-yaml"
RUN_CONFIG_ALGORITHM = "fedplug-algorithm"
RUN_CONFIG_OVERRIDES = "fedplug-set"
RUN_CONFIG_OUT = "fedplug-out"
RUN_CONFIG_FEDERATED_EVALUATION = "fedplug-federated-evaluation"
RUN_CONFIG_NODE_WAIT = "fedplug-node-wait-seconds"
RUN_CONFIG_RESUME = "fedplug-resume"
RUN_CONFIG_TRACK = "fedplug-track"
CHECKPOINT_FILE = "checkpoint.pt"
DEFAULT_DATA_ROOT = "data/raw"
"""``data.root`` when a config leaves it out (the config schema's default)."""

ExperimentSource = Any
"""A validated experiment config, a dict of one, or a path to a YAML file."""


def resolve_data_root(data: dict[str, Any], base: str | os.PathLike[str]) -> dict[str, Any]:
    """``data`` (an experiment mapping read from a file in folder ``base``) with a
    relative ``data.root`` made absolute against ``base``.

    A Flower ServerApp runs in the SuperLink's working folder (or a SuperExec's), and
    the nodes in theirs; reading ``data/raw`` there would download a second copy of the
    dataset. Relative to the experiment file, it means what ``fedplug run params.yaml``
    means. An absolute ``data.root`` and a mapping without a ``data`` section are left
    as they are.
    """
    section = data.get("data")
    if not isinstance(section, dict):
        return data
    root = Path(str(section.get("root", DEFAULT_DATA_ROOT))).expanduser()
    if root.is_absolute():
        return data
    return {**data, "data": {**section, "root": str((Path(base) / root).resolve())}}


def read_experiment_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The experiment mapping in YAML file ``path``, its ``data.root`` resolved against
    the file's folder (:func:`resolve_data_root`)."""
    return resolve_data_root(read_yaml(path), Path(path).resolve().parent)


def load_experiment_source(source: ExperimentSource, registry: Registry | None = None) -> Any:
    """A validated experiment config from a config, a dict or a YAML path (a relative
    ``data.root`` in the file is relative to the file's folder)."""
    if isinstance(source, (str, os.PathLike)):
        return validate_experiment(read_experiment_file(source), registry)
    if isinstance(source, Mapping):
        return validate_experiment(dict(source), registry)
    return source


def experiment_from_run_config(
    run_config: Mapping[str, Any], registry: Registry | None = None
) -> Any:
    """The experiment a Flower run config names (keys in the module docstring).

    ``fedplug-config`` (a path) wins over ``fedplug-config-yaml`` when both are set, so
    ``--run-config "fedplug-config='/abs/params.yaml'"`` overrides an app's inline default.
    Then ``fedplug-set`` overrides (``;``-separated ``dotted.key=value``) and
    ``fedplug-algorithm`` (an entry of ``algorithms:``) apply, as ``fedplug run``'s
    ``--set`` and ``--algorithm`` do. A relative ``data.root`` (the file's or an
    override's) is resolved against the file's folder (:func:`resolve_data_root`).

    Raises:
        ConfigError: neither key is set, the YAML is invalid, or the experiment does not
            validate.
    """
    path = str(run_config.get(RUN_CONFIG_PATH, "") or "")
    text = str(run_config.get(RUN_CONFIG_YAML, "") or "")
    if not path and not text:
        raise ConfigError(
            f"the run config names no experiment: set {RUN_CONFIG_PATH!r} (a YAML file the ServerApp "
            f"can read) or {RUN_CONFIG_YAML!r} (inline YAML), e.g. flwr run . <superlink> --run-config "
            f"\"{RUN_CONFIG_PATH}='/abs/path/params.yaml'\""
        )
    if path:
        data = read_yaml(path)
    else:
        data = parse_yaml(text, f"run config {RUN_CONFIG_YAML!r}")
    for assignment in str(run_config.get(RUN_CONFIG_OVERRIDES, "") or "").split(";"):
        if assignment.strip():
            data = apply_override(data, assignment.strip())
    algorithm = str(run_config.get(RUN_CONFIG_ALGORITHM, "") or "")
    if algorithm:
        data = with_algorithm(data, algorithm)
    if path:
        data = resolve_data_root(data, Path(path).expanduser().resolve().parent)
    return validate_experiment(data, registry)


def run_on_grid(
    grid: Grid,
    experiment: ExperimentSource,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    registry: Registry | None = None,
    federated_evaluation: bool = True,
    node_wait_seconds: float = 300.0,
    timeout: float = 3600.0,
    train_config: Mapping[str, Any] | None = None,
    observers: Iterable[RoundObserver] = (),
    resume: bool = True,
    track: bool | None = None,
    algorithm: str | None = None,
    project_root: str | os.PathLike[str] | None = None,
) -> tuple[RunResult, FedplugStrategy]:
    """Run one fedplug experiment on the nodes of ``grid`` (inside a ServerApp).

    The server loads the dataset for its held-out test set and the input shape only; the
    nodes build their own shards. With ``out_dir`` it writes what ``fedplug run`` writes:
    ``config.yaml``, ``run_info.json``, ``metrics.json``, ``model.pt`` and a per-round
    ``checkpoint.pt``, from which a ServerApp stopped mid-run resumes (the same
    experiment and out_dir, after its last finished round; a checkpoint of another
    experiment stops the run with one line saying so).

    Args:
        grid: the ServerApp's grid.
        experiment: a validated experiment config, a dict, or a YAML path.
        out_dir: output folder (default: write nothing).
        registry: the component registry (default: the installed plugins).
        federated_evaluation: ask every node for its local test accuracy each round.
        node_wait_seconds: how long to wait for data.num_clients nodes.
        timeout: bound of each message exchange, seconds (default 3600). With
            ``train.failures.client_timeout_seconds`` (T) set, every node's training is
            interrupted at T and an exchange ends once no reply has come for T plus a
            margin; a node that hangs is dropped from its round (:mod:`.chains`).
        train_config: extra entries for every train message's ConfigRecord.
        observers: called with every round's record.
        resume: with ``out_dir``, continue after the last round of ``checkpoint.pt``
            there (the strategy saves it after every round) when it holds this run;
            False starts over (the old checkpoint is deleted).
        track: log the run through :func:`fedplug.tracking.open_tracker` (default None:
            the experiment's ``tracking.enabled``). A resumed run (a checkpoint in
            ``out_dir``) continues the MLflow run recorded there.
        algorithm: the label of the tracked run (its name
            ``<dataset>-<algorithm>-seed<seed>`` and tag ``fedplug.algorithm``; default
            the aggregator's name).
        project_root: folder of the default local store ``mlflow.db`` (default: the
            project of ``experiment`` when it is a path, see
            :func:`fedplug.project.project_root`, else ``$DVC_ROOT`` or the working folder).

    Returns:
        The run's :class:`RunResult` and the strategy (its ``final_vector``, ``model``).
    """
    if registry is None:
        from fedplug.plugins import default_registry

        registry = default_registry()
    source_path = experiment if isinstance(experiment, (str, os.PathLike)) else None
    experiment = load_experiment_source(experiment, registry)
    choose_run_threads(experiment.train)  # train.threads, else 1: once per process, before the data loads
    dataset = load_dataset(experiment.data, registry)
    device = resolve_device(experiment.train.device)
    out = Path(out_dir) if out_dir else None
    # The folder is fedplug's for this experiment, or new: refused in one line when it holds
    # other files, another experiment's run, or another process's run (fedplug.output_folder).
    fingerprint = output_fingerprint(experiment)
    owned = (
        claim(
            out,
            fingerprint,
            legacy=run_folder_layout(fingerprint),
            option=RUN_CONFIG_OUT,
            force_option=None,
        )
        if out is not None
        else contextlib.nullcontext()
    )
    with owned:
        checkpoint = out / CHECKPOINT_FILE if out is not None else None
        if checkpoint is not None and not resume:
            checkpoint.unlink(missing_ok=True)
        resuming = checkpoint is not None and checkpoint.exists()
        tracker = open_server_tracker(
            experiment,
            out,
            track=track,
            algorithm=algorithm,
            project_root=project_root if project_root is not None else _project_of(source_path),
            resume=resuming,
        )
        with tracker:  # FINISHED on success; FAILED (kept for resuming) on an error
            run_result, strategy = _run_tracked(
                grid,
                experiment,
                dataset,
                device,
                out,
                checkpoint,
                resuming,
                tracker,
                registry=registry,
                federated_evaluation=federated_evaluation,
                node_wait_seconds=node_wait_seconds,
                timeout=timeout,
                train_config=train_config,
                observers=observers,
            )
    return run_result, strategy


def open_server_tracker(
    experiment: Any,
    out_dir: str | os.PathLike[str] | None,
    *,
    track: bool | None = None,
    algorithm: str | None = None,
    project_root: str | os.PathLike[str] | None = None,
    resume: bool = True,
    tags: Mapping[str, str] | None = None,
) -> Tracker:
    """The tracker of a Flower server run (:func:`fedplug.tracking.open_tracker` with the
    Flower runtime's tags); a tracker that logs nothing when tracking is off.

    Args:
        experiment: the validated experiment config.
        out_dir: the run's output folder (keeps ``mlflow_run.json`` for resuming; default
            None: nothing to resume).
        track: default None: ``experiment.tracking.enabled``.
        algorithm: the run's label: its name ``<algorithm>-seed<seed>-<config
            hash>-<dataset>`` (:func:`fedplug.tracking.naming.command_line_run_name`) and tag
            ``fedplug.algorithm`` (default: the aggregator's name).
        project_root: folder of the default local store (default: ``$DVC_ROOT`` or the
            working folder).
        resume: continue the MLflow run recorded in ``out_dir`` (default True).
        tags: extra tags (default none).
    """
    from fedplug.tracking.naming import open_command_line_tracker

    tracker = open_command_line_tracker(
        experiment,
        out_dir,
        "flower",
        algorithm=algorithm,
        tags=tags,
        resume=resume,
        project_root=project_root if project_root is not None else _project_of(None),
        enabled=track,
    )
    if tracker.run_id is not None:
        logger.info(
            "fedplug: MLflow run %s in %s%s",
            tracker.run_id,
            tracker.uri,
            " (resumed)" if tracker.resumed else "",
        )
    return tracker


def _project_of(source_path: str | os.PathLike[str] | None) -> Path:
    from fedplug.project import project_root

    return project_root(source_path)


def _run_tracked(
    grid: Grid,
    experiment: Any,
    dataset: Any,
    device: Any,
    out: Path | None,
    checkpoint: Path | None,
    resuming: bool,
    tracker: Tracker,
    *,
    registry: Registry,
    federated_evaluation: bool,
    node_wait_seconds: float,
    timeout: float,
    train_config: Mapping[str, Any] | None,
    observers: Iterable[RoundObserver],
) -> tuple[RunResult, FedplugStrategy]:
    if tracker.enabled:
        observers = [*observers, tracker.log_round]
    strategy = FedplugStrategy(
        experiment.train,
        num_clients=experiment.data.num_clients,
        num_classes=dataset.num_classes,
        query_nodes=True,  # the ready ClientApp answers it: client k is partition-id k
        input_shape=tuple(dataset.input_shape),
        registry=registry,
        message_config=experiment_message_config(experiment),
        federated_evaluation=federated_evaluation,
        node_wait_seconds=node_wait_seconds,
        target_accuracy=experiment.study.target_accuracy,
        checkpoint_path=checkpoint,
        observers=observers,
    )
    test_x = torch.as_tensor(dataset.test_x, dtype=torch.float32).to(device)
    test_y = torch.as_tensor(dataset.test_y, dtype=torch.long).to(device)
    evaluate_fn = central_evaluation(
        copy.deepcopy(strategy.model), test_x, test_y, experiment.train.eval_batch_size
    )
    if out is not None and not resuming:
        # A resumed run keeps the config.yaml that belongs to its checkpoint until the
        # strategy has checked the checkpoint against this experiment.
        _write_run_description(out, experiment)
    strategy.start(
        grid,
        timeout=timeout,
        train_config=ConfigRecord(dict(train_config)) if train_config else None,
        evaluate_fn=evaluate_fn,
    )
    run_result = strategy.run_result
    if run_result is None:
        raise RuntimeError("FedplugStrategy.start finished without a result")
    if out is not None:
        if resuming:
            _write_run_description(out, experiment)
        write_json(out / "metrics.json", run_result.summary())
        state = strategy.model.state_dict()
        write_atomically(out / "model.pt", lambda handle: torch.save(state, handle), what="model")
    if tracker.enabled:
        # The rounds a resumed checkpoint restored (or that ended before an observer saw
        # them) are logged here; the tracker skips those the MLflow run already holds.
        tracker.log_result(run_result)
        tracker.log_model(copy.deepcopy(strategy.model).cpu(), test_x[:5].cpu())
        if out is not None:
            for name in ("config.yaml", "run_info.json", "metrics.json"):
                tracker.log_artifacts({"": out / name})  # one call each: the key is the folder
    return run_result, strategy


def _write_run_description(out: Path, experiment: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_yaml(out / "config.yaml", experiment.model_dump(mode="json"))
    write_json(out / "run_info.json", {**run_info(), "runtime": "flower"})


def make_server_app(
    experiment: ExperimentSource | None = None,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    federated_evaluation: bool | None = None,
    on_result: Callable[[RunResult, FedplugStrategy], None] | None = None,
    track: bool | None = None,
) -> ServerApp:
    """A ServerApp that runs ``experiment`` (default: the one the run config names).

    Args:
        experiment: config, dict or YAML path; ``None`` reads the run config.
        out_dir: output folder (default: run config ``fedplug-out``, else none).
        federated_evaluation: default: run config ``fedplug-federated-evaluation``, else True.
        on_result: called with the result when the run ends (in-process runs and tests).
        track: log the run to MLflow (default: run config ``fedplug-track``, else the
            experiment's ``tracking.enabled``).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        report_fedplug_errors_in_one_line()
        run_config = context.run_config
        chosen = experiment if experiment is not None else experiment_from_run_config(run_config)
        evaluation = federated_evaluation
        if evaluation is None:
            evaluation = bool(run_config.get(RUN_CONFIG_FEDERATED_EVALUATION, True))
        tracking = track
        if tracking is None and RUN_CONFIG_TRACK in run_config:
            tracking = bool(run_config[RUN_CONFIG_TRACK])
        config_path = str(run_config.get(RUN_CONFIG_PATH, "") or "") or None
        source_path = chosen if isinstance(chosen, (str, os.PathLike)) else config_path
        # fedplug-algorithm labels the run only when the run config chose the experiment.
        algorithm = ""
        if experiment is None:
            algorithm = str(run_config.get(RUN_CONFIG_ALGORITHM, "") or "")
        result, strategy = run_on_grid(
            grid,
            chosen,
            out_dir=out_dir or (str(run_config.get(RUN_CONFIG_OUT, "")) or None),
            federated_evaluation=evaluation,
            node_wait_seconds=number(run_config, RUN_CONFIG_NODE_WAIT, 300.0),
            resume=bool(run_config.get(RUN_CONFIG_RESUME, True)),
            track=tracking,
            algorithm=algorithm or None,
            project_root=_project_of(source_path),
        )
        if on_result is not None:
            on_result(result, strategy)

    return app


def make_client_app() -> ClientApp:
    """The ClientApp that answers :class:`FedplugStrategy`'s messages for a node's
    client of the experiment (see :mod:`.nodes`)."""
    app = ClientApp()
    # It builds whatever components the server's experiment names.
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
    app.query()(handle_query)
    app.train()(handle_train)
    # One handler per setup phase an installed loss transform declares (FedDisk's).
    from fedplug.plugins import default_registry

    register_setup_phases(app, handle_setup_phase, setup_phase_names(default_registry()))
    app.evaluate()(handle_evaluate)
    return app


server_app = make_server_app()
client_app = make_client_app()
