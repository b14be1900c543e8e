"""The experiment config: one strict pydantic model, built from the plugin registry.

The algorithm slots (``sampler``, ``loss_transform``, ``aggregator``, ``grouper``) and
the ``dataset``, ``partition`` and ``model`` entries are discriminated unions over the
``name`` of every registered component, so a third-party plugin's parameters validate
exactly like the built-ins'. Everything is ``extra="forbid"``: a typo is an error that
names its path, e.g. ``train.aggregator.momentum: Input should be less than 1``.

Layout of a config file (``params.yaml`` is one)::

    study:      name, seeds, target accuracy          (what the pipeline compares)
    tracking:   where runs are logged (MLflow, TensorBoard) (every runtime)
    data:       dataset, partition, clients           (read by the partition stage)
    train:      model, the four slots, optimiser, ... (read by the train stage)
    algorithms: {label: overrides of train}           (the pipeline's matrix)
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, create_model, model_serializer, model_validator

from fedplug.components import SLOTS, ComponentConfig, StrictConfig
from fedplug.config_errors import format_validation_error  # callers import it from here too
from fedplug.deadline import LONGEST_CLIENT_TIMEOUT_SECONDS
from fedplug.errors import ConfigError
from fedplug.faults import FaultsConfig
from fedplug.registry import Registry
from fedplug.safe_files import read_regular_bytes
from fedplug.screening import ScreeningConfig

# Config field -> registry kind, for every field that selects a component by name.
COMPONENT_FIELDS = {
    "dataset": "datasets",
    "partition": "partitioners",
    "model": "models",
    "sampler": "samplers",
    "loss_transform": "loss_transforms",
    "aggregator": "aggregators",
    "grouper": "groupers",
}
ALGORITHM_SLOTS = SLOTS
"""The algorithm slots of ``train`` (:data:`fedplug.components.SLOTS`)."""

MAX_SEED = 2**32 - 1
"""The largest seed (``train.seed``, ``data.seed``, ``study.seeds``): FedML seeds numpy's
legacy generator with ``train.seed``, which takes 32 bits; torch takes 64."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


def component_entry(value: Any) -> Any:
    """A component entry in its long form: ``aggregator: fedavg`` is short for
    ``aggregator: {name: fedavg}``. Anything but a string is returned as it is."""
    return {"name": value} if isinstance(value, str) else value


class StrictModel(StrictConfig):
    """Base of the config sections (see :class:`fedplug.components.StrictConfig`)."""


class OptimizerConfig(StrictModel):
    """The clients' local optimiser."""

    name: Literal["sgd", "adam"] = "sgd"
    """``sgd`` (with optional momentum and weight decay) or ``adam``."""
    lr: float = Field(0.05, gt=0, le=10)
    """Client learning rate eta."""
    momentum: float = Field(0.0, ge=0, lt=1)
    """SGD momentum (0 = plain SGD); ignored by adam."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """L2 weight decay added to the gradient."""


class FailurePolicy(StrictModel):
    """What the simulator does with clients that fail."""

    max_failed_fraction: float = Field(0.5, ge=0, le=1)
    """If more than this fraction of a round's updates fail, the round is retried."""
    max_round_retries: int = Field(1, ge=0, le=10)
    """Retries of a round with too many failures before the run stops with an error."""
    client_timeout_seconds: float | None = Field(None, gt=0, le=LONGEST_CLIENT_TIMEOUT_SECONDS)
    """A client whose local training takes longer than this is dropped (None = no limit in
    the simulator; Flower and FedML then wait an hour for a reply, see docs/reliability.md).
    At most 1e6 s (:data:`fedplug.deadline.LONGEST_CLIENT_TIMEOUT_SECONDS`)."""


class StudyConfig(StrictModel):
    """What a study compares; read by the pipeline and the report."""

    name: str = Field("fedplug", min_length=1)
    """MLflow experiment name."""
    seeds: list[Seed] = Field(default_factory=lambda: [0], min_length=1)
    """The pipeline runs every algorithm once per seed."""
    target_accuracy: float = Field(0.9, gt=0, le=1)
    """Accuracy for 'rounds to target' in the report."""


