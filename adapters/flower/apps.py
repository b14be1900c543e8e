"""A ready ServerApp / ClientApp pair that runs any fedplug experiment on Flower.

``pyproject.toml`` of a Flower app (see ``examples/flower_app``)::

    [tool.flwr.app.components]
    serverapp = "fedplug.adapters.flower.apps:server_app"
    clientapp = "fedplug.adapters.flower.apps:client_app"

    [tool.flwr.app.config]
    fedplug-config = "/abs/path/params.yaml"   # or fedplug-config-yaml = "<inline YAML>"
    fedplug-algorithm = ""                     # an entry of `algorithms:` to apply
    fedplug-set = ""                           # overrides, "train.rounds=5; train.seed=1"
    fedplug-out = "/abs/path/run"              # where metrics.json & co. are written
    fedplug-federated-evaluation = true

Run config (read by the ServerApp only; the nodes receive the experiment in every
message): ``fedplug-config`` (a path the ServerApp process can read; relative paths are
relative to its working directory, so prefer absolute ones) or ``fedplug-config-yaml``
(the path wins when both are set). Node config: ``partition-id`` and ``num-partitions`` (the
simulation runtime sets both; give them to ``flower-supernode --node-config``).

For ``flwr.simulation.run_simulation`` (which passes no run config), build the server
app with the experiment directly: ``make_server_app(config_or_path)``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from flwr.app import ConfigRecord, Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedplug.config import apply_override, read_yaml, validate_experiment, with_algorithm
from fedplug.data.build import load_dataset
from fedplug.errors import ConfigError
from fedplug.experiment import run_info, write_json, write_yaml
from fedplug.registry import Registry
from fedplug.simulation.results import RunResult
from fedplug.simulation.simulator import resolve_device

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

RUN_CONFIG_PATH = "fedplug-config"
RUN_CONFIG_YAML = "fedplug-config-yaml"
RUN_CONFIG_ALGORITHM = "fedplug-algorithm"
RUN_CONFIG_OVERRIDES = "fedplug-set"
RUN_CONFIG_OUT = "fedplug-out"
RUN_CONFIG_FEDERATED_EVALUATION = "fedplug-federated-evaluation"
RUN_CONFIG_NODE_WAIT = "fedplug-node-wait-seconds"

ExperimentSource = Any
"""A validated experiment config, a dict of one, or a path to a YAML file."""


def load_experiment_source(source: ExperimentSource, registry: Registry | None = None) -> Any:
    """A validated experiment config from a config, a dict or a YAML path."""
    if isinstance(source, (str, os.PathLike)):
        return validate_experiment(read_yaml(source), registry)
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
    ``--set`` and ``--algorithm`` do.

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
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(
                f"run config {RUN_CONFIG_YAML!r} is not valid YAML: {error}"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"run config {RUN_CONFIG_YAML!r} must be a YAML mapping (data:, train:, ...)"
            )
    for assignment in str(run_config.get(RUN_CONFIG_OVERRIDES, "") or "").split(";"):
        if assignment.strip():
            data = apply_override(data, assignment.strip())
    algorithm = str(run_config.get(RUN_CONFIG_ALGORITHM, "") or "")
    if algorithm:
        data = with_algorithm(data, algorithm)
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
) -> tuple[RunResult, FedplugStrategy]:
    """Run one fedplug experiment on the nodes of ``grid`` (inside a ServerApp).

    The server loads the dataset for its held-out test set and the input shape only; the
    nodes build their own shards. With ``out_dir`` it writes what ``fedplug run`` writes:
    ``config.yaml``, ``run_info.json``, ``metrics.json`` and ``model.pt``.

    Args:
        grid: the ServerApp's grid.
        experiment: a validated experiment config, a dict, or a YAML path.
        out_dir: output folder (default: write nothing).
        registry: the component registry (default: the installed plugins).
        federated_evaluation: ask every node for its local test accuracy each round.
        node_wait_seconds: how long to wait for data.num_clients nodes.
        timeout: bound of each message exchange, seconds.
        train_config: extra entries for every train message's ConfigRecord.
        observers: called with every round's record.

    Returns:
        The run's :class:`RunResult` and the strategy (its ``final_vector``, ``model``).
    """
    if registry is None:
        from fedplug.plugins import default_registry

        registry = default_registry()
    experiment = load_experiment_source(experiment, registry)
    dataset = load_dataset(experiment.data, registry)
    device = resolve_device(experiment.train.device)
    strategy = FedplugStrategy(
        experiment.train,
        num_clients=experiment.data.num_clients,
        num_classes=dataset.num_classes,
        input_shape=tuple(dataset.input_shape),
        registry=registry,
        message_config=experiment_message_config(experiment),
        federated_evaluation=federated_evaluation,
        node_wait_seconds=node_wait_seconds,
        target_accuracy=experiment.study.target_accuracy,
        observers=observers,
    )
    test_x = torch.as_tensor(dataset.test_x, dtype=torch.float32).to(device)
    test_y = torch.as_tensor(dataset.test_y, dtype=torch.long).to(device)
    evaluate_fn = central_evaluation(
        copy.deepcopy(strategy.model), test_x, test_y, experiment.train.eval_batch_size
    )
    out = Path(out_dir) if out_dir else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_yaml(out / "config.yaml", experiment.model_dump(mode="json"))
        write_json(out / "run_info.json", {**run_info(), "runtime": "flower"})
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
        write_json(out / "metrics.json", run_result.summary())
        torch.save(strategy.model.state_dict(), out / "model.pt")
    return run_result, strategy


def make_server_app(
    experiment: ExperimentSource | None = None,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    federated_evaluation: bool | None = None,
    on_result: Callable[[RunResult, FedplugStrategy], None] | None = None,
) -> ServerApp:
    """A ServerApp that runs ``experiment`` (default: the one the run config names).

    Args:
        experiment: config, dict or YAML path; ``None`` reads the run config.
        out_dir: output folder (default: run config ``fedplug-out``, else none).
        federated_evaluation: default: run config ``fedplug-federated-evaluation``, else True.
        on_result: called with the result when the run ends (in-process runs and tests).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = context.run_config
        chosen = experiment if experiment is not None else experiment_from_run_config(run_config)
        evaluation = federated_evaluation
        if evaluation is None:
            evaluation = bool(run_config.get(RUN_CONFIG_FEDERATED_EVALUATION, True))
        result, strategy = run_on_grid(
            grid,
            chosen,
            out_dir=out_dir or (str(run_config.get(RUN_CONFIG_OUT, "")) or None),
            federated_evaluation=evaluation,
            node_wait_seconds=number(run_config, RUN_CONFIG_NODE_WAIT, 300.0),
        )
        if on_result is not None:
            on_result(result, strategy)

    return app


def make_client_app() -> ClientApp:
    """The ClientApp that answers :class:`FedplugStrategy`'s messages for a node's
    client of the experiment (see :mod:`.nodes`)."""
    app = ClientApp()
    app.query()(handle_query)
    app.train()(handle_train)
    # One handler per setup phase an installed loss transform declares (FedDisk's).
    from fedplug.plugins import default_registry

    register_setup_phases(app, handle_setup_phase, setup_phase_names(default_registry()))
    app.evaluate()(handle_evaluate)
    return app


server_app = make_server_app()
client_app = make_client_app()
