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

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, create_model, model_serializer, model_validator

from fedplug.components import SLOTS, ComponentConfig, StrictConfig
from fedplug.config_errors import format_validation_error  # callers import it from here too
# Reading a file and --set needs no registry (fedplug.config_files); callers import these from here too.
from fedplug.config_files import COMPONENT_FIELDS, component_entry, deep_merge, read_with_overrides
from fedplug.config_files import MAX_NESTING, apply_override, parse_yaml, read_yaml, set_dotted, too_deep  # noqa: F401
from fedplug.deadline import LONGEST_CLIENT_TIMEOUT_SECONDS
from fedplug.errors import ConfigError
from fedplug.faults import FaultsConfig
from fedplug.registry import Registry
from fedplug.screening import ScreeningConfig

ALGORITHM_SLOTS = SLOTS
"""The algorithm slots of ``train`` (:data:`fedplug.components.SLOTS`)."""

MAX_SEED = 2**32 - 1
"""The largest seed (``train.seed``, ``data.seed``, ``study.seeds``): FedML seeds numpy's
legacy generator with ``train.seed``, which takes 32 bits; torch takes 64."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


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
    threads: int | None = Field(None, ge=0, le=1024)
    """torch's intra-op threads in each process of the run (:func:`fedplug.threads.choose_threads`;
    ``fedplug run --threads N`` overrides it): None = ``$FEDPLUG_TORCH_THREADS``, else 1 (the
    models are too small to split: torch's default of one thread per core was 30-40x slower
    on a shared 2-core machine); 0 = torch's default. Never more than the cores a process may
    use, shared among the parallel engine's workers. On CUDA it concerns the CPU-side work
    only. Left out of the resolved config while None, so earlier run folders, checkpoints
    and study records still match."""
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
        if isinstance(data, dict) and self.threads is None:
            data.pop("threads", None)  # as screening: earlier run folders and study hashes still match
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
        if field == "loss_transform":
            value = composed_loss_entry(value, registry)
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


COMPOSITE_LOSS = "composite"
"""The loss transform that composes several (fedplug/algorithms/composite_loss.py)."""
REGISTRY_CONTEXT = "fedplug.registry"
"""The pydantic validation-context key of the registry a composite's parts validate against."""


def composed_loss_entry(value: Any, registry: Registry) -> Any:
    """The ``loss_transform`` slot's value with a composite validated: a list of loss
    transforms (``[fedshift, {name: fedprox, mu: 0.01}]``) is short for ``{name: composite,
    parts: [...]}``, which validates here with ``registry`` in its context, so that its parts
    validate against the same registry (each at its path, ``parts.1.mu``). Anything else is
    returned as it is: a single loss transform validates (and hashes) as before."""
    if COMPOSITE_LOSS not in registry.names("loss_transforms"):
        return value
    if isinstance(value, (list, tuple)):
        value = {"name": COMPOSITE_LOSS, "parts": list(value)}
    if isinstance(value, dict) and value.get("name") == COMPOSITE_LOSS:
        config_class = registry.get("loss_transforms", COMPOSITE_LOSS).config_class
        return config_class.model_validate(value, context={REGISTRY_CONTEXT: registry})
    return value


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
    return experiment_from_document(
        read_with_overrides(path, overrides), path, algorithm, registry, check_every_algorithm=check_every_algorithm
    )


def experiment_from_document(
    data: dict[str, Any],
    path: str | os.PathLike[str],
    algorithm: str | None = None,
    registry: Registry | None = None,
    *,
    check_every_algorithm: bool = True,
) -> Any:
    """:func:`load_experiment` of a config file already read and overridden
    (:func:`~fedplug.config_files.read_with_overrides`): ``data`` is its document, ``path``
    where it was read from."""
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