class TrackingConfig(StrictModel):
    """Where runs are tracked (:func:`fedplug.tracking.open_tracker`): ``fedplug run``,
    the pipeline's train stage, the study runner, Flower's server side and FedML."""

    enabled: bool = True
    """Log the run; False = log nothing (``fedplug run --track`` / ``--no-track`` override it)."""
    backends: list[str] = Field(default_factory=lambda: ["mlflow"], min_length=1)
    """Trackers to log to: ``mlflow``, ``tensorboard`` (event files in the run's
    ``tensorboard/`` folder), or one a plugin registers (``fedplug_register_trackers``)."""
    register_model: str | None = Field(None, min_length=1)
    """Register each run's final model under this name in the MLflow model registry
    (None = log it with the run only)."""
    uri: str | None = None
    """Tracking URI; None = ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///mlflow.db``."""
    fallback_to_local: bool = False
    """If the server does not answer: False = stop before training; True = log to the
    local store and say so."""
    on_error: Literal["continue", "stop"] = "continue"
    """If the tracking server stops answering *during* training: ``continue`` (default)
    warns once, keeps the unsent metrics and sends them when it answers again (or when the
    same command is run again); ``stop`` ends the run with one line (the checkpoint is
    kept, so the same command resumes). Either way an unreachable server costs a bounded
    wait, never MLflow's default minutes of retries."""


class DataConfigBase(StrictModel):
    """The federation: which data, split how, over how many clients."""

    dataset: ComponentConfig
    partition: ComponentConfig
    num_clients: int = Field(10, ge=1, le=1_000_000)
    """K, the number of clients."""
    local_test_fraction: float = Field(0.2, ge=0, lt=1)
    """Share of each client's samples kept as its local test split."""
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    """Share of each client's training samples (what the local test split leaves) held
    out as its validation split, seeded like it: never trained on; the global model's
    ``val_accuracy`` and ``val_loss`` on the clients' validation samples are recorded
    each round (hyperparameter search chooses on them, never on a test set). Default 0.0:
    no validation split; then left out of the resolved config, so run folders,
    checkpoints and study records of earlier versions still match."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the partition and the local train/test split (at most 2**32 - 1)."""
    root: str = "data/raw"
    """Folder the datasets are read from (and downloaded to); a relative path is read
    against the config file's folder, where the MLflow store ``mlflow.db`` also is."""

    _folder: Path | None = PrivateAttr(default=None)
    """The folder of the config file this section was read from (None: built in code)."""

    def read_against(self, folder: str | os.PathLike[str] | None) -> "DataConfigBase":
        """Read a relative ``root`` against ``folder`` (a config file's folder, as given: a
        relative one keeps messages short; None = the working folder) from now on; returns
        ``self``. :func:`load_experiment` calls it."""
        self._folder = Path(folder) if folder is not None else None
        return self

    @model_serializer(mode="wrap")
    def _without_default_validation(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict) and self.validation_fraction == 0.0:
            data.pop("validation_fraction", None)
        return data

    def root_path(self) -> Path:
        """``root`` as the folder to read: an absolute ``root`` as it is, a relative one
        against the config file's folder (:meth:`read_against`), else the working folder.
        ``root`` itself keeps what the file says, so the resolved config (``config.yaml``,
        the output folder's fingerprint) does not depend on where the project lies."""
        root = Path(self.root).expanduser()
        return root if root.is_absolute() or self._folder is None else self._folder / root


class TrainConfigBase(StrictModel):
    """Training: model, algorithm slots, schedule, optimiser, engine."""

    model: ComponentConfig
    sampler: ComponentConfig
    loss_transform: ComponentConfig
    aggregator: ComponentConfig
    grouper: ComponentConfig
    client_fraction: float = Field(1.0, gt=0, le=1)
    """Fraction of the K clients sampled each round (at least one)."""
    rounds: int = Field(20, ge=1, le=100_000)
    """Number of communication rounds R."""
    local_epochs: int = Field(1, ge=1, le=1000)
    """Local epochs E per client per round."""
    batch_size: int = Field(10, ge=1, le=1_000_000)
    """Local mini-batch size B."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of model initialisation, client sampling and local shuffling (at most 2**32 - 1)."""
    engine: Literal["auto", "sequential", "vectorized", "parallel"] = "auto"
    """``sequential`` (one client after another), ``vectorized`` (clients in lockstep: with
    torch.func.vmap, or as batched matrix products for Linear/ReLU models under plain
    cross-entropy, faster than ``sequential`` on a CPU too), ``parallel`` (the clients of a
    round spread over ``workers`` forked CPU processes, one torch thread each; same results
    as ``sequential``, bit for bit), or ``auto`` (vectorized on CUDA when the setup allows,
    else sequential: on a CPU, vmap loses to the loop, docs/performance.md)."""
    workers: int | None = Field(None, ge=1, le=1024)
    """Worker processes of engine ``parallel`` (None = one per CPU this process may run
    on, ``len(os.sched_getaffinity(0))``); a round with fewer chains starts fewer."""
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:\d+)?)$")
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available)."""
    eval_batch_size: int = Field(1000, ge=1)
    """Batch size for evaluation."""
    failures: FailurePolicy = Field(default_factory=FailurePolicy)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    """Faults injected on purpose (dropout, stragglers, corrupted updates; default none):
    see :mod:`fedplug.faults`."""
    screening: ScreeningConfig = Field(default_factory=ScreeningConfig)
    """Bounds on what one client's reply may claim (its update's norm, its share of the
    aggregation weight, its sample count against the class counts): see
    :mod:`fedplug.screening`. Left out of the resolved config while every bound is at its
    default, so run folders, checkpoints and study records of earlier versions still match."""

    @model_serializer(mode="wrap")
    def _without_default_screening(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict) and self.screening == ScreeningConfig():
            data.pop("screening", None)
        return data

    @model_validator(mode="after")
    def _components_fit_together(self) -> "TrainConfigBase":
        reasons: list[str] = []
        for slot in ("model",) + ALGORITHM_SLOTS:
            component: ComponentConfig = getattr(self, slot)
            reasons += [f"{slot} {component.name!r}: {why}" for why in component.incompatibilities(self)]
        if self.engine == "vectorized" and self.optimizer.name != "sgd":
            reasons.append("engine 'vectorized' implements SGD only; use optimizer.name: sgd")
        if self.engine == "parallel" and self.device.startswith("cuda"):
            reasons.append(
                "engine 'parallel' trains in CPU worker processes; on CUDA use engine 'vectorized' or "
                "'sequential', or device: cpu"
            )
        if self.workers is not None and self.engine != "parallel":
            reasons.append(f"workers is set but engine is {self.engine!r}; set engine: parallel or remove workers")
        if reasons:
            raise ValueError("incompatible combination: " + "; ".join(reasons))
        return self


class ExperimentConfigBase(StrictModel):
    study: StudyConfig = Field(default_factory=StudyConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    data: DataConfigBase
    train: TrainConfigBase
    algorithms: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Named overrides of ``train`` (the pipeline trains one run per entry)."""


DEFAULT_COMPONENTS = {
    "sampler": "uniform",
    "loss_transform": "cross_entropy",
    "aggregator": "fedavg",
    "grouper": "none",
    "model": "mlp",
}


def _component_field(registry: Registry, field: str) -> tuple[Any, Any]:
    kind = COMPONENT_FIELDS[field]
    classes = tuple(entry.config_class for entry in registry.entries(kind))
    if not classes:
        raise ConfigError(f"no {kind} are registered; is fedplug installed correctly?")
    annotation: Any = classes[0] if len(classes) == 1 else Annotated[Union[classes], Field(discriminator="name")]
    default_name = DEFAULT_COMPONENTS.get(field)
    if default_name is not None and default_name in registry.names(kind):
        config_class = registry.get(kind, default_name).config_class
        return annotation, Field(default_factory=lambda: config_class(name=default_name))
    return annotation, ...


def _name_check(registry: Registry, field: str):
    kind = COMPONENT_FIELDS[field]
    noun = kind[:-1].replace("_", " ")

    def check(value: Any) -> Any:
        value = component_entry(value)
        if isinstance(value, dict):
            name = value.get("name")
            if name is None:
                raise ValueError(f"missing 'name:'; choose one of: {', '.join(registry.names(kind))}")
            if name not in registry.names(kind):
                raise ValueError(
                    f"unknown {noun} {name!r}; registered: {', '.join(registry.names(kind))}"
                    + _registered_elsewhere(registry, name, field)
                )
        return value

    return check


def _registered_elsewhere(registry: Registry, name: str, field: str) -> str:
    """`` ('fedprox' is a loss_transform: set train.loss_transform: fedprox)`` when ``name``
    is registered for another config field than ``field``; else ``""``."""
    hints = [
        f"{name!r} is a {other}: set {'data' if other in ('dataset', 'partition') else 'train'}.{other}: {name}"
        for other, kind in COMPONENT_FIELDS.items()
        if other != field and name in registry.names(kind)
    ]
    return f" ({'; '.join(hints)})" if hints else ""


def _with_components(base: type[StrictModel], registry: Registry, fields: tuple[str, ...]) -> type[StrictModel]:
    from pydantic import field_validator

    definitions = {field: _component_field(registry, field) for field in fields}
    validators = {
        f"_check_{field}": field_validator(field, mode="before")(staticmethod(_name_check(registry, field)))
        for field in fields
    }
    return create_model(base.__name__.removesuffix("Base"), __base__=base, __validators__=validators, **definitions)


@functools.lru_cache(maxsize=8)
def config_models(registry: Registry) -> tuple[type[StrictModel], type[StrictModel], type[StrictModel]]:
    """``(ExperimentConfig, DataConfig, TrainConfig)`` classes for this registry."""
    data_config = _with_components(DataConfigBase, registry, ("dataset", "partition"))
    train_config = _with_components(
        TrainConfigBase, registry, ("model", "sampler", "loss_transform", "aggregator", "grouper")
    )
    experiment_config = create_model(
        "ExperimentConfig", __base__=ExperimentConfigBase, data=(data_config, ...), train=(train_config, ...)
    )
    return experiment_config, data_config, train_config


def _registry(registry: Registry | None) -> Registry:
    if registry is None:
        from fedplug.plugins import default_registry

        registry = default_registry()
    return registry


# ------------------------------------------------------------------ merging


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``; a component whose ``name`` changes is replaced
    whole (its old parameters belong to another algorithm)."""
    merged = dict(base)
    for key, value in override.items():
        old = merged.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and value.get("name", old.get("name")) == old.get("name"):
            merged[key] = deep_merge(old, value)
        else:
            merged[key] = value
    return merged


def apply_override(data: dict[str, Any], assignment: str) -> dict[str, Any]:
    """Apply one ``dotted.key=value`` (value parsed as YAML) to a nested dict."""
    key, separator, raw = assignment.partition("=")
    if not separator or not key.strip():
        example = key.strip() if key.strip() and " " not in key.strip() else "train.rounds"
        raise ConfigError(
            f"--set {_shown(assignment)}: expected dotted.key=value; write --set {example}=VALUE "
            f"(or --set {example} VALUE), e.g. --set train.rounds=5"
        )
    if key.count(".") >= MAX_NESTING:
        raise ConfigError(
            f"--set {_shown(assignment)}: the key has {key.count('.') + 1} parts, more than {MAX_NESTING}; "
            "fedplug's keys have fewer than 10"
        )
    try:
        where = too_deep(raw)
        if where is not None:
            raise ConfigError(
                f"--set {_shown(assignment)}: the value is nested more than {MAX_NESTING} levels deep "
                f"(at column {where[1]}); fedplug's values nest fewer than 10"
            )
        value = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {_shown(assignment)}: the value is not valid YAML ({error})") from None
    return set_dotted(data, key.strip(), value)


def _shown(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to about ``limit`` characters (a huge ``--set`` stays one line)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def set_dotted(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``data`` with the dotted ``key`` set to ``value``, merged by :func:`deep_merge`.

    A name given to a component field switches the component
    (``train.aggregator=fedavgm``); a value under it tunes the component
    (``train.aggregator.momentum=0.5``).
    """
    keys = key.split(".")
    override: dict[str, Any] = {}
    node = override
    for part in keys[:-1]:
        node = node.setdefault(part, {})
    node[keys[-1]] = component_entry(value) if keys[-1] in COMPONENT_FIELDS else value
    return deep_merge(data, override)


# -------------------------------------------------------------------------- loading

MAX_NESTING = 50
"""The deepest nesting of mappings and lists a config file or ``--set`` value may have
(fedplug's own configs nest 6 levels). PyYAML builds a document recursively, so a few
hundred levels would end in a ``RecursionError``; :func:`too_deep` checks first."""


def too_deep(text: str) -> tuple[int, int] | None:
    """``(line, column)`` (1-based) where ``text``'s YAML nests more than
    :data:`MAX_NESTING` mappings or lists, or None. Reads PyYAML's event stream, which
    is not recursive, and stops at the first level too many.

    Raises:
        yaml.YAMLError: ``text`` is not valid YAML before that point.
    """
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_NESTING:
                return event.start_mark.line + 1, event.start_mark.column + 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return None



class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, where PyYAML
    would silently keep the last value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first_line = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first_line is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given at line {first_line + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping, with errors that say which file and line."""
    path = Path(path)
    try:
        # Not read_text(): a FIFO or device given as the config is refused, not waited on.
        text = read_regular_bytes(
            path, what="config file", advice="give a params file (a regular file)", error=ConfigError
        ).decode()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8"
        ) from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror}") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The YAML mapping in ``text`` (``source`` names it in errors: a file, a run-config
    key), refused in one line when it is invalid, nested too deep, or not a mapping."""
    try:
        where = too_deep(text)
        if where is not None:
            raise ConfigError(
                f"{source}: nested more than {MAX_NESTING} levels deep at line {where[0]}, column {where[1]}; "
                "a fedplug config nests fewer than 10 levels"
            )
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (data:, train:, ...), got {type(data).__name__}")
    return data


def validate_experiment(
    data: dict[str, Any], registry: Registry | None = None, *, check_every_algorithm: bool = True
) -> Any:
    """Validate a whole experiment dict, including every entry of ``algorithms``.

    ``check_every_algorithm=False`` (one run of ``train``, e.g. ``fedplug run`` with
    ``--set`` overrides) still rejects typos and out-of-range values in every entry, but
    not an entry that only becomes an incompatible combination with the overridden
    ``train``: that entry is not what runs.
    """
    experiment_config, _, train_config = config_models(_registry(registry))
    try:
        config = experiment_config.model_validate(data)
    except ValidationError as error:
        raise ConfigError("invalid config:\n" + format_validation_error(error, data, model=experiment_config)) from None
    for label, override in config.algorithms.items():
        merged = deep_merge(data.get("train", {}), override)
        try:
            train_config.model_validate(merged)
        except ValidationError as error:
            if not check_every_algorithm and all(_is_incompatibility(item) for item in error.errors()):
                continue
            raise ConfigError(
                "invalid config:\n"
                + format_validation_error(error, override, prefix=f"algorithms.{label}", model=train_config)
            ) from None
    return config


def _is_incompatibility(item: Any) -> bool:
    return item["loc"] == () and "incompatible combination" in item["msg"]


def with_algorithm(data: dict[str, Any], label: str) -> dict[str, Any]:
    """The experiment dict with ``algorithms[label]`` applied to ``train``."""
    algorithms = data.get("algorithms") or {}
    if label not in algorithms:
        known = ", ".join(algorithms) or "(none defined)"
        raise ConfigError(f"unknown algorithm {label!r}; params file defines: {known}")
    merged = dict(data)
    merged["train"] = deep_merge(data.get("train", {}), algorithms[label] or {})
    return merged


def load_experiment(
    path: str | os.PathLike[str],
    overrides: list[str] | tuple[str, ...] = (),
    algorithm: str | None = None,
    registry: Registry | None = None,
    *,
    check_every_algorithm: bool = True,
) -> Any:
    """Read, override and validate an experiment config file (see
    :func:`validate_experiment` for ``check_every_algorithm``). A relative ``data.root``
    is read against the file's folder (:meth:`DataConfigBase.root_path`)."""
    data = read_yaml(path)
    for assignment in overrides:
        data = apply_override(data, assignment)
    if algorithm is not None:
        # Validate the file as written first, so that a bad value in algorithms.<label> is
        # reported at that path (not at the train.* path it is merged into).
        validate_experiment(data, registry, check_every_algorithm=check_every_algorithm)
        data = with_algorithm(data, algorithm)
    config = validate_experiment(data, registry, check_every_algorithm=check_every_algorithm)
    config.data.read_against(Path(path).parent)
    return config


def validate_section(section: Literal["data", "train"], data: Any, registry: Registry | None = None) -> Any:
    """Validate one section (for pipeline stages that read only their slice)."""
    _, data_config, train_config = config_models(_registry(registry))
    model = data_config if section == "data" else train_config
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as error:
        raise ConfigError(
            "invalid config:\n" + format_validation_error(error, data, prefix=section, model=model)
        ) from None


def flatten(config: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train.aggregator.momentum": 0.9, ...}``: the resolved config as flat params."""
    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat
